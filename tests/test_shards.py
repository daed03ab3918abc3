"""Sharded checkpoints (tfdist.training.shards): parts written by N processes, read back as
the slices of M, against the whole weight they came from. The processes are played here by
one process writing each rank's part in turn (the jobs in tests/test_zero.py and
tests/test_pipeline.py write them from real worker processes)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tensorflow as tf

from tfdist.training import shards

pytestmark = pytest.mark.fast


class _Slices(shards.Shards):
    """Rank `rank` of `ranks`' slice of each flat weight, as zero3 holds it (padded)."""

    def __init__(self, weights: dict[str, np.ndarray], rank: int, ranks: int):
        self.weights, self.rank, self.ranks = weights, rank, ranks
        self.read_back: dict[str, np.ndarray] = {}

    def _pieces(self):
        for key, whole in self.weights.items():
            n = whole.size
            k = math.ceil(n / self.ranks)
            lo = self.rank * k
            if lo < n:
                yield key, whole.reshape(-1), lo, min(lo + k, n), k

    def entries(self):
        return [
            shards.Entry(key, tf.constant(flat[lo:hi]), shards.flat_slice(flat.size, lo, hi))
            for key, flat, lo, hi, _ in self._pieces()
        ]

    def wanted(self):
        def keep(key, k):
            return lambda value: self.read_back.__setitem__(key, shards.padded(value, k).numpy())

        return [
            shards.Wanted(key, tf.float32, keep(key, k), shards.flat_slice(flat.size, lo, hi))
            for key, flat, lo, hi, k in self._pieces()
        ]


def _save(weights, prefix: str, ranks: int) -> None:
    """Each rank writes its part; the merge runs once every rank has written (the chief's
    barrier: here, after the last)."""
    for rank in range(ranks):
        last = rank == ranks - 1
        shards.write(
            _Slices(weights, rank, ranks), prefix, rank=rank, ranks=ranks,
            barrier=lambda failed=False: failed, is_chief=last,
        )  # fmt: skip


@pytest.mark.parametrize("saved_by, read_by", [(4, 3), (2, 4), (3, 1)])
def test_parts_written_by_n_processes_read_back_as_the_slices_of_m(tmp_path, saved_by, read_by):
    rng = np.random.default_rng(0)
    weights = {"trainable/0": rng.normal(size=(7, 5)).astype("float32"),
               "trainable/1": rng.normal(size=(3,)).astype("float32")}  # fmt: skip
    prefix = str(tmp_path / "ckpt-4")
    _save(weights, prefix, saved_by)
    assert shards.has_shards(prefix)
    for key, whole in weights.items():
        got = []
        for rank in range(read_by):
            part = _Slices({key: whole}, rank, read_by)
            shards.read(part, prefix)
            if key in part.read_back:
                k = math.ceil(whole.size / read_by)
                got.append(part.read_back[key][: min(k, whole.size - rank * k)])
        np.testing.assert_array_equal(np.concatenate(got), whole.reshape(-1))


def test_a_save_of_the_same_step_again_replaces_what_an_earlier_one_left(tmp_path):
    prefix = str(tmp_path / "ckpt-2")
    _save({"trainable/0": np.zeros(6, "float32")}, prefix, 3)
    _save({"trainable/0": np.arange(6, dtype="float32")}, prefix, 2)
    part = _Slices({"trainable/0": np.zeros(6, "float32")}, 0, 1)
    shards.read(part, prefix)
    np.testing.assert_array_equal(part.read_back["trainable/0"], np.arange(6))


def test_a_part_the_shards_do_not_hold_is_named(tmp_path):
    prefix = str(tmp_path / "ckpt-1")
    _save({"trainable/0": np.zeros(4, "float32")}, prefix, 1)
    other = _Slices({"trainable/7": np.zeros(4, "float32")}, 0, 1)
    with pytest.raises(KeyError, match="hold no trainable/7"):
        shards.read(other, prefix)
