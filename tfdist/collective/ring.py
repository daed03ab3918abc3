"""The ring all-reduce algorithm, independent of how bytes travel between ranks.

N ranks sit on a ring. A flat buffer is cut into N chunks whose sizes differ by at most one
element. Reduce-scatter: in step s (0 <= s < N-1) rank r sends chunk (r - s) to rank r+1 and
adds the chunk (r - s - 1) it receives from rank r-1; afterwards rank r holds the complete
sum of chunk (r + 1). All-gather: in step s rank r passes chunk (r + 1 - s) on and takes
chunk (r - s) as it arrives. Each rank sends 2(N-1)/N of the buffer, whatever N is — which is
why the ring does not make one rank the bottleneck the way gather-to-one does.

Reduce-scatter and all-gather are also ZeRO's halves (tfdist.parallel.zero): after the
first, each rank updates only the chunk it owns, and the second shares the updated chunks.

The transport is a function `exchange(send, recv_size, step)` that hands `send` to the
right neighbour and returns the `recv_size` elements the left neighbour handed over in the
same step (None and 0 when a chunk is empty); the functions here only build the tensor
program around it.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

REDUCTIONS = ("sum", "mean")

Exchange = Callable[[tf.Tensor | None, int, int], tf.Tensor | None]
"""(tensor to send right or None, elements to receive from the left or 0, step) -> received."""


def chunk_bounds(length: int, ranks: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk; sizes differ by at most one, larger ones first."""
    base, extra = divmod(length, ranks)
    bounds, start = [], 0
    for i in range(ranks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def reduce_scatter_schedule(rank: int, ranks: int) -> list[tuple[int, int]]:
    """(chunk sent, chunk received and added) for each reduce-scatter step of `rank`."""
    return [((rank - s) % ranks, (rank - s - 1) % ranks) for s in range(ranks - 1)]


def all_gather_schedule(rank: int, ranks: int) -> list[tuple[int, int]]:
    """(chunk sent, chunk received and kept) for each all-gather step of `rank`."""
    return [((rank + 1 - s) % ranks, (rank - s) % ranks) for s in range(ranks - 1)]


def owned_chunk(rank: int, ranks: int) -> int:
    """The chunk whose complete sum `rank` holds after the reduce-scatter (and sends first in
    the all-gather)."""
    return (rank + 1) % ranks


def ring_reduce_scatter(
    chunks: list[tf.Tensor], *, rank: int, ranks: int, exchange: Exchange, first_step: int = 0
) -> list[tf.Tensor]:
    """Builds the ring's reduce-scatter of this rank's `chunks` (one 1-D tensor per rank).

    Every rank passes chunks of the same sizes. Afterwards chunk `owned_chunk(rank, ranks)`
    of the returned list is the sum of that chunk over every rank; the others are partial.
    `first_step` numbers the exchanges (N-1 of them) after those of an earlier phase.
    """
    chunks = list(chunks)
    for s, (sent, received) in enumerate(reduce_scatter_schedule(rank, ranks)):
        got = _swap(chunks, sent, received, exchange, first_step + s)
        if got is not None:
            chunks[received] = chunks[received] + got
    return chunks


def ring_all_gather(
    chunks: list[tf.Tensor], *, rank: int, ranks: int, exchange: Exchange, first_step: int = 0
) -> list[tf.Tensor]:
    """Builds the ring's all-gather: each rank contributes chunk `owned_chunk(rank, ranks)` of
    its `chunks` (the others are only shapes) and ends with every rank's."""
    chunks = list(chunks)
    for s, (sent, received) in enumerate(all_gather_schedule(rank, ranks)):
        got = _swap(chunks, sent, received, exchange, first_step + s)
        if got is not None:
            chunks[received] = got
    return chunks


def _swap(chunks, sent: int, received: int, exchange: Exchange, step: int):
    # With fewer elements than ranks some chunks are empty: nothing is sent or received for
    # them, and both neighbours agree on that because they compute the same sizes.
    send = chunks[sent] if int(chunks[sent].shape[0]) else None
    return exchange(send, int(chunks[received].shape[0]), step)


def ring_all_reduce(
    flat: tf.Tensor, *, rank: int, ranks: int, exchange: Exchange, reduction: str = "sum"
) -> tf.Tensor:
    """Builds the ring all-reduce of a 1-D tensor over `ranks` ranks: a reduce-scatter, then
    an all-gather.

    Args:
      flat: this rank's 1-D tensor; every rank must pass the same length and dtype.
      rank: this rank's position on the ring, 0 <= rank < ranks.
      ranks: how many ranks take part.
      exchange: the transport; see the module docstring.
      reduction: 'sum' or 'mean' (integer means round toward zero, like TensorFlow's).

    Returns:
      The element-wise reduction over all ranks, on every rank.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be 'sum' or 'mean'. Received: reduction={reduction!r}")
    if ranks == 1:
        return mean_of_sum(flat, 1) if reduction == "mean" else flat
    chunks = [flat[start:end] for start, end in chunk_bounds(int(flat.shape[0]), ranks)]
    chunks = ring_reduce_scatter(chunks, rank=rank, ranks=ranks, exchange=exchange)
    chunks = ring_all_gather(
        chunks, rank=rank, ranks=ranks, exchange=exchange, first_step=ranks - 1
    )
    result = tf.concat(chunks, axis=0)
    return mean_of_sum(result, ranks) if reduction == "mean" else result


def mean_of_sum(tensor: tf.Tensor, ranks: int) -> tf.Tensor:
    """A sum over `ranks` ranks turned into their mean (integers round toward zero)."""
    if tensor.dtype.is_integer:
        return tf.truncatediv(tensor, tf.cast(ranks, tensor.dtype))
    return tensor / tf.cast(ranks, tensor.dtype)


def local_ring_reduce_scatter(
    chunks: list[list[tf.Tensor]], devices: list[str]
) -> list[list[tf.Tensor]]:
    """The ring's reduce-scatter over local devices, built for all ranks in one program.

    `chunks[d]` is device d's buffer cut into one chunk per device (every device the same
    sizes). Rank d runs on `devices[d]`; a chunk moves to the right neighbour as a copy onto
    its device, where it is added. Afterwards `chunks[d][owned_chunk(d, ranks)]` is complete.
    """
    return _local_ring(chunks, devices, reduce_scatter_schedule, lambda mine, got: mine + got)


def local_ring_all_gather(
    chunks: list[list[tf.Tensor]], devices: list[str]
) -> list[list[tf.Tensor]]:
    """The ring's all-gather over local devices: device d contributes
    `chunks[d][owned_chunk(d, ranks)]` and ends with every device's."""
    return _local_ring(chunks, devices, all_gather_schedule, lambda mine, got: got)


