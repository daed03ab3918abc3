"""Tensor parallelism inside a pipeline's stages: each stage replica is a group of T devices.

A model split by a layout map (`tensor_parallel(model, layout_map=...)`) trained with
`pipeline=` runs each stage replica over T devices, its members. Member k holds its part of
every weight the map splits in its stage (part `placement.index(k)`), and the other weights
of its stage whole, each with its own copy of the optimizer's slots. A stage's pass on a
micro-batch runs as one run of a strategy over the group's devices (a MirroredStrategy of
its own, in the pipeline's program): member k takes its 1/T of the micro-batch's rows, and
the split layers run inside the exchanges the layout's own training uses (layout_map.py's
SplitCalls: a column layer gathers the group's rows, a row layer adds the partial sums and
hands each member back its rows). What leaves the pass is the members' rows end to end: the
next stage's group cuts it again, as the unsplit stage's outputs would be cut.

The backward pass takes its gradients from the tapes each member kept in its forward pass,
in a later run of the group's strategy (the exchanges' gradients are taken in that run's
replica context: collective/replicas.py). A member's gradient of a part counts the group's
rows (the part's layer saw them all), of a weight it holds whole only its own rows: the
pipeline's update sums a gradient over the members that hold the same part (every member,
for a weight held whole), over the micro-batches and over the pipelines.

The layers after a cut see what the unsplit model's would: the last stage's outputs are put
together before the compiled loss reads them, and the loss's gradient is cut into each
member's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from tfdist import compat
from tfdist.collective import keys, replicas
from tfdist.parallel.pipeline.stages import Stage, StageError
from tfdist.parallel.tensor.layout_map import LayoutPlan
from tfdist.parallel.tensor.split_calls import SplitCalls


@dataclasses.dataclass
class _Kept:
    """What one member's forward pass keeps for its backward pass."""

    tape: tf.GradientTape
    weights: list[tf.Tensor]  # what the tape watched, as the member read its weights
    received: list  # its rows of what crossed the cut (empty on stage 0)
    outputs: Any  # its rows of the stage's outputs
    # A split backward's (zero-bubble) targets and seeds, from its input pass to its
    # weights' pass.
    seeded: tuple | None = None


