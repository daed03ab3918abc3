"""Pipeline parallelism: a Keras model cut into stages that train their micro-batches in turn.

    with strategy.scope():                 # mirrored over 4 devices, or 4 worker processes
        model = build_model(); model.compile("adam", "sparse_categorical_crossentropy",
                                             metrics=["accuracy"])
    tfdist.fit(model, dataset, epochs=3,
               pipeline=tfdist.parallel.Pipeline(cut_before=["block_2", "block_3", "head"],
                                                 micro_batches=4, schedule="1f1b"))

The strategy's replicas form a grid of D pipelines x S stages: replica r holds stage r % S
of pipeline r // S (4 replicas and 2 stages: 2 pipelines, data parallel). Each step, pipeline
p takes its 1/D of the global batch as M micro-batches; each stage runs its forward and
backward passes in the order the schedule gives (schedules.py), activations going forward
and their gradients backward, between devices in one program or between worker processes
over TensorFlow's point-to-point collective transfers. A stage sums its weights' gradients
over the micro-batches, averages them over the D pipelines (a ring all-reduce among the
stage's replicas), and takes one optimizer step: the step the unsplit model takes on the
whole batch, up to floating point (tests/test_pipeline.py checks it after 5 steps).

Where things live. Each stage's weights, the state of its optimizer (a copy of the user's,
same class and config) and its activations live on the stage's device, in variables of
tfdist's own, and nowhere else: no process holds the whole model. When fit first starts,
each weight's value moves into the stage replicas that hold it and its whole copy (built in
`Pipeline.scope(strategy)`, in host memory, or mirrored under `strategy.scope()`) is
dropped, one weight at a time; the user's optimizer is built with no slots of its own. From
then on the storage of each Keras weight and each of the user's slots is its stage's (see
StageStore): evaluation, callbacks, checkpoints, `get_weights` and `model.save` read the one
Keras model, one variable at a time (across worker processes, from the process whose
stage holds it: a collective every process makes, as every process saves), and a restore
lands in the stages. Only BatchNormalization's statistics are written back, at each epoch's
end and before each save. The loss is the compiled one (with its loss weights and sample
weights), plus each stage's regularisation losses; the metrics are the compiled ones,
updated on the last stage.

A stage after the first reads the model's inputs it uses (a padding mask every decoder
block takes) from the batch, as the first stage does. A weight used by several stages (an
embedding tied to the output logits, as keras-hub's causal LMs have) is held by each of
them, with optimizer state of its own; its gradient is summed over them (and over the
pipelines), so the copies take the same steps and stay equal (Megatron-LM's tied
embeddings).

Sharded stages: with fit's `shard_optimizer`, each stage's replicas (one per pipeline) share
out its state in flat slices, as ZeRO shares a model's: 'zero1' keeps 1/D of the stage's
optimizer slots on each replica, 'zero2' also sums only that slice of the gradients, and
'zero3' keeps only the slice of the weights too, gathered from the stage's replicas for each
step. Each replica updates its slice; under zero1 and zero2 the stage's replicas then gather
the updated slices into their whole weights. Embedding tables stay whole (their gradients
are sparse rows). Across worker processes of one device each, a ring per stage over its
pipelines' processes carries the slices; processes of several devices hold whole stages,
their slices within them.

Tensor-parallel stages: a model split by a layout map (`tensor_parallel(model,
layout_map=...)`) runs each stage replica over T devices, each holding its parts of the
stage's split weights (pipeline/tensor.py), under every schedule (zero-bubble's weights'
pass takes each member's gradients from the tape its input pass kept), with
shard_optimizer too (all three). Worker processes of several devices each hold whole stages (every pipeline's
replica of them): only activations and their gradients cross between processes.

Limits (each refused with a message): models with their own `train_step` (a pipeline runs
the layer graph, not the step), global_clipnorm (a norm over every stage), loss scaling,
StepHooks (accumulation is the micro-batches already), offload; with tensor-parallel
stages, penalties and BatchNormalization inside a split stage, and a weight several
stages hold in different worker processes.
BatchNormalization normalises each micro-batch by its own statistics, as in GPipe; M = 1
matches the unsplit model exactly.

Where the pieces live: this module holds the factory (`Pipeline`); pipeline/runner.py the
runner (building, placing, the training loop); pipeline/home.py where the weights and slots
live (StageStore); pipeline/step.py a step's program (the executor's passes, the exchange over the
pipelines, the stages' updates); pipeline/tensor.py a tensor group's passes; executor.py the
one executor of every schedule's actions, shared with Downpour's split replica (downpour.py);
pipeline/links.py the sends and receives between stages; schedules.py the schedules as typed
actions.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfdist import compat
from tfdist.errors import FitError
from tfdist.parallel.host import host_scope
from tfdist.parallel.pipeline.schedules import SCHEDULES
from tfdist.parallel.tensor.layout_map import plan_of
from tfdist.parallel.zero import units
from tfdist.strategies import needs_coordinator


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How `tfdist.fit(..., pipeline=...)` cuts and schedules the model.

    Args:
      cut_before: names of the layers where stages 1, 2, ... begin (stage 0 starts at the
        inputs), in the order the data reaches them; None for a model made by
        `tfdist.parallel.chain` (cut between its stage models); [] for one stage, the model
        whole (what a layout map's model trains as across worker processes). The
        strategy's replicas must be a multiple of the stages: the multiple is the number
        of data-parallel pipelines.
      micro_batches: M, the micro-batches each pipeline's share of a batch is cut into
        (it must divide that share). More shrinks the bubble, (S-1)/(M+S-1).
      schedule: 'gpipe' (every forward, then every backward: M micro-batches' activations
        held), '1f1b' (a forward and a backward in turn: at most S-s held on stage s),
        'interleaved' (1F1B over `chunks_per_device` stages per device: the bubble falls to
        (S-1)/(vM+S-1); M a multiple of the devices per pipeline; local devices only) or
        'zero_bubble' (ZB-H1: each backward cut into the input's gradient and the weights',
        the latter put off to fill 1F1B's idle time; 1F1B's most held).
      chunks_per_device: v, the stages each device holds under the interleaved schedule:
        the model is cut into S*v stages and device d of a pipeline holds stages d, d+S, ...
      timeout_seconds: how long a transfer between worker processes may wait for its peer
        (None: forever), so a lost stage ends the step with an error instead of a hang.

    Raises:
      ValueError: an option out of range.
    """

    cut_before: tuple[str, ...] | None = None
    micro_batches: int = 1
    schedule: str = "1f1b"
    timeout_seconds: float | None = None
    chunks_per_device: int = 1

    def __post_init__(self):
        m, v = self.micro_batches, self.chunks_per_device
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"micro_batches must be a whole number >= 1. Received: {m!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULES)}. Received: {self.schedule!r}"
            )
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"chunks_per_device must be a whole number >= 1. Received: {v!r}")
        if v > 1 and self.schedule != "interleaved":
            raise ValueError(
                "chunks_per_device applies to schedule='interleaved' (each device holds several "
                f"stages); {self.schedule!r} holds one stage per device. Received: "
                f"chunks_per_device={v}"
            )
        if self.cut_before is not None:
            if isinstance(self.cut_before, str):
                raise ValueError(
                    f"cut_before is a list of layer names. Received: the string {self.cut_before!r}"
                )
            object.__setattr__(self, "cut_before", tuple(self.cut_before))

    def scope(self, strategy: tf.distribute.Strategy):
        """Build and compile the model here, in place of `strategy.scope()`, and each device
        holds only its stage: the model's weights are made once, in this host's memory, not
        mirrored on every replica's device (tfdist.host_scope), and move into the stages
        when fit begins, the host's copy dropped (the optimizer's state is made in the
        stages only).

            with pipeline.scope(strategy):
                model = build_model()
                model.compile("adam", "sparse_categorical_crossentropy")
            tfdist.fit(model, dataset, pipeline=pipeline)
        """
        return host_scope(strategy)

    def runner(
        self,
        model: keras.Model,
        strategy: tf.distribute.Strategy,
        *,
        shard_optimizer: str | None = None,
        offload: str | None = None,
    ):
        """The runner tfdist.fit trains `model` with (not yet built): under
        parameter_server, each worker's replica split over its devices (downpour.py).
        fit's `shard_optimizer` shards each stage's optimizer state ('zero1', 'zero2': and
        its gradients) or its weights too ('zero3') over the stage's replicas, one per
        pipeline."""
        if offload is not None:
            raise FitError(
                "offload='optimizer' keeps a sharded optimizer's state in host memory under "
                "data parallelism; a pipeline's stages keep theirs on their devices (not "
                "built). Drop offload, or train without pipeline=. "
                f"Received: offload={offload!r}, shard_optimizer={shard_optimizer!r}"
            )
        recomputed = units.recomputed(model)
        if recomputed:
            # Its stages call the layers on weight values (stateless calls), which a unit's
            # custom gradient would not differentiate: not built yet.
            raise FitError(
                f"A Pipeline does not recompute activations yet (the layer "
                f"{recomputed[0].name!r} was made a recomputed unit, by "
                "tfdist.parallel.recompute_activations or keras.RematScope): it keeps each "
                "micro-batch's activations as its schedule says. Build the model without "
                "them, or use shard_optimizer='zero3', which recomputes each unit. "
                f"Received: {len(recomputed)} recomputed layer(s)"
            )
        if needs_coordinator(strategy):  # parameter_server: a replica per worker, split
            if shard_optimizer is not None:
                raise FitError(
                    "shard_optimizer shards state over synchronous replicas; under "
                    "parameter_server the variables live on the ps tasks already. Drop "
                    f"shard_optimizer. Received: shard_optimizer={shard_optimizer!r}"
                )
            from tfdist.parallel.pipeline.downpour import SplitReplica
            from tfdist.training.runners.parameter_server import ParameterServerRunner

            return ParameterServerRunner(model, strategy, replica=SplitReplica(model, self))
        from tfdist.parallel.pipeline.runner import PipelineRunner

        return PipelineRunner(model, strategy, self, shard=shard_optimizer)


def for_layout_map(model: keras.Model, strategy: tf.distribute.Strategy) -> Pipeline | None:
    """What tfdist.fit trains a model tensor_parallel(layout_map=...) marked under across
    worker processes (the registry's runner_factory of the split layers' mode): a pipeline
    of one stage (cut_before=[]), each process's replica a tensor group over its devices,
    its parts sliced over the processes' replicas under shard_optimizer (FSDP x tensor
    parallelism, each tensor group within a process as Megatron-LM keeps it in a node).
    None in one process, where LayoutParallel trains it, and under parameter_server, whose
    workers step apart (LayoutParallel refuses it there in one line)."""
    if plan_of(model) is None or needs_coordinator(strategy):
        return None
    if compat.sync_worker_count(strategy) < 2:
        return None
    return Pipeline(cut_before=())
