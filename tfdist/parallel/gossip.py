"""Decentralized (gossip) SGD: no all-reduce and no server; each replica averages with peers.

After each local optimizer step, every replica replaces its weights by an average of its
own and its peers' (D-PSGD, Lian et al., 2017, "Can decentralized algorithms outperform
centralized algorithms?"). A replica talks only to its peers, so a step's exchange costs
the same whatever the number of workers, and a slow worker slows its neighbours, not
everyone at once. The replicas' weights differ by a distance the mixing keeps bounded; it
is measured at every settle (each epoch end, before a save), where they are averaged into
one model for evaluation and checkpoints.

Topologies:
- 'ring': each replica averages with its left and right neighbours, weights 1/3 each
  (1/2 each with 2 replicas, which is the full average: synchronous SGD for SGD).
- 'exponential': a time-varying one-peer exponential graph (Assran et al., 2019, SGP;
  Ying et al., 2021): at step t replica r averages, half and half, with replica
  r - 2^(t mod log2 N) and sends to r + 2^(t mod log2 N). One buffer sent per step; with N
  a power of two, log2 N steps of it average exactly.

Both mixings are doubly stochastic, so the replicas' mean moves as synchronous SGD's would
with the mean gradient.

Example:

    tfdist.fit(model, data, gossip="ring")
    # or: tfdist.fit(model, data, step_hooks=[tfdist.parallel.Gossip("exponential")])

Across worker processes (multi_worker_mirrored, one device per process), a replica's
weights travel to its peers over tfdist's point-to-point collective transfers
(ProcessNeighbours); over the local devices of a mirrored strategy, as copies.
"""

from __future__ import annotations

import math

import tensorflow as tf

from tfdist.collective.transport import ProcessNeighbours
from tfdist.parallel.local_sgd import LocalUpdateError, LocalUpdates

TOPOLOGIES = ("ring", "exponential")


class Gossip(LocalUpdates):
    """Gossip SGD: a local step, then each replica averages with its peers (see the module).

    Args:
      topology: 'ring' or 'exponential'.
      timeout_seconds: how long a transfer between worker processes may wait for its peer.
    """

    def __init__(self, topology: str = "ring", *, timeout_seconds=None):
        if topology not in TOPOLOGIES:
            raise LocalUpdateError(
                f"gossip takes a topology: {', '.join(TOPOLOGIES)}. Received: {topology!r}"
            )
        super().__init__(timeout_seconds=timeout_seconds)
        self.topology = topology

    @property
    def name(self) -> str:
        return f"gossip={self.topology!r}"

    def connect(self) -> None:
        super().connect()
        self.peers = None
        if self.processes:
            self.peers = ProcessNeighbours(
                rank=self.rank, ranks=self.ranks, timeout_seconds=self.timeout_seconds
            )

    def offsets(self) -> list[int]:
        """The exponential graph's peer offsets, one per step in turn: 1, 2, 4, ... < N."""
        return [2**j for j in range(max(1, math.ceil(math.log2(self.ranks))))]

    def mix(self, step, flats):
        if self.ranks == 1:
            return flats
        if self.topology == "ring":
            return self._average_with(
                flats, lambda r: sorted({(r - 1) % self.ranks, (r + 1) % self.ranks} - {r})
            )
        branches = [
            (lambda offset=offset: self._exchange_one(flats, offset)) for offset in self.offsets()
        ]
        index = tf.cast(step % len(branches), tf.int32)
        return tf.switch_case(index, branches) if len(branches) > 1 else branches[0]()

    def _average_with(self, flats, peers_of) -> list[tf.Tensor]:
        """Each replica's mean of its own buffer and its peers' (the same peers both ways)."""
        if self.peers is not None:
            (flat,) = flats
            peers = peers_of(self.rank)
            received = self.peers.exchange(flat, send_to=peers, receive_from=peers)
            self._count(flat, len(peers))
            return [tf.add_n([flat, *received]) / (1 + len(peers))]
        out = []
        for r, flat in enumerate(flats):
            with tf.device(self.devices[r]):
                peers = peers_of(r)
                out.append(tf.add_n([flat, *[flats[p] for p in peers]]) / (1 + len(peers)))
        self._count(flats[0], len(peers_of(0)) * len(flats))
        return out

    def _exchange_one(self, flats, offset: int) -> list[tf.Tensor]:
        """Each replica's half-and-half average with the one `offset` ranks to its left."""
        if self.peers is not None:
            (flat,) = flats
            (received,) = self.peers.exchange(
                flat,
                send_to=[(self.rank + offset) % self.ranks],
                receive_from=[(self.rank - offset) % self.ranks],
            )
            with tf.control_dependencies([self._count(flat, 1)]):
                return [(flat + received) / 2]
        out = []
        for r, flat in enumerate(flats):
            with tf.device(self.devices[r]):
                out.append((flat + flats[(r - offset) % self.ranks]) / 2)
        with tf.control_dependencies([self._count(flats[0], len(flats))]):
            return [tf.identity(o) for o in out]

    def _count(self, flat, buffers: int):
        """Counts `buffers` sends of `flat` in the bytes this process sent."""
        return self.sent.assign_add(buffers * int(flat.shape[0]) * flat.dtype.size)
