"""build_strategy(): turn a name, the cluster and the hardware into a tf.distribute.Strategy.

Example:

    >>> import tfdist
    >>> tfdist.configure_cpu_devices(2)
    >>> strategy = tfdist.build_strategy("mirrored", all_reduce="hierarchical_copy")
    >>> strategy.num_replicas_in_sync
    2

One module per concern:

  options.py           StrategyOptions, the choices they take, StrategyError
  registry.py          build_strategy, the name -> builder dict, 'auto', strategy_kind
  single_host.py       one_device, mirrored, central_storage
  multi_worker.py      multi_worker_mirrored, whether a strategy joins worker processes,
                       and this process's rank among them
  parameter_server.py  parameter_server, the TF_CONFIG names of the workers it trains on, and
                       whether a strategy trains through a ClusterCoordinator
  tpu.py               TPU discovery, the tpu builder, the paths a TPU Node can reach, and
                       what TPU cores ask of training (runs_on_tpu, batch_multiple)
  all_reduce.py        the CrossDeviceOps an all_reduce option names (TensorFlow's or the ring)
  cluster_checks.py    what a multi-process strategy checks of the cluster first
  replicas.py          ReplicaPlacement: where a strategy's replicas are (devices, processes,
                       rank), as runners and split layers ask it
  defaults.py          what 'auto' means for settings that depend on the hardware
  smoke.py             a few exact training steps of a tiny model under any strategy
  keras_guard.py       Keras's own model.fit/evaluate/predict, guarded (or routed to tfdist)
                       where they cannot train under a strategy or on a split model

Builders change no TensorFlow class and keep nothing about the strategies they build in
module globals: what a later step needs to know (the TF_CONFIG names of a parameter-server
job's workers) travels with the strategy. The private TensorFlow entry points they need are
in tfdist.compat.

What depends on the kind of a strategy is decided here and in the training runners
(tfdist/training/runners/), never elsewhere: the rest of tfdist asks for values (a
ReplicaPlacement, batch_multiple, the 'auto' defaults) or a runner, and strategy_kind names a
strategy for messages.
"""

from tfdist.lazy import lazy_exports

# Each public name -> the module that defines it, imported on first use (the strategies'
# names themselves are tfdist/strategy_kinds.py's, read without TensorFlow).
_EXPORTS = {
    "ALIASES": "tfdist.strategies.registry",
    "ALL_REDUCE_CHOICES": "tfdist.strategies.options",
    "COLLECTIVE_CHOICES": "tfdist.strategies.options",
    "COMPRESSION_CHOICES": "tfdist.strategies.options",
    "DEFAULT_PS_MIN_SHARD_BYTES": "tfdist.strategies.options",
    "REPLICA_PER_DEVICE_STRATEGIES": "tfdist.strategies.registry",
    "ReplicaPlacement": "tfdist.strategies.replicas",
    "SINGLE_HOST_STRATEGIES": "tfdist.strategies.registry",
    "StrategyError": "tfdist.strategies.options",
    "StrategyOptions": "tfdist.strategies.options",
    "batch_multiple": "tfdist.strategies.tpu",
    "build_strategy": "tfdist.strategies.registry",
    "check_tpu_node_paths": "tfdist.strategies.tpu",
    "describe_strategy": "tfdist.strategies.registry",
    "detect_tpu": "tfdist.strategies.tpu",
    "distribute_datasets": "tfdist.strategies.parameter_server",
    "joins_worker_processes": "tfdist.strategies.multi_worker",
    "needs_coordinator": "tfdist.strategies.parameter_server",
    "replica_placement": "tfdist.strategies.replicas",
    "resolve_auto": "tfdist.strategies.registry",
    "runs_on_tpu": "tfdist.strategies.tpu",
    "strategy_kind": "tfdist.strategies.registry",
    "strategy_names": "tfdist.strategies.registry",
    "task_name_in_tf_config": "tfdist.strategies.parameter_server",
    "tpu_node_address": "tfdist.strategies.tpu",
    "worker_rank": "tfdist.strategies.multi_worker",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "ALIASES",
    "ALL_REDUCE_CHOICES",
    "COLLECTIVE_CHOICES",
    "COMPRESSION_CHOICES",
    "DEFAULT_PS_MIN_SHARD_BYTES",
    "REPLICA_PER_DEVICE_STRATEGIES",
    "ReplicaPlacement",
    "SINGLE_HOST_STRATEGIES",
    "StrategyError",
    "StrategyOptions",
    "batch_multiple",
    "build_strategy",
    "check_tpu_node_paths",
    "describe_strategy",
    "detect_tpu",
    "distribute_datasets",
    "joins_worker_processes",
    "needs_coordinator",
    "replica_placement",
    "resolve_auto",
    "runs_on_tpu",
    "strategy_kind",
    "strategy_names",
    "task_name_in_tf_config",
    "tpu_node_address",
    "worker_rank",
]
