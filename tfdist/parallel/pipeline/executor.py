"""One executor for every pipeline schedule: it runs a plan's typed actions (schedules.py).

A plan gives each device of a pipeline its compute passes; `schedules.lowered` adds the
receive before each pass whose input another stage makes, the send after each pass whose
output another stage takes, and each stage's update. The executor builds every action of
this program's stage replicas (several pipelines, several stages a device), each after the
actions it needs (`simulate`'s order), into one TensorFlow graph:

- FORWARD: the stage's layers on its weights (a stateless call under a tape), on the
  micro-batch's share of the batch (stage 0) or on what crossed the cut, plus the model's
  inputs the stage reads. The last stage adds the compiled loss and updates the metrics;
  every stage adds its penalties (regularisers, add_loss) to the objective and to the
  logged loss.
- BACKWARD: the gradients of the weights (summed over the micro-batches) and of the
  stage's input (sent back), from one tape.gradient. BACKWARD_INPUT and BACKWARD_WEIGHT
  (zero bubble) take the same gradient in two calls on the same (persistent) tape: the
  input's first, the weights' later, with the same upstream gradient: the numbers of one
  backward.
- SEND_* / RECV_*: through `StageLinks` (a mailbox in this process, collective transfers
  between processes).
- UPDATE: the stage's gradients are complete; they leave the executor for its runner's
  update (the pipeline's stage optimizers after the exchange over pipelines; Downpour's
  parameter servers).

Loss scaling (a LossScaleOptimizer's `scale_loss`, where the runner's update unscales) and
a loss normalised by its own count (a mask, or sample weights under
`mean_with_sample_weight`: the micro-batches' sums divided by the whole step's count, as one
device divides its batch's) are done here, once for every runner. Each device runs its
passes one at a time, in its plan's order; with `timed`, each pass's start and end are
stamped (tf.timestamp) for the runner's measurements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from tfdist import compat
from tfdist.parallel.pipeline import sums
from tfdist.parallel.pipeline.links import StageLinks
from tfdist.parallel.pipeline.schedules import Action, Kind, lowered, simulate
from tfdist.parallel.pipeline.stages import Stage, StageError
from tfdist.training import loss_normalisation
from tfdist.training.fit_data import unpack
from tfdist.training.runners.common import batch_size


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """How the executor cuts the batch and runs its step.

    Attributes:
      micro_batches: M, each pipeline's micro-batches.
      pipelines: D, the pipelines the batch is shared by (pipeline p takes its p-th 1/D).
      micro: the examples in a micro-batch (None: the batch's size / (D M), at run time).
      timed: whether to stamp each pass's start and end.
      scale_loss: the loss scaling of the optimizer whose update unscales the gradients
        (None: none).
      processes: the worker processes the stages span (a count cannot cross them).
    """

    micro_batches: int
    pipelines: int = 1
    micro: int | None = None
    timed: bool = False
    scale_loss: Callable[[tf.Tensor], tf.Tensor] | None = None
    processes: int = 1


@dataclasses.dataclass
class StageInput:
    """One stage replica as the step starts: its device, weights and statistics. A tensor
    group (pipeline/tensor.py) gives its first member's device, and each member's weights
    and statistics (`weights[k]`, `statistics[k]`), with `group` set."""

    device: str
    weights: list
    statistics: list
    group: bool = False


@dataclasses.dataclass
class StageOutput:
    """One stage replica's step, handed to its update.

    Attributes:
      grads: per weight, its gradient summed over the micro-batches (None: the stage did
        not use it); a tensor group's, per member.
      statistics: its statistics (BatchNormalization's) after its last forward pass; a
        tensor group's, per member.
      times: [passes, 2], each pass's start and end (None unless timed).
      names: its passes, as run ("F0", "B0", "I1", "W1", ...).
    """

    grads: list
    statistics: list[tf.Tensor]
    times: tf.Tensor | None
    names: list[str]


@dataclasses.dataclass
class StepOutput:
    """The step: each replica's output, the step's count (None but for a loss normalised
    by its own count: then the gradients are of the sums, to be divided by it) and the
    metric state."""

    stages: dict[tuple[int, int], StageOutput]
    count: tf.Tensor | None
    state: list[tf.Tensor]


@dataclasses.dataclass
class _Forward:
    """What a micro-batch's forward pass keeps for its backward passes on the same stage."""

    tape: tf.GradientTape
    inputs: Any  # what crossed the cut before the stage (the batch's share on the first)
    # A tensor group's: each member's own tape, by member (`tape` then differentiates only
    # the compiled loss, on the last stage).
    members: dict | None
    outputs: Any
    regularization: tf.Tensor | None  # the stage's penalty, per micro-batch
    objective: tf.Tensor | None  # the loss term to differentiate: on the last stage only
    # Set by BACKWARD_INPUT for BACKWARD_WEIGHT: the targets, their seeds.
    targets: tuple[list, list | None] | None = None


@dataclasses.dataclass
class _Replica:
    """One stage replica's state while its actions are built, in its plan's order."""

    stage: Stage
    pipeline: int
    device: str
    weights: list  # a tensor group's: per member
    statistics: list  # after the latest forward pass (a tensor group's: per member)
    group: bool = False  # a tensor group (pipeline/tensor.py)
    grads: list | None = None  # the weights' gradients, summed so far (a group's: per member)
    saved: dict[int, _Forward] = dataclasses.field(default_factory=dict)  # by micro-batch
    # Received (RECV_*) and to be sent (SEND_*): by (forward?, micro-batch).
    inbox: dict[tuple[bool, int], list] = dataclasses.field(default_factory=dict)
    outbox: dict[tuple[bool, int], list] = dataclasses.field(default_factory=dict)
    start: tf.Tensor | None = None  # the current pass's start mark (timed)
    ready: list = dataclasses.field(default_factory=list)  # what the current pass waits for
    times: list[tf.Tensor] = dataclasses.field(default_factory=list)  # [start, end] each
    names: list[str] = dataclasses.field(default_factory=list)


class Executor:
    """Runs a plan's actions for this program's stage replicas (see the module docstring).

    Args:
      model: the whole (compiled) model: its loss and metrics.
      stages: the model's stages.
      plan: one compute-action list per device of a pipeline (`schedules.schedule`), or
        the lists `lowered`; a pass of chunk c on device d is stage c * len(plan) + d.
      links: where sends and receives go.
      metric_variables: the metric state's variables, in its order.
      options: see StepOptions.
      tensor: runs the passes of stage replicas that are tensor groups (a
        pipeline_tensor.TensorStages; None: each replica is one device).
    """

    def __init__(
        self,
        model,
        stages: Sequence[Stage],
        plan: Sequence[Sequence[Action]],
        links: StageLinks,
        metric_variables: Sequence,
        options: StepOptions,
        tensor: Any = None,
    ):
        self.model, self.stages, self.links = model, list(stages), links
        self.tensor = tensor
        self.metric_variables, self.options = list(metric_variables), options
        self.width = len(plan)
        self.program = lowered(plan)
        # Each action after those it needs: `simulate` ran them in such an order.
        ran = simulate(self.program).ran
        self.order = [(d, self.program[d][k]) for d, k in ran]
        split = {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}
        self.persistent = any(a.kind in split for actions in self.program for a in actions)

    def run(self, batch, replicas: dict[tuple[int, int], StageInput], state: list) -> StepOutput:
        """Every action of `replicas` ((pipeline, stage) -> its input), in the plan's order
        per device, on `batch` (the global batch: pipeline p takes its p-th share), from
        the metric state `state`."""
        x, y, sample_weight = unpack(batch)
        self.links.begin(x)
        self._counts: list[tf.Tensor] = []  # the last stage's micro-batches' own counts
        self._sums: list[tuple[tf.Tensor, tf.Tensor]] = []  # and their (loss sum, size)
        self._device_end: dict[str, list] = {}  # one pass at a time per device
        live = {
            key: _Replica(self.stages[key[1]], key[0], given.device, list(given.weights),
                          list(given.statistics), given.group)
            for key, given in replicas.items()
        }  # fmt: skip
        data = (x, y, sample_weight)
        for device, action in self.order:
            stage = action.stage(device, self.width)
            for pipeline in range(self.options.pipelines):
                r = live.get((pipeline, stage))
                if r is not None:
                    with tf.device(r.device):
                        state = self._act(r, action, data, state)
        count = None
        if self._counts:
            count = tf.add_n([tf.cast(c, tf.float32) for c in self._counts])
            # The logged loss: the step's sum over its count, as one device logs its batch's.
            size = tf.add_n([n for _, n in self._sums])
            mean = tf.add_n([total for total, _ in self._sums]) / count
            state = sums.added_to_loss(self.model, self.metric_variables, state, mean * size)
        outputs = {
            key: StageOutput(
                r.grads if r.grads is not None else [None] * len(r.weights),
                r.statistics,
                tf.stack(r.times) if r.times else None,
                r.names,
            )  # fmt: skip
            for key, r in live.items()
        }
        return StepOutput(outputs, count, state)

    # --- actions ----------------------------------------------------------------------------

    def _act(self, r: _Replica, action: Action, data, state: list) -> list:
        kind, m = action.kind, action.micro_batch
        if kind in (Kind.RECV_ACTIVATION, Kind.RECV_GRADIENT):
            forward = kind == Kind.RECV_ACTIVATION
            r.inbox[forward, m] = self.links.receive(r.pipeline, r.stage.index, m, forward=forward)
        elif kind in (Kind.SEND_ACTIVATION, Kind.SEND_GRADIENT):
            forward = kind == Kind.SEND_ACTIVATION
            sent = r.outbox.pop((forward, m))
            self.links.send(r.pipeline, r.stage.index, m, sent, forward=forward)
        elif kind != Kind.UPDATE:  # a pass; an update is its runner's, after the step
            if kind == Kind.FORWARD:
                done, state = self._forward(r, m, *data, state)
            else:
                done = self._backward(r, m, kind)
            end = tf.nest.flatten(done)
            if self.options.timed:
                with tf.control_dependencies(end):
                    end = [tf.timestamp()]
                r.times.append(tf.stack([r.start, end[0]]))
            self._device_end[r.device] = end
            r.names.append(f"{kind}{m}")
        return state

    def _begin(self, r: _Replica, arrived):
        """Marks a pass's start, once its input has arrived and its device's previous pass
        has ended, and returns the input as the pass must use it (after the mark)."""
        deps = [t for t in tf.nest.flatten(arrived) if isinstance(t, tf.Tensor)]
        deps += self._device_end.get(r.device, [])
        if self.options.timed:
            with tf.control_dependencies(deps):
                r.start = tf.timestamp()
            deps = [r.start]
        r.ready = deps
        if not deps:
            return arrived
        with tf.control_dependencies(deps):
            return tf.nest.map_structure(tf.identity, arrived)

    def _micro(self, tensor, pipeline: int, m: int):
        if tensor is None:
            return None
        options = self.options
        index = pipeline * options.micro_batches + m

        def cut(t):
            size = options.micro
            if size is None:
                size = tf.shape(t)[0] // (options.pipelines * options.micro_batches)
            return t[index * size : (index + 1) * size]

        return tf.nest.map_structure(cut, tensor)

    def _scaled(self, loss: tf.Tensor) -> tf.Tensor:
        scale = self.options.scale_loss
        return loss if scale is None else scale(loss)

    def _forward(self, r: _Replica, m: int, x, y, sample_weight, state):
        stage, model, micro_batches = r.stage, self.model, self.options.micro_batches
        last = stage.index == len(self.stages) - 1
        if stage.first:
            inputs = self._begin(r, self._micro(x, r.pipeline, m))
            given, mask = inputs, None
        else:  # what crossed the cut, and the model's inputs it reads (a padding mask, say)
            inputs = self._begin(r, r.inbox.pop((True, m)))
            given, mask = stage.call_args(inputs, tf.nest.flatten(self._micro(x, r.pipeline, m)))
        objective = counts = scaled = members = None
        with tf.GradientTape(persistent=self.persistent) as tape:
            if r.group:  # each member's pass on its own tape; this one the loss's, if last
                members = {}
                batch = inputs if stage.first else tf.nest.flatten(self._micro(x, r.pipeline, m))
                outputs, statistics = self.tensor.forward(
                    (r.pipeline, stage.index), stage, r.weights, r.statistics,
                    None if stage.first else inputs, batch, members,
                    persistent=self.persistent,
                )  # fmt: skip
                losses = []
                tape.watch(tf.nest.flatten(outputs))
            else:
                tape.watch(r.weights)
                if not stage.first:
                    tape.watch(stage.watched(inputs))
                outputs, statistics, losses = stage.model.stateless_call(
                    r.weights, r.statistics, given, training=True, return_losses=True,
                    **({} if mask is None else {"mask": mask}),
                )  # fmt: skip
            regularization = tf.add_n(losses) / micro_batches if losses else None
            if last:
                y_m = self._micro(y, r.pipeline, m)
                w_m = self._micro(sample_weight, r.pipeline, m)
                with loss_normalisation.global_batch(), loss_normalisation.recorded() as counts:
                    loss = compat.compiled_loss(model)(y_m, outputs, w_m)
                if counts:
                    # Divided by its own count (a mask's, or its weights'): the micro-batch's
                    # sum, divided by the whole step's count at the update, as one device.
                    self._check_counted(counts, regularization)
                    self._counts.append(counts[0])
                    objective = loss * tf.cast(counts[0], loss.dtype)
                else:
                    objective = loss / micro_batches
                if regularization is not None:
                    objective = objective + regularization
                scaled = self._scaled(objective)
        r.statistics = list(statistics)
        size = tf.cast(batch_size(outputs), tf.float32)
        if last:
            logged = loss
            if counts:  # the step's mean is logged at its end (run), from the sums
                self._sums.append((objective, size))
                logged = tf.zeros_like(loss)
            state = sums.metric_state(
                model, self.metric_variables, state, y_m, outputs, w_m, logged, size
            )
        if regularization is not None:  # the logged loss counts each stage's penalty too
            amount = regularization * micro_batches * size
            state = sums.added_to_loss(model, self.metric_variables, state, amount)
        r.saved[m] = _Forward(tape, inputs, members, outputs, regularization, scaled)
        if not last:
            r.outbox[True, m] = stage.passed_on(outputs, [] if stage.first else inputs)
        return outputs, state

    def _check_counted(self, counts: list, regularization) -> None:
        """Refuses what a micro-batch's count cannot normalise over the whole step: several
        losses (each its own count), a penalty beside the loss (it would be divided by the
        count too), stages across worker processes (the count is the last stage's)."""
        problem = None
        if len(counts) > 1 or len(self.model.outputs) > 1:
            problem = "a model of several outputs (each loss needs its own count)"
        elif regularization is not None:
            problem = "a penalty (a regulariser or add_loss) in the last stage's layers"
        elif self.options.processes > 1:
            problem = "stages in several worker processes (only the last stage knows the count)"
        if problem is not None:
            raise StageError(
                "A pipeline divides a masked (or weight-reduced) loss by the whole step's "
                "count of unmasked elements, as one device does; it cannot with "
                f"{problem}. Use Keras's default reduction without a mask, shard_optimizer="
                f"'zero3' instead of the pipeline, or one process. Received: {problem}"
            )

    def _targets(self, r: _Replica, m: int, forward: _Forward):
        """(targets, their seeds, what the stage passed on unchanged) of micro-batch `m`'s
        backward: its loss on the last stage, else its outputs seeded by the gradients
        that came back, and its penalty (seeded as the loss is scaled)."""
        if forward.objective is not None:
            self._begin(r, [])
            return [forward.objective], None, {}
        upstream = self._begin(r, r.inbox.pop((False, m)))
        targets, seeds, passed = r.stage.seeds(forward.outputs, upstream)
        if forward.regularization is not None:
            targets.append(forward.regularization)
            seeds.append(self._scaled(tf.ones_like(forward.regularization)))
        return targets, seeds, passed

    def _backward(self, r: _Replica, m: int, kind: Kind):
        stage = r.stage
        if r.group:
            return self._group_backward(r, m, kind)
        if kind == Kind.BACKWARD_WEIGHT:  # after its I: the same targets and seeds
            forward = r.saved.pop(m)
            targets, seeds = forward.targets
            self._begin(r, [])
            self._add(r, _gradient(forward.tape, targets, r.weights, seeds, r.ready))
            return _marker(r)
        forward = r.saved[m] if kind == Kind.BACKWARD_INPUT else r.saved.pop(m)
        watched = [] if stage.first else stage.watched(forward.inputs)
        targets, seeds, passed = self._targets(r, m, forward)
        if kind == Kind.BACKWARD_INPUT:
            forward.targets = (targets, seeds)
            grads = _gradient(forward.tape, targets, watched, seeds, r.ready)
        else:
            grads = _gradient(forward.tape, targets, [*r.weights, *watched], seeds, r.ready)
            self._add(r, grads[: len(r.weights)])
            grads = grads[len(r.weights) :]
        if not stage.first:
            back = stage.sent_back(grads, forward.inputs, passed)
            r.outbox[False, m] = back
            if back:
                return back
        if kind == Kind.BACKWARD_INPUT:  # on stage 0: nothing to compute
            return r.ready or tf.constant(0.0)
        return _marker(r)

    def _group_backward(self, r: _Replica, m: int, kind: Kind):
        """A tensor group's backward pass: its members' tapes (pipeline/tensor.py), seeded
        by the loss's gradient for the outputs on the last stage, else by what came back;
        a zero-bubble schedule's input pass (I), then its weights' pass (W), or both (B)."""
        key = (r.pipeline, r.stage.index)
        if kind == Kind.BACKWARD_WEIGHT:  # after its I: the members' tapes, seeded as there
            forward = r.saved.pop(m)
            self._begin(r, [])
            grads, _ = self.tensor.backward(
                key, r.stage, forward.members, None, last=False, part="weights"
            )
            self._add_group(r, grads)
            return _marker(r)
        forward = r.saved[m] if kind == Kind.BACKWARD_INPUT else r.saved.pop(m)
        if forward.objective is not None:
            self._begin(r, [])
            outputs = tf.nest.flatten(forward.outputs)
            upstream = _gradient(forward.tape, [forward.objective], outputs, None, r.ready)
            upstream = [
                tf.zeros_like(o) if g is None else g for g, o in zip(upstream, outputs, strict=True)
            ]
        else:
            upstream = self._begin(r, r.inbox.pop((False, m)))
        split = kind == Kind.BACKWARD_INPUT
        grads, sent = self.tensor.backward(
            key, r.stage, forward.members, upstream, last=forward.objective is not None,
            part="input" if split else "both",
        )  # fmt: skip
        if grads is not None:
            self._add_group(r, grads)
        if not r.stage.first:
            r.outbox[False, m] = sent
            if sent:
                return sent
        if split:  # on stage 0: nothing sent back
            return r.ready or tf.constant(0.0)
        return _marker(r)

    @staticmethod
    def _add_group(r: _Replica, grads: list) -> None:
        """Adds one micro-batch's weight gradients of each member to its sums."""
        if r.grads is None:
            r.grads = [None] * len(grads)
        r.grads = [
            list(g) if total is None else _summed(total, g)
            for total, g in zip(r.grads, grads, strict=True)
        ]

    @staticmethod
    def _add(r: _Replica, grads: list) -> None:
        """Adds one micro-batch's weight gradients to the stage's sums (None: unused)."""
        if r.grads is None:
            r.grads = list(grads)
            return
        r.grads = _summed(r.grads, grads)


def _gradient(tape: tf.GradientTape, targets: list, sources: list, seeds, after: list) -> list:
    """The gradients of `targets` (seeded by `seeds`) for `sources`, taken once `after`
    (the pass's start) exists."""
    if not targets or not sources:
        return [None] * len(sources)
    with tf.control_dependencies(after):
        return tape.gradient(targets, sources, output_gradients=seeds)


def _summed(total: list, grads: list) -> list:
    """Weight gradients added to their sums so far (None: unused)."""
    return [
        a if b is None else b if a is None else sums.added(a, b)
        for a, b in zip(total, grads, strict=True)
    ]


def _marker(r: _Replica):
    """A tensor that exists once the stage's latest weight gradient does."""
    grads = [g for member in r.grads or [] for g in member] if r.group else r.grads or []
    made = [sums.dense_part(g) for g in grads if g is not None]
    return made[0] if made else tf.constant(0.0)
