"""ADMM SGD: each replica trains on its own data, and a consensus step joins them.

Consensus ADMM (Boyd et al., 2011, "Distributed Optimization and Statistical Learning via
the Alternating Direction Method of Multipliers", section 7.1) minimises sum_k f_k(x) over
N replicas, f_k the loss on replica k's own data, by giving each replica its own weights
x_k, a consensus z and a scaled dual u_k:

    x_k <- argmin f_k(x) + rho/2 ||x - z + u_k||^2     (here: `every` local optimizer steps)
    z   <- mean_k (x_k + u_k)                          (one all-reduce)
    u_k <- u_k + x_k - z

Each replica's local steps follow the gradient of its own loss plus the penalty,
g_k + rho (x_k - z + u_k), with its own copy of the user's optimizer (as local SGD's
replicas do), so nothing but the consensus travels: one all-reduce every `every` steps, and
no example crosses between replicas, as the parallel-and-distributed review (Hegde and
Usmani, 2016) describes it beside parallel SGD and Downpour. At a fixed point every x_k
equals z and the duals' sum is 0, so sum_k grad f_k(z) = 0: the optimum of the whole
problem, not of an average of the replicas' own optima (what averaging local SGD tends to
when the replicas' data differ). rho sets how hard the replicas are pulled together: small,
they wander towards their own optima; large, they move as one and slowly.

Example:

    tfdist.fit(model, data, admm={"rho": 1.0, "every": 4})
    # the binary: --admm=rho=1.0,every=4

What is evaluated and saved at each epoch's end is the replicas' mean (LocalUpdates'
settle), which equals z after a consensus step.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import tensorflow as tf

from tfdist.parallel import optimizer_copies
from tfdist.parallel.local_sgd import LocalUpdateError, LocalUpdates


class ADMM(LocalUpdates):
    """Consensus ADMM over the replicas (see the module docstring).

    Args:
      rho: the penalty's weight (> 0).
      every: local optimizer steps between consensus steps (>= 1).
      timeout_seconds: how long a transfer between worker processes may wait for its peer.
    """

    def __init__(self, rho: float, every: int = 1, *, timeout_seconds=None):
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not rho > 0:
            raise LocalUpdateError(f"admm['rho'] must be a number > 0. Received: rho={rho!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise LocalUpdateError(
                f"admm['every'] must be a whole number >= 1. Received: every={every!r}"
            )
        super().__init__(timeout_seconds=timeout_seconds)
        self.rho, self.every = float(rho), every
        self.consensus: list[tf.Variable] = []  # z, one copy per local replica's device
        self.duals: list[tf.Variable] = []  # u_k, one per local replica

    @property
    def name(self) -> str:
        return f"admm(rho={self.rho:g}, every={self.every})"

    def build(self, model, job) -> None:
        super().build(model, job)
        if self.consensus:
            return  # a later fit: z and the duals go on
        start = np.concatenate([np.reshape(v.numpy(), [-1]) for v in self.variables])
        start = start.astype(self.dtype.as_numpy_dtype)

        def make() -> None:
            for d, device in enumerate(self.devices):
                with tf.device(device):
                    self.consensus.append(tf.Variable(start, trainable=False, name=f"admm_z{d}"))
                    self.duals.append(
                        tf.Variable(np.zeros_like(start), trainable=False, name=f"admm_u{d}")
                    )

        optimizer_copies.outside_strategy(make)

    def local_gradients(self, step, grads, present):
        """Each replica's gradient of its augmented loss: g_k + rho (x_k - z + u_k)."""
        del step
        out = []
        for d, device in enumerate(self.devices):
            with tf.device(device):
                targets = tf.split(self.consensus[d].value() - self.duals[d].value(), self.sizes)
                pulls = [
                    self.rho * (w - tf.reshape(target, w.shape))
                    for w, target, on in zip(
                        self._components(self.strategy, d), targets, present, strict=True
                    )
                    if on
                ]  # the gradients come for the present variables only
                out.append(
                    [tf.convert_to_tensor(g) + p for g, p in zip(grads[d], pulls, strict=True)]
                )
        return out

    def mix(self, step, flats):
        """Every `every`-th step: z <- mean(x + u), u <- u + x - z. The weights stay each
        replica's own."""

        def join():
            sums = []
            for d, device in enumerate(self.devices):
                with tf.device(device):
                    sums.append(flats[d] + self.duals[d].value())
            means = self._mean(sums)
            writes = []
            for d, device in enumerate(self.devices):
                with tf.device(device):
                    writes.append(self.consensus[d].assign(means[d]))
                    writes.append(self.duals[d].assign_add(flats[d] - means[d]))
            with tf.control_dependencies(writes):
                return [tf.identity(flat) for flat in flats]

        return tf.cond(tf.equal((step + 1) % self.every, 0), join, lambda: list(flats))

    def checkpoint_state(self) -> dict:
        state = super().checkpoint_state()
        for d, (z, u) in enumerate(zip(self.consensus, self.duals, strict=True)):
            state[f"admm_consensus_{d}"], state[f"admm_dual_{d}"] = z, u
        return state


def from_options(options: Mapping[str, float]) -> ADMM:
    """The hook of the registry's `admm` keyword: {"rho": ..., "every": ...}."""
    return ADMM(options["rho"], options["every"])
