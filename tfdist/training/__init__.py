"""Training under a tf.distribute strategy."""

from tfdist.training.smoke import SmokeResult, run_smoke_steps

__all__ = ["SmokeResult", "run_smoke_steps"]