def _local_ring(chunks, devices, schedule, combine):
    ranks = len(chunks)
    chunks = [list(c) for c in chunks]
    plans = [schedule(r, ranks) for r in range(ranks)]
    for step in range(ranks - 1):
        outgoing = [chunks[r][plans[r][step][0]] for r in range(ranks)]
        for r in range(ranks):
            received = plans[r][step][1]
            if int(chunks[r][received].shape[0]):
                with tf.device(devices[r]):
                    got = tf.identity(outgoing[(r - 1) % ranks])
                    chunks[r][received] = combine(chunks[r][received], got)
    return chunks


def local_ring_all_reduce(flats: list[tf.Tensor], devices: list[str]) -> list[tf.Tensor]:
    """The ring's sum of `flats[d]` (1-D, one per device), built for all ranks in one program:
    `local_ring_reduce_scatter`, then `local_ring_all_gather`."""
    ranks = len(flats)
    if ranks == 1:
        return list(flats)
    bounds = chunk_bounds(int(flats[0].shape[0]), ranks)
    chunks = []
    for flat, device in zip(flats, devices, strict=True):
        with tf.device(device):
            chunks.append([flat[start:end] for start, end in bounds])
    chunks = local_ring_all_gather(local_ring_reduce_scatter(chunks, devices), devices)
    results = []
    for rank_chunks, device in zip(chunks, devices, strict=True):
        with tf.device(device):
            results.append(tf.concat(rank_chunks, axis=0))
    return results
