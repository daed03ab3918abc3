"""Parallel modes behind tfdist.fit's seam (a file each, a package each for ZeRO and the
pipeline), and the registry that offers them.

- registry.py: one entry per mode (fit's keyword, TrainConfig's field, the binary's flag and
  help, the hook's place in the chain, its checkpoint rules, its builder).
- zero/: ZeRO. sharded.py: ShardedUpdate, the optimizer's state (stage 1) and the gradients
  (stage 2) sharded over the replicas of a synchronous strategy; stage3.py:
  ShardedParameters, the weights sharded too, each gathered where a layer reads it;
  units.py: the units stage 3 gathers at once, and `recompute_activations`, activation
  checkpointing under every layout (and Keras's RematScope, run tfdist's way);
  partition.py: the packed weights cut among the replicas; offload.py: the offload policy.
- host.py: host_scope, where to build a model no device holds whole (ZeRO-3, a pipeline).
- What the modes share: optimizer_copies.py (copies of the user's optimizer for the weights
  a replica keeps), stand_in.py (a weight's storage while its mode holds it in parts),
  flat_slices.py (a weight as flat slices).
- accumulate.py: Accumulate, k micro-batches per step and one exchange.
- asynchronous.py: corrections for parameter-server training's stale updates:
  DelayCompensation (DC-ASGD), MomentumCorrection, BoundedStaleness (max_staleness),
  SynchronousWarmup (async_warmup).
- local_sgd.py: LocalSGD, k local optimizer steps per replica, then one average of the
  weights (post-local SGD too).
- gossip.py: Gossip, a local step, then each replica averages with its peers (a ring, or
  a time-varying exponential graph): no all-reduce, no server.
- admm.py: ADMM, consensus ADMM SGD: local steps on each replica's own loss plus a penalty,
  then a consensus and dual update every k steps.
- pipeline/: pipeline parallelism. Its package holds Pipeline, the stages over the replicas
  trained in micro-batches (a runner factory: it replaces the engine); stages.py, a model
  cut into stages at named layers (`split`) or stages chained (`chain`), tied.py the weights
  several stages hold; schedules.py, the
  schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) as typed actions per device and
  their simulation; executor.py, the one executor of every schedule's actions (Pipeline's
  and Downpour's), links.py its sends and receives between stages; runner.py its engine,
  grid.py where its stage replicas run, home.py where the stages keep the weights, step.py
  one step's program, sums.py what a stage adds up, tensor.py stages split over
  tensor-parallel groups; downpour.py, SplitReplica, a Pipeline under parameter_server
  (each worker's replica cut into stages over its devices, Downpour SGD).
- tensor/: tensor-parallel layers (ColumnParallelDense, RowParallelDense,
  ParallelEmbedding, ParallelMultiHeadAttention), `tensor_parallel` to convert a model
  (or to split it by a layout map, given or derived from its shapes: `derive_layout_map`),
  `dense_model` to convert it back, and TensorParallelUpdate, the hook that updates their
  parts (added when a model has them).

`tfdist.fit(..., shard_optimizer="zero2", accumulate_steps=4, average_every=4,
gossip="ring")` builds the hooks from the registry's keywords, or pass them yourself with
`step_hooks=[...]`; `tfdist.fit(..., pipeline=Pipeline(cut_before=[...]))` replaces the
engine. The modes import the engine (tfdist.training) and never the facade or the binary.

Names are imported on first use, so reading the registry (the binary's flags, TrainConfig)
loads no mode.
"""

from tfdist.lazy import lazy_exports

_EXPORTS = {
    "ADMM": "tfdist.parallel.admm",
    "Accumulate": "tfdist.parallel.accumulate",
    "ASYNC_CORRECTIONS": "tfdist.parallel.asynchronous",
    "AsyncCorrectionError": "tfdist.parallel.asynchronous",
    "BoundedStaleness": "tfdist.parallel.asynchronous",
    "DelayCompensation": "tfdist.parallel.asynchronous",
    "MomentumCorrection": "tfdist.parallel.asynchronous",
    "SynchronousWarmup": "tfdist.parallel.asynchronous",
    "SplitReplicaRunner": "tfdist.parallel.pipeline.downpour",
    "Gossip": "tfdist.parallel.gossip",
    "LocalSGD": "tfdist.parallel.local_sgd",
    "LocalUpdateError": "tfdist.parallel.local_sgd",
    "LocalUpdates": "tfdist.parallel.local_sgd",
    "Pipeline": "tfdist.parallel.pipeline",
    "PipelineRunner": "tfdist.parallel.pipeline.runner",
    "Stage": "tfdist.parallel.pipeline.stages",
    "StageError": "tfdist.parallel.pipeline.stages",
    "chain": "tfdist.parallel.pipeline.stages",
    "split": "tfdist.parallel.pipeline.stages",
    "ColumnParallelDense": "tfdist.parallel.tensor",
    "ParallelEmbedding": "tfdist.parallel.tensor",
    "ParallelMultiHeadAttention": "tfdist.parallel.tensor",
    "RowParallelDense": "tfdist.parallel.tensor",
    "TensorParallelError": "tfdist.parallel.tensor",
    "TensorParallelUpdate": "tfdist.parallel.tensor",
    "dense_model": "tfdist.parallel.tensor",
    "derive_layout_map": "tfdist.parallel.tensor",
    "split_layers": "tfdist.parallel.tensor",
    "tensor_parallel": "tfdist.parallel.tensor",
    "Partition": "tfdist.parallel.zero.partition",
    "ShardedUpdate": "tfdist.parallel.zero.sharded",
    "ShardedParameters": "tfdist.parallel.zero.stage3",
    "host_scope": "tfdist.parallel.host",
    "UnitError": "tfdist.parallel.zero.units",
    "recompute_activations": "tfdist.parallel.zero.units",
    "ShardingError": "tfdist.parallel.zero.sharded",
    "MODES": "tfdist.parallel.registry",
    "Mode": "tfdist.parallel.registry",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
