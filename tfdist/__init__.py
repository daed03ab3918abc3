"""tfdist: distributed training for TensorFlow 2 / Keras 3.

The public API, listed explicitly:

  parse_tf_config, ClusterInfo, TFConfigError   -- the cluster TF_CONFIG describes
  build_strategy, StrategyOptions, StrategyError -- the tf.distribute strategy for it
  configure_cpu_devices                          -- split the CPU into logical devices
  serve_if_needed                                -- run worker / ps servers of a PS cluster
  TfdistError                                    -- base of every error tfdist explains
"""

from tfdist.cluster import ClusterInfo, TFConfigError, parse_tf_config
from tfdist.devices import DeviceConfigurationError, configure_cpu_devices
from tfdist.errors import TfdistError
from tfdist.roles import serve_if_needed
from tfdist.strategies import (
    StrategyError,
    StrategyOptions,
    build_strategy,
    resolve_auto,
    strategy_names,
)

__version__ = "0.1.0"

__all__ = [
    "ClusterInfo",
    "DeviceConfigurationError",
    "StrategyError",
    "StrategyOptions",
    "TFConfigError",
    "TfdistError",
    "build_strategy",
    "configure_cpu_devices",
    "parse_tf_config",
    "resolve_auto",
    "serve_if_needed",
    "strategy_names",
]
