"""Where a sharded optimizer keeps its state: the one offload policy ZeRO's hooks read.

As FSDP2's `fully_shard(module, offload_policy=CPUOffloadPolicy())` and DeepSpeed's
ZeRO-Offload, tfdist.fit's `offload='optimizer'` keeps each replica's slice of the
optimizer's state (its slots, and the slice of the weights they update) in host memory:
the update runs there, and the updated slice is copied back to the replica's device.

    policy = Offload.of("optimizer", who="shard_optimizer='zero2'", error=ShardingError)
    policy.state_device(strategy, "/gpu:0")   # the host's CPU
    Offload.of(None, ...).state_device(strategy, "/gpu:0")   # "/gpu:0"
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tensorflow as tf

from tfdist.errors import FitError
from tfdist.parallel import host

# fit's offload= values: what goes to host memory.
OPTIMIZER = "optimizer"


@dataclasses.dataclass(frozen=True, eq=False)
class Offload:
    """An offload policy (see the module). It equals the keyword value that names it
    (`Offload(optimizer=True) == "optimizer"`, `Offload() == None`), as fit's keyword does.

    Attributes:
      optimizer: each replica's optimizer state, and the slice of the weights it updates,
        live in host memory.
    """

    optimizer: bool = False

    @classmethod
    def of(cls, value: Any, *, who: str, error: type[FitError] = FitError) -> Offload:
        """The policy fit's `offload` names (None, 'optimizer', or a policy); raises `error`,
        naming `who`, otherwise."""
        if isinstance(value, Offload):
            return value
        if value not in (None, OPTIMIZER):
            raise error(
                f"{who} takes offload=None or {OPTIMIZER!r} (the optimizer's state in host "
                f"memory). Received: offload={value!r}"
            )
        return cls(optimizer=value == OPTIMIZER)

    def __bool__(self) -> bool:
        return self.optimizer

    def state_device(self, strategy: tf.distribute.Strategy, device: str | None) -> str | None:
        """Where a replica on `device` keeps its optimizer state and updates its slice."""
        return host.host_device(strategy) if self.optimizer else device

    @property
    def keyword(self) -> str | None:
        """The value of fit's `offload` that names this policy."""
        return OPTIMIZER if self.optimizer else None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Offload):
            return self.optimizer == other.optimizer
        return (other is None or isinstance(other, str)) and other == self.keyword

    def __hash__(self) -> int:
        return hash(self.keyword)

    def __repr__(self) -> str:
        return repr(self.keyword)
