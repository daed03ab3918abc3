"""Training under a tf.distribute strategy: the loop, its config, and the smoke steps."""

from tfdist.training.config import ConfigError, TrainConfig
from tfdist.training.loop import Trainer, train
from tfdist.training.report import TrainResult
from tfdist.training.smoke import SmokeResult, run_smoke_steps

__all__ = [
    "ConfigError",
    "SmokeResult",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "run_smoke_steps",
    "train",
]
