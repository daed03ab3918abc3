"""Downpour's model-parallel replicas: a parameter-server worker's replica split over its devices.

In Downpour SGD (Dean et al., 2012) the parameters are sharded over parameter servers and
each model replica is itself split over several machines: the replica's parts fetch their
parameters from the shards that hold them, compute their layers, pass activations forward
and their gradients back among themselves, and push their gradients to the shards, while the
other replicas do the same without waiting.

Here a replica is a parameter-server worker whose model is cut into stages (a `Pipeline`),
one per device of that worker (its GPUs, or logical CPUs from tfdist.configure_cpu_devices):

    with strategy.scope():                                  # parameter_server, 2 ps
        model = build_model(); model.compile(...)
    tfdist.fit(model, data, steps_per_epoch=100,
               pipeline=tfdist.parallel.Pipeline(cut_before=["block_2"], micro_batches=4))

Each step a worker reads each stage's weights from the ps onto the stage's device, runs the
micro-batches' passes there in the pipeline schedule's order (activations and their
gradients go between the worker's devices inside one TensorFlow program; passes on
different devices run at once), sums each weight's gradient over the micro-batches (and
over the stages that hold a tied weight) and applies the update on the ps, asynchronously,
as any parameter-server step: staleness is counted, and `max_staleness`, `async_warmup` and
`async_correction` apply. With one worker, the updates are those of the unsplit model
trained synchronously (tests/test_downpour.py).

Where TensorFlow stops it. ParameterServerStrategy runs each step as a closure on one worker
process, so a replica spans one worker's devices, never several processes: Downpour's
replicas over several machines would need the closure to run on a group of workers, which
the ClusterCoordinator does not schedule. Variables split by a partitioner (`ps_min_shard_bytes`)
are not supported by the split replica (they are read whole by a stage); the sharding here is
Downpour's, whole variables placed round-robin over the ps tasks.
"""

from __future__ import annotations

import collections
import logging

import keras
import tensorflow as tf

from tfdist.errors import FitError
from tfdist.parallel.pipeline import sums
from tfdist.parallel.pipeline.executor import Executor, StageInput, StepOptions
from tfdist.parallel.pipeline.links import StageLinks
from tfdist.parallel.pipeline.schedules import schedule
from tfdist.parallel.pipeline.stages import Stage, StageError, devices_for, split
from tfdist.parallel.pipeline.tied import tied
from tfdist.training.fit_data import unpack
from tfdist.training.ps_shards import shards_of
from tfdist.training.runners.common import batch_size
from tfdist.training.steps import custom_train_step

log = logging.getLogger(__name__)

# Device kinds a worker's replica may be split over, the first a worker has enough of.
_KINDS = ("GPU", "TPU", "CPU")


class SplitReplica:
    """A parameter-server worker's replica cut into stages over its devices (see the
    module): the gradients the parameter-server engine applies, stage by stage. Made by
    `Pipeline.runner` under a ParameterServerStrategy, which trains with
    `ParameterServerRunner(model, strategy, replica=SplitReplica(model, options))`."""

    def __init__(self, model: keras.Model, options):
        if custom_train_step(model):
            raise FitError(
                f"Model {model.name!r} has its own train_step, which runs the whole model at "
                "once; a split replica runs its layers stage by stage with the compiled loss "
                "and metrics. Move the step's logic into compile()'s loss and metrics, or "
                "train without pipeline=. Received: a model with train_step overridden"
            )
        self.model, self.options = model, options
        self.stages: list[Stage] = []
        self.devices: list[str] = []  # a worker's stage devices, without job and task
        self.tied: dict[int, tuple[int, ...]] = {}
        self.metric_variables: list = []

    def build(self, engine, sample_batch) -> None:
        model, options = self.model, self.options
        if any(shards_of(v) for v in model.trainable_variables):
            raise FitError(
                "A worker's split replica reads each stage's variables whole, and this model "
                "has variables split across the ps tasks by a partitioner. Build the model "
                "without a variable_partitioner (ps_min_shard_bytes=None): its variables are "
                "still spread over the ps tasks, whole. Received: a partitioned model"
            )
        self.metric_variables = engine.metric_variables
        self.stages = split(model, options.cut_before)
        chunks = options.chunks_per_device
        width = devices_for(len(self.stages), chunks, options.micro_batches, holder="the replica's")
        per_worker = batch_size(unpack(sample_batch)[0])
        if per_worker is not None and per_worker % options.micro_batches:
            raise StageError(
                f"micro_batches={options.micro_batches} must divide each step's batch of "
                f"{per_worker}. Received: micro_batches={options.micro_batches}"
            )
        self.devices = worker_devices(engine.job.cluster(), width)
        self.tied = tied(self.stages)
        self.plan = schedule(options.schedule, width, options.micro_batches, chunks)
        log.info(
            "Each worker's replica is split into %d stages over its devices %s (%s, %d "
            "micro-batches); the weights stay on the ps tasks",
            len(self.stages), ", ".join(self.devices), options.schedule, options.micro_batches,
        )  # fmt: skip

    def gradients(self, batch, state):
        """The step's (gradient, variable) pairs and metric state, stage by stage."""
        return _ReplicaStep(self).run(batch, state)


