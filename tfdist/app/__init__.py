"""The training binary's application: a client of tfdist.fit, above the engine and the modes.

  trainer.py    Trainer / train(): a zoo model on a named dataset, compiled from a
                TrainConfig, with tfdist's public callbacks, handed to tfdist.fit
  config.py     TrainConfig, validated once; its parallel-mode fields come from the
                registry in tfdist.parallel.registry
  optim.py      the optimizer and learning-rate schedule a TrainConfig names
  evaluator.py  the evaluator task: every checkpoint evaluated beside training

Nothing below this package (the engine in tfdist.training, the modes in tfdist.parallel,
the facade in tfdist.api) imports it. Names are imported on first use.
"""

from tfdist.lazy import lazy_exports

_EXPORTS = {
    "ConfigError": "tfdist.app.config",
    "TrainConfig": "tfdist.app.config",
    "EvalRecord": "tfdist.app.evaluator",
    "evaluate_checkpoints": "tfdist.app.evaluator",
    "TrainResult": "tfdist.training.report",
    "Trainer": "tfdist.app.trainer",
    "train": "tfdist.app.trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
