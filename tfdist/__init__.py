"""tfdist: distributed training for TensorFlow 2 / Keras 3.

The public API, listed explicitly:

  fit, evaluate, predict, FitError                train / evaluate / predict any Keras model
  patch_keras                                     ... or keep model.fit: one line routes it
  StepHook                                        a link between gradients and the update
  StepCheckpoint, RunRecord                       resume at the saved step; the run's record
  LearningRateWarmup, WarmupSchedule              the linear scaling rule with warmup
  DeviceBytes                                     bytes of the variables on each device in fit
  this_task, TaskInfo, is_chief, num_workers,     this process's place in the job
  num_replicas, setup_logging                     ... and a one-call log set-up
  parse_tf_config, ClusterInfo, TFConfigError     the cluster TF_CONFIG describes
  cluster_from_environment                        ... or the environment (TF_CONFIG, JobSet)
  build_strategy, StrategyOptions, StrategyError  the tf.distribute strategy for it
  host_scope                                      build a model no device holds whole
  configure_cpu_devices                           split the CPU into logical devices
  serve_if_needed                                 run the worker / ps servers of a PS cluster
  route_stop_signals                              SIGTERM / SIGINT honoured at any moment
  TfdistError                                     base of every error tfdist explains

Subpackages: tfdist.data (TFRecord and TFDS pipelines), tfdist.collective (the ring
all-reduce and the one point-to-point transport), tfdist.parallel (the parallel modes and
their registry: ZeRO, accumulation, pipeline and tensor parallelism, local SGD, gossip, the
asynchronous corrections), tfdist.training (the engine behind fit), tfdist.app (the training
binary's application), tfdist.launch (the tfdist-launch command), tfdist.k8s (tfdist-k8s:
JobSet and TFJob manifests), tfdist.ray (Ray Train; the optional extra tfdist[ray]).

Names are imported on first use, so tools that only read TF_CONFIG (the launcher, the
TF_CONFIG checker) start without paying for a TensorFlow import.

Importing tfdist makes an uncaught TfdistError end a script as it ends the binaries: its
one-line message, no traceback, and exit code 2 for a mistake (which launchers do not
restart) or the restartable code for a lost peer (tfdist.exit_codes.install_error_hook;
TFDIST_TRACEBACK=1 shows the traceback). It also shows tfdist's own log lines without a
logging call: the chief's INFO lines, every task's warnings (tfdist.logs; TFDIST_LOG_LEVEL
turns them down).
"""

import importlib

from tfdist import logs
from tfdist.exit_codes import install_error_hook

install_error_hook()
logs.install_default()

__version__ = "0.1.0"

_EXPORTS = {
    "ClusterInfo": "tfdist.cluster",
    "TFConfigError": "tfdist.cluster",
    "parse_tf_config": "tfdist.cluster",
    "cluster_from_environment": "tfdist.cluster",
    "DeviceConfigurationError": "tfdist.devices",
    "configure_cpu_devices": "tfdist.devices",
    "TfdistError": "tfdist.errors",
    "FitError": "tfdist.errors",
    "evaluate": "tfdist.api.fit",
    "fit": "tfdist.api.fit",
    "patch_keras": "tfdist.api.keras_patch",
    "StepHook": "tfdist.training.hooks",
    "predict": "tfdist.api.predict",
    "LearningRateWarmup": "tfdist.training.callbacks",
    "DeviceBytes": "tfdist.training.memory",
    "host_scope": "tfdist.parallel.host",
    "StepCheckpoint": "tfdist.training.checkpoints",
    "RunRecord": "tfdist.training.report",
    "WarmupSchedule": "tfdist.training.callbacks",
    "TaskInfo": "tfdist.task",
    "this_task": "tfdist.task",
    "is_chief": "tfdist.task",
    "num_workers": "tfdist.task",
    "num_replicas": "tfdist.task",
    "setup_logging": "tfdist.logs",
    "serve_if_needed": "tfdist.roles",
    "route_stop_signals": "tfdist.signals",
    "StrategyError": "tfdist.strategies",
    "StrategyOptions": "tfdist.strategies",
    "build_strategy": "tfdist.strategies",
    "resolve_auto": "tfdist.strategies",
    "strategy_kind": "tfdist.strategies",
    "strategy_names": "tfdist.strategies",
}

# Subpackages, imported on first use too: `import tfdist` then `tfdist.data.tfrecord_dataset`.
_SUBPACKAGES = ("app", "collective", "data", "k8s", "launch", "parallel", "ray", "training")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        try:
            return importlib.import_module(f"tfdist.{name}")  # sets the attribute as it imports
        except ModuleNotFoundError as e:  # an optional extra (ray, PyYAML) not installed
            raise AttributeError(
                f"tfdist.{name} needs {e.name}, which is not installed: pip install 'tfdist[{name}]'"
            ) from e
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tfdist' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_SUBPACKAGES])
