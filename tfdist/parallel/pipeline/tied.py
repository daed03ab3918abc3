"""Weights several stages hold (Megatron-LM's tied embeddings: the first stage's lookup
table is the last stage's output kernel): which stages hold each (`tied`), and for each
such weight who reads it and how its gradients add up (`shared`: dense, or rows an
Embedding looked up, which Adam squares apart as one device does).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import tensorflow as tf

from tfdist.parallel.pipeline.stages import Stage
from tfdist.training import sparse_rows

log = logging.getLogger(__name__)


def tied(stages: Sequence[Stage]) -> dict[int, tuple[int, ...]]:
    """{position in the model's trainable_variables: the stages holding it} for each weight
    that more than one stage uses (its gradient is the sum of theirs)."""
    holders: dict[int, list[int]] = {}
    for stage in stages:
        for i in stage.trainable:
            holders.setdefault(i, []).append(stage.index)
    return {i: tuple(s) for i, s in sorted(holders.items()) if len(s) > 1}


@dataclasses.dataclass(frozen=True)
class SharedWeight:
    """A weight that several stages hold (their layers share it), and how they use it.

    A layer called on both sides of a cut puts its weights in both stages, but a call may
    read only some of them: keras-hub's untied ReversibleEmbedding looks tokens up in
    `embeddings` in the first stage and projects logits with `reverse_embeddings` in the
    last. Only a weight that several stages read is tied.

    Attributes:
      holders: the stages that hold it (their copies must take the same steps).
      users: the stages whose forward pass reads it.
      rows: every user's gradient is rows looked up by the batch (tokens): one device's tape
        keeps those rows apart, so the holders exchange them as rows, not summed dense.
    """

    holders: tuple[int, ...]
    users: tuple[int, ...]
    rows: bool

    @property
    def tied(self) -> bool:
        return len(self.users) > 1


def shared(stages: Sequence[Stage]) -> dict[int, SharedWeight]:
    """{position in the model's trainable_variables: how the stages share it} for each
    weight that more than one stage holds. Each stage holding one is traced once (no step
    runs) to see which weights it reads and how their gradients come."""
    holders = tied(stages)
    if not holders:
        return {}
    kinds = {s.index: _gradient_kinds(s) for s in stages if set(s.trainable) & set(holders)}
    out = {}
    for i, held in holders.items():
        found = {s: kinds[s][stages[s].trainable.index(i)] for s in held}
        if any(kind == "unknown" for kind in found.values()):
            # The stage could not be traced on its own: every holder is taken to read the
            # weight, and the gradients are summed dense (as before the probe existed).
            out[i] = SharedWeight(held, held, rows=False)
            continue
        users = tuple(s for s in held if found[s] is not None)
        out[i] = SharedWeight(held, users, rows=all(found[s] == "rows" for s in users))
    return out


def _gradient_kinds(stage: Stage) -> list[str | None]:
    """For each of `stage`'s trainable weights: None where its forward pass does not read
    it, 'rows' where its gradient is rows looked up by the batch, 'dense' otherwise; every
    one 'unknown' where the stage cannot be traced from its inputs' shapes."""
    model = stage.model
    structure = model.input
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in tf.nest.flatten(structure)]
    kinds: list[str | None] = []

    def probe(*flat):
        data = tf.nest.pack_sequence_as(structure, list(flat))
        weights = [tf.identity(v.value) for v in model.trainable_variables]
        statistics = [tf.identity(v.value) for v in model.non_trainable_variables]
        with tf.GradientTape() as tape:
            tape.watch(weights)
            outputs, _ = model.stateless_call(weights, statistics, data, training=True)
            total = tf.add_n(
                [tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(outputs)]
            )
        for g in tape.gradient(total, weights):
            if g is None:
                kinds.append(None)
            elif isinstance(g, tf.IndexedSlices) and not sparse_rows.batch_independent(g.indices):
                kinds.append("rows")
            else:
                kinds.append("dense")
        return total

    try:
        tf.function(probe).get_concrete_function(*specs)
    except Exception as e:  # noqa: BLE001 - a stage the probe cannot call is taken as read whole
        log.debug("Stage %d could not be traced on its own (%s)", stage.index, e)
        return ["unknown"] * len(model.trainable_variables)
    return kinds
