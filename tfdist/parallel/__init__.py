"""Parallel modes, each one file behind tfdist.fit's seam, and the registry that offers them.

- registry.py: one entry per mode (fit's keyword, TrainConfig's field, the binary's flag and
  help, the hook's place in the chain, its checkpoint rules, its builder).
- zero.py: ShardedUpdate, the optimizer's state (ZeRO stage 1) and the gradients (stage 2)
  sharded over the replicas of a synchronous strategy.
- zero3.py: ShardedParameters, ZeRO stage 3: the weights sharded too, each gathered where a
  layer reads it.
- host.py: host_scope, where to build a model no device holds whole (ZeRO-3, a pipeline).
- units.py: the units ZeRO-3 gathers at once, and `recompute_activations`, activation
  checkpointing under every layout (and Keras's RematScope, run tfdist's way).
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
- schedules.py: pipeline schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) as typed
  actions per device, and their simulation: the step's length, the bubble, the activations
  each stage holds.
- stages.py: a model cut into stages at named layers (`split`), or stages chained (`chain`).
- pipeline.py: Pipeline, the stages over the replicas trained in micro-batches (a runner
  factory: it replaces the runner); pipeline_runner.py its runner, pipeline_home.py where
  its stages keep the weights, pipeline_step.py one step's program.
- executor.py: the one executor of every schedule's actions (Pipeline's and Downpour's);
  stage_links.py the sends and receives between stages.
- downpour.py: SplitReplicaRunner, a Pipeline under parameter_server: each worker's replica
  cut into stages over that worker's devices, training asynchronously (Downpour SGD).
- tensor/: tensor-parallel layers (ColumnParallelDense, RowParallelDense,
  ParallelEmbedding, ParallelMultiHeadAttention), `tensor_parallel` to convert a model
  (or to split it by a layout map, given or derived from its shapes: `derive_layout_map`),
  `dense_model` to convert it back, and TensorParallelUpdate, the hook that updates their
  parts (added when a model has them).

`tfdist.fit(..., shard_optimizer="zero2", accumulate_steps=4, average_every=4,
gossip="ring")` builds the hooks from the registry's keywords, or pass them yourself with
`step_hooks=[...]`; `tfdist.fit(..., pipeline=Pipeline(cut_before=[...]))` replaces the
runner. The modes import the engine (tfdist.training) and never the facade or the binary.

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
    "SplitReplicaRunner": "tfdist.parallel.downpour",
    "Gossip": "tfdist.parallel.gossip",
    "LocalSGD": "tfdist.parallel.local_sgd",
    "LocalUpdateError": "tfdist.parallel.local_sgd",
    "LocalUpdates": "tfdist.parallel.local_sgd",
    "Pipeline": "tfdist.parallel.pipeline",
    "PipelineRunner": "tfdist.parallel.pipeline_runner",
    "Stage": "tfdist.parallel.stages",
    "StageError": "tfdist.parallel.stages",
    "chain": "tfdist.parallel.stages",
    "split": "tfdist.parallel.stages",
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
    "Partition": "tfdist.parallel.zero",
    "ShardedUpdate": "tfdist.parallel.zero",
    "ShardedParameters": "tfdist.parallel.zero3",
    "host_scope": "tfdist.parallel.host",
    "UnitError": "tfdist.parallel.units",
    "recompute_activations": "tfdist.parallel.units",
    "ShardingError": "tfdist.parallel.zero",
    "MODES": "tfdist.parallel.registry",
    "Mode": "tfdist.parallel.registry",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
