"""Where a pipeline stage's activations go forward and their gradients back.

A send names its stage replica (pipeline p, stage k), its micro-batch and its way; the
receiving replica is stage k+1 forward, k-1 back. Between replicas of this process (devices
of one TensorFlow program) a send is a mailbox entry the receive takes, copied onto the
receiver's device. Between worker processes it is TensorFlow's point-to-point collective
transfer (tfdist.collective.transport), one 2-member group per pair of neighbouring stages
of a pipeline (its group key: LINK_GROUP_KEY_BASE + p * stages + k for the pair k, k+1) and
one instance key per micro-batch, way and item of what crosses the cut. A transfer between
processes needs whole shapes: what crosses each cut is worked out from the micro-batch's
shape through the stages before it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import keras
import tensorflow as tf

from tfdist.collective.keys import group_key_base
from tfdist.collective.transport import Transfers
from tfdist.parallel.pipeline.stages import Stage

# Group keys of the stage-to-stage links (one 2-member group per neighbouring pair);
# collective/keys.py holds every range.
LINK_GROUP_KEY_BASE = group_key_base("pipeline_links")


class StageLinks:
    """The sends and receives of one step program's stage replicas.

    Args:
      stages: the model's stages.
      local: the (pipeline, stage) replicas this program runs: sends between them go
        through the mailbox.
      transfers: the program's transfers between worker processes (None: every replica
        a send reaches is local).
      micro: the examples in a micro-batch (whole shapes of the transfers between
        processes; needed only with `transfers`).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        local: Collection[tuple[int, int]],
        *,
        transfers: Transfers | None = None,
        micro: int | None = None,
    ):
        self.stages, self.local = list(stages), set(local)
        self.transfers, self.micro = transfers, micro
        self.mailbox: dict[tuple[int, int, bool, int], list] = {}
        self.crossings: list[list] = []  # per cut, what crosses it (traced, symbolic)

    def begin(self, x) -> None:
        """A step is traced: an empty mailbox, and (between processes) what crosses each
        cut for one micro-batch of `x`."""
        self.mailbox = {}
        if self.transfers is not None:
            self.crossings = trace_crossings(self.stages, x, self.micro)

    def send(self, pipeline: int, stage: int, m: int, tensors: list, *, forward: bool) -> None:
        """Stage `stage` of `pipeline` sends micro-batch `m`'s activations (`forward`) to the
        next stage, or their gradients to the one before."""
        to = stage + (1 if forward else -1)
        if (pipeline, to) in self.local:
            self.mailbox[pipeline, to, forward, m] = tensors
            return
        group = self.link(pipeline, min(to, stage))
        for item, tensor in enumerate(tensors):
            self.transfers.send(tensor, group_key=group, key=self.key(m, forward, item))

    def receive(self, pipeline: int, stage: int, m: int, *, forward: bool) -> list:
        """What the stage before (`forward`) or after sent stage `stage` of `pipeline`
        for micro-batch `m` (under the receiver's device)."""
        key = (pipeline, stage, forward, m)
        if key in self.mailbox:
            return [tf.identity(t) for t in self.mailbox.pop(key)]  # copied to this device
        low = stage - 1 if forward else stage
        return [
            self.transfers.receive(
                spec.shape,
                dtype=spec.dtype,
                group_key=self.link(pipeline, low),
                key=self.key(m, forward, item),
            )  # fmt: skip
            for item, spec in enumerate(self.specs(low, back=not forward))
        ]

    def after_sends(self, outputs: list) -> list:
        """`outputs`, once this program's sends between processes are made."""
        return outputs if self.transfers is None else self.transfers.after_sends(outputs)

    def link(self, pipeline: int, low_stage: int) -> int:
        """The group key of the link between stages low_stage and low_stage + 1."""
        return LINK_GROUP_KEY_BASE + pipeline * len(self.stages) + low_stage

    def key(self, m: int, forward: bool, item: int) -> int:
        """A transfer's instance key within the program: one per micro-batch, way and item
        of the crossing."""
        width = max(len(items) for items in self.crossings)
        return (2 * m + (not forward)) * width + item

    def specs(self, stage: int, *, back: bool = False) -> list[tf.TensorSpec]:
        """What crosses the cut after stage `stage` for one micro-batch, forward (its
        activations and masks) or `back` (the gradients of those that take one)."""
        items = self.crossings[stage]
        if back:
            differentiable = self.stages[stage].sent.differentiable
            items = [t for t, d in zip(items, differentiable, strict=True) if d]
        return [tf.TensorSpec(t.shape, t.dtype) for t in items]


def trace_crossings(stages: Sequence[Stage], x, micro: int) -> list[list]:
    """What crosses each cut for one micro-batch of `micro` examples of `x`, symbolically:
    a sequence length the model leaves open is worked out from the batch."""
    given = tf.nest.map_structure(lambda t: keras.KerasTensor((micro, *t.shape[1:]), t.dtype), x)
    flat, received, found = tf.nest.flatten(given), [], []
    for stage in stages[:-1]:
        inputs = given if stage.first else stage.call_args(received, flat)[0]
        received = stage.passed_on(stage.model.compute_output_spec(inputs), received)
        found.append(received)
    return found