class _ReplicaStep:
    """One step's program over a worker's stage devices (built once, while tracing): the
    pipeline's executor (executor.py) over one pipeline whose stages are all here."""

    def __init__(self, runner: SplitReplica):
        self.runner, self.model = runner, runner.model
        width = len(runner.devices)
        self.devices = {stage.index: runner.devices[stage.index % width] for stage in runner.stages}
        links = StageLinks(runner.stages, [(0, k) for k in self.devices])
        # The objective is scaled as the user's optimizer scales it: its apply_gradients
        # (on the ps) unscales the gradients.
        options = StepOptions(
            micro_batches=runner.options.micro_batches, scale_loss=self.model.optimizer.scale_loss
        )
        self.executor = Executor(
            self.model, runner.stages, runner.plan, links, runner.metric_variables, options
        )

    def run(self, batch, state):
        runner, model = self.runner, self.model
        trainable, statistics = model.trainable_variables, model.non_trainable_variables
        given = {}
        for stage in runner.stages:  # each stage reads its weights from the ps
            device = self.devices[stage.index]
            with tf.device(device):
                given[0, stage.index] = StageInput(
                    device,
                    [tf.identity(trainable[i].value) for i in stage.trainable],
                    [tf.identity(statistics[i].value) for i in stage.non_trainable],
                )
        step = self.executor.run(batch, given, state)
        grads: dict[int, object] = {}  # position in trainable -> the summed gradient
        for stage in runner.stages:
            own = step.stages[0, stage.index]
            # The statistics after each stage's last forward pass are the model's (BatchNorm's
            # moving averages), written to the ps as a step of the unsplit model writes them.
            for i, value in zip(stage.non_trainable, own.statistics, strict=True):
                statistics[i].assign(value)
            for i, g in zip(stage.trainable, own.grads, strict=True):
                if g is not None:  # a tied weight's: summed over the stages holding it
                    grads[i] = g if i not in grads else sums.added(grads[i], g)
        if step.count is not None:  # the gradients of the sums: over the step's count
            grads = {i: _divided(g, step.count) for i, g in grads.items()}
        pairs = [(grads.get(i), v) for i, v in enumerate(trainable)]
        return pairs, step.state


def worker_devices(cluster: dict, width: int) -> list[str]:
    """`width` devices of one kind that every worker has ("/device:CPU:0", ...), the first
    kind of GPU, TPU, CPU every worker has enough of.

    Raises:
      FitError: a worker has fewer than `width` devices of every kind.
    """
    workers = len(cluster.get("worker", []))
    have: dict[int, collections.Counter] = {t: collections.Counter() for t in range(workers)}
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        if spec.job == "worker" and spec.task in have:
            have[spec.task][spec.device_type] += 1
    for kind in _KINDS:
        if all(have[t][kind] >= width for t in have):
            return [f"/device:{kind}:{i}" for i in range(width)]
    counts = ", ".join(
        f"worker:{t} {'+'.join(f'{n} {k}' for k, n in sorted(c.items())) or 'none seen'}"
        for t, c in have.items()
    )
    raise FitError(
        f"Each worker's replica is split over {width} devices of one kind, but the workers have "
        f"fewer: {counts}. Give every worker {width} devices: GPUs, or "
        f"tfdist.configure_cpu_devices({width}) first in each worker's process, before it "
        f"serves. Received: {width} devices per replica"
    )


def _divided(g, count):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(count, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(count, g.dtype)
