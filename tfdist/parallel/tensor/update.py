"""TensorParallelUpdate: the split layers' parts updated in tfdist.fit's step chain.

Each replica's gradient of its parts counts its group's examples, so a part's gradient is
summed over the replicas holding the same part (one per data-parallel group) and applied by
an optimizer of that replica's own (the user's optimizer's class and config); the other
weights' gradients go on down the chain as usual. tfdist.fit adds it (the registry's entry
with no keyword) when a model has split layers: under Keras's own fit the parts would not
be updated correctly.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfdist.parallel import optimizer_copies
from tfdist.parallel.tensor.layers import split_layers
from tfdist.parallel.tensor.layout_map import plan_of
from tfdist.parallel.tensor.layout_parallel import LayoutParallel
from tfdist.parallel.tensor.mappings import TensorParallelError, summed_over
from tfdist.training.hooks import StepHook
from tfdist.training.job import Job


class TensorParallelUpdate(StepHook):
    """Updates the split weights' parts in tfdist.fit's chain; the rest go on as usual.

    In each replica's step, the gradient of its parts (which count its group's examples) is
    summed over the replicas that hold the same parts, one per group, and applied by the
    replica's own copy of the user's optimizer (same class and config, its slots built for
    its parts only, on its device, counting the user's optimizer's steps and taking its
    learning rate). tfdist.fit adds it when the model has split layers.
    """

    synchronous_only = True
    # It applies the parts' update and hands the other gradients on.
    applies_update = True
    # Each replica's optimizer copy for its parts: Keras's BackupAndRestore cannot save it.
    keeps_optimizer_state = True

    @property
    def name(self) -> str:
        return "the tensor-parallel layers' update"

    def build(self, model: keras.Model, job: Job) -> None:
        if self.already_built(model, job):
            return  # a later fit: each part's optimizer keeps its state
        optimizer = model.optimizer
        who = "Tensor-parallel layers' parts"
        optimizer_copies.check_copyable(optimizer, who=who, error=TensorParallelError)
        if optimizer.clipnorm is not None:
            raise TensorParallelError(
                f"{who} are updated one replica at a time, so the norm of a whole weight "
                "(clipnorm) is not known where a part is updated. Use clipvalue, or no "
                f"clipping. Received: clipnorm={optimizer.clipnorm}"
            )
        layers = split_layers(model)
        replicas = job.placement.replicas
        self.degree = {layer.tensor_parallel for layer in layers}
        if len(self.degree) != 1:
            raise TensorParallelError(
                "Every split layer of a model must use the same tensor_parallel degree. "
                f"Received: degrees {sorted(self.degree)}"
            )
        (self.degree,) = self.degree
        # Replica -> its parts, in the model's order (the same order on every replica).
        self.parts: list[list[keras.Variable]] = [[] for _ in range(replicas)]
        for layer in layers:
            for parts in layer._parts.values():
                for replica, variable in enumerate(parts):
                    self.parts[replica].append(variable)
        self.owned = {id(v) for parts in self.parts for v in parts}
        rest = [v for v in model.trainable_variables if id(v) not in self.owned]

        def make():
            copies = []
            for parts in self.parts:
                with tf.device(parts[0].value.device if parts else None):
                    copies.append(optimizer_copies.optimizer_copy(optimizer, parts))
            return copies

        self.optimizers = optimizer_copies.outside_strategy(make)
        self.user = optimizer
        optimizer.build(rest)  # the user's optimizer keeps the replicated weights' state

    def apply(self, grads_and_vars, apply_next):
        context = tf.distribute.get_replica_context()
        replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        given = {id(v): g for g, v in grads_and_vars}
        parts = self.parts[replica]
        copies = list(range(replica % self.degree, len(self.parts), self.degree))
        grads = [given.get(id(v)) for v in parts]
        grads = [
            tf.zeros_like(v.value) if g is None else g for g, v in zip(grads, parts, strict=True)
        ]
        summed = summed_over(grads, [tuple(v.shape) for v in parts], copies)
        copy, user = self.optimizers[replica], self.user
        with tf.device(parts[0].value.device):
            # The user's optimizer counts the step after this hook (Adam's bias correction
            # reads iterations + 1); the copy reads the same count.
            copy.iterations.assign(tf.cast(user.iterations, copy.iterations.dtype))
            optimizer_copies.update_step(
                copy, summed, parts, learning_rate=user.learning_rate,
                weight_decay=user.weight_decay or 0.0,
            )  # fmt: skip
        rest = [(g, v) for g, v in grads_and_vars if id(v) not in self.owned]
        return apply_next(rest)

    def checkpoint_state(self) -> dict:
        return {f"tensor_parallel_optimizer_{r}": copy for r, copy in enumerate(self.optimizers)}


def update_for(
    model: keras.Model,
    *,
    shard_optimizer: str | None = None,
    offload: str | None = None,
    pipeline: object | None = None,
) -> StepHook | None:
    """The update a model's split layers need in tfdist.fit's chain (None: it has none):
    LayoutParallel for a model tensor_parallel(layout_map=...) marked, its parts sharded
    over their data groups under `shard_optimizer`. Under `pipeline` the stages train a
    layout's parts themselves (pipeline/tensor.py): none.

    Raises:
      TensorParallelError: `shard_optimizer` with split layers (the rewrite of
        tensor_parallel(degree=...) on Keras's own layers), or `offload` with a layout.
    """
    plan = plan_of(model)
    if plan is not None and pipeline is not None:
        return None
    if plan is not None:
        if offload is not None:
            raise TensorParallelError(
                "offload='optimizer' keeps a sharded optimizer's state in host memory; under "
                "a tensor-parallel layout it is not built. Drop offload, or the layout. "
                f"Received: offload={offload!r} with tensor_parallel(layout_map=...)"
            )
        return LayoutParallel(plan, shard=shard_optimizer)
    if not split_layers(model):
        return None
    if shard_optimizer is not None:
        raise TensorParallelError(
            f"shard_optimizer={shard_optimizer!r} shards the parts of a model split by a "
            "layout (tensor_parallel(model, layout_map=...)); the split layers that "
            "tensor_parallel(model, degree=...) wrote hold their parts their own way. Split "
            "the model by a layout: tensor_parallel(model, layout_map=derive_layout_map(model, "
            f"mesh)). Received: shard_optimizer={shard_optimizer!r} with split layers"
        )
    return TensorParallelUpdate()


__all__ = ["TensorParallelUpdate", "update_for"]