class TensorStages:
    """Runs the passes of stage replicas that are tensor groups (see the module docstring).

    Args:
      model: the whole model (its trainable weights, in the plan's order).
      plan: the layout's split (layout_map.plan_of).
      groups: (pipeline, stage) -> the devices of its members, in member order.
    """

    def __init__(self, model, plan: LayoutPlan, groups: dict[tuple[int, int], Sequence[str]]):
        self.plan, self.degree = plan, plan.degree
        self.calls = SplitCalls(plan, model.trainable_variables, gather=replicas.all_gather)
        self._placements = plan.placements
        self.strategies = {
            key: compat.mirrored_strategy(
                list(devices),
                cross_device_ops=None,
                collective_key_base=keys.next_mirrored_base(),
            )  # fmt: skip
            for key, devices in groups.items()
        }

    @contextlib.contextmanager
    def traced(self):
        """While the pipeline's program is built: the split layers run in their exchanges."""
        self.calls.install()
        try:
            yield
        finally:
            self.calls.uninstall()

    def placement(self, stage: Stage, j: int):
        """The placement of the stage's j-th weight (see layout_map.Placement)."""
        return self._placements[stage.trainable[j]]

    # --- the passes ---------------------------------------------------------------------------

    def forward(
        self, key, stage: Stage, weights, statistics, received, batch, kept: dict,
        *, persistent: bool = False,
    ):  # fmt: skip
        """One forward pass of the group `key` (pipeline, stage) on a micro-batch: on stage
        0 `batch` is the micro-batch's inputs (and `received` None), on a later stage
        `received` is what crossed the cut and `batch` the model's inputs flattened;
        `weights[k]` and `statistics[k]` are member k's. Keeps each member's tape in `kept`
        (by member; `persistent` where its backward is taken in two passes) and returns
        (the outputs, every member's rows end to end; each member's statistics)."""
        strategy = self.strategies[key]
        results: dict[int, tuple[Any, list]] = {}
        model = stage.model

        def member():
            k = _member()
            cut = lambda t: self._rows(t, k)  # noqa: E731
            mine = [] if stage.first else [cut(t) for t in received]
            if stage.first:
                given, mask = tf.nest.map_structure(cut, batch), None
            else:
                given, mask = stage.call_args(mine, [cut(t) for t in batch])
            own = [tf.identity(w) for w in weights[k]]
            tape = tf.GradientTape(persistent=persistent)
            with tape:  # the row layers' biases scaled on the tape, as every read
                tape.watch(own)
                if mine:
                    tape.watch(stage.watched(mine))
                values = []
                for j, (v, w) in enumerate(zip(model.trainable_variables, own, strict=True)):
                    scale = self.placement(stage, j).scale  # a row layer's bias: 1/T each
                    values.append((v, w if scale == 1.0 else w * tf.constant(scale, w.dtype)))
                values += list(zip(model.non_trainable_variables, statistics[k], strict=True))
                with compat.stateless_scope(values) as scope:
                    kwargs = {} if mask is None else {"mask": mask}
                    outputs = model.call(given, training=True, **kwargs)
                    losses = model.losses
            if losses:
                raise StageError(
                    f"Stage {stage.index} adds penalties (regularisers, add_loss), which a "
                    "tensor-parallel stage would count once per member. Drop them from the "
                    "model, or train it without the layout map. Received: "
                    f"{len(losses)} penalty term(s)"
                )
            kept[k] = _Kept(tape, own, mine, outputs)
            results[k] = (
                outputs,
                [scope.get_current_value(v) for v in model.non_trainable_variables],
            )

        strategy.run(member)
        outputs = self._joined([results[k][0] for k in range(self.degree)])
        return outputs, [results[k][1] for k in range(self.degree)]

    def backward(self, key, stage: Stage, kept: dict, upstream, *, last: bool, part="both"):
        """One backward pass of the group `key` from its members' `kept` tapes: `upstream`
        is, on the last stage, the gradient of the loss for the stage's outputs (as they
        were put together), else the gradient of each differentiable item the stage sent,
        as it came back. `part`: "both" the weights' gradients and the input's; split as
        zero-bubble schedules do, "input" the input's only (the tapes are kept, with what
        seeds them) and later "weights" the weights' only (`upstream` unused). Returns
        (each member's weight gradients, or None for "input"; the gradient of each watched
        item the stage received, every member's rows end to end)."""
        strategy = self.strategies[key]
        grads: dict[int, list] = {}
        back: dict[int, list] = {}

        def member():
            k = _member()
            own = kept[k] if part == "input" else kept.pop(k)
            if part == "weights":
                targets, seeds = own.seeded
                got = own.tape.gradient(targets, own.weights, output_gradients=seeds)
                grads[k] = list(got)
                return
            mine = [self._rows(g, k) for g in upstream]
            if last:
                targets, seeds, passed = tf.nest.flatten(own.outputs), mine, {}
            else:
                targets, seeds, passed = stage.seeds(own.outputs, mine)
            watched = stage.watched(own.received) if own.received else []
            sources = watched if part == "input" else [*own.weights, *watched]
            if part == "input":
                own.seeded = targets, seeds
                if not watched:  # stage 0: no input to take a gradient for
                    return
            got = own.tape.gradient(targets, sources, output_gradients=seeds)
            if part == "both":
                grads[k] = list(got[: len(own.weights)])
            if own.received:
                back[k] = stage.sent_back(got[len(sources) - len(watched) :], own.received,
                                          passed)  # fmt: skip

        strategy.run(member)
        sent = []
        if back:
            sent = [
                tf.concat([back[k][i] for k in range(self.degree)], 0) for i in range(len(back[0]))
            ]
        if part == "input":
            return None, sent
        return [grads[k] for k in range(self.degree)], sent

    # --- rows ----------------------------------------------------------------------------------

    def _rows(self, t, k: int):
        """Member k's rows of `t` (its 1/T of the micro-batch)."""
        if t is None:
            return None
        n = t.shape[0]
        if n is None or n % self.degree:
            raise StageError(
                f"A tensor-parallel stage cuts each micro-batch into its {self.degree} "
                f"members' rows: make the micro-batch a multiple of {self.degree}. "
                f"Received: a micro-batch of {n}"
            )
        size = n // self.degree
        return t[k * size : (k + 1) * size]

    @staticmethod
    def _joined(per_member: list):
        """The members' rows of a structure, end to end."""
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *per_member)


def _member() -> int:
    """This member's place in its group, inside the group's strategy's run."""
    context = tf.distribute.get_replica_context()
    return int(tf.get_static_value(context.replica_id_in_sync_group))


__all__ = ["TensorStages"]
