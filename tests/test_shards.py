"""Sharded checkpoints (tfdist.training.shards): parts written by N processes, read back as
the slices of M, against the whole weight they came from. The processes are played here by
one process writing each rank's part in turn (the jobs in tests/test_zero.py and
tests/test_pipeline.py write them from real worker processes)."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import tensorflow as tf

from tfdist.training import shard_reads, shards

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
            shards.Entry(
                key,
                tf.constant(flat[lo:hi]),
                shards.flat_slice(flat.size, lo, hi),
                weight_shape=self.weights[key].shape,
            )  # fmt: skip
            for key, flat, lo, hi, _ in self._pieces()
        ]

    def wanted(self):
        def keep(key, k):
            return lambda value: self.read_back.__setitem__(key, shards.padded(value, k).numpy())

        return [
            shards.Wanted(
                key,
                tf.float32,
                keep(key, k),
                shards.flat_slice(flat.size, lo, hi),
                weight_shape=self.weights[key].shape,
            )  # fmt: skip
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
    # One element: its one slice covers it, which TensorFlow's index keeps as a whole tensor.
    weights = {"trainable/0": rng.normal(size=(7, 5)).astype("float32"),
               "trainable/1": rng.normal(size=(3,)).astype("float32"),
               "trainable/2": rng.normal(size=(1,)).astype("float32")}  # fmt: skip
    prefix = str(tmp_path / "ckpt-4")
    _save(weights, prefix, saved_by)
    assert shards.has_shards(prefix)
    for key, whole in weights.items():
        got = []
        for rank in range(read_by):
            part = _Slices({key: whole}, rank, read_by)
            shard_reads.read(part, prefix)
            if key in part.read_back:
                k = math.ceil(whole.size / read_by)
                got.append(part.read_back[key][: min(k, whole.size - rank * k)])
        np.testing.assert_array_equal(np.concatenate(got), whole.reshape(-1))


def test_a_save_of_the_same_step_again_replaces_what_an_earlier_one_left(tmp_path):
    prefix = str(tmp_path / "ckpt-2")
    _save({"trainable/0": np.zeros(6, "float32")}, prefix, 3)
    _save({"trainable/0": np.arange(6, dtype="float32")}, prefix, 2)
    part = _Slices({"trainable/0": np.zeros(6, "float32")}, 0, 1)
    shard_reads.read(part, prefix)
    np.testing.assert_array_equal(part.read_back["trainable/0"], np.arange(6))


def test_a_part_the_shards_do_not_hold_is_named(tmp_path):
    prefix = str(tmp_path / "ckpt-1")
    _save({"trainable/0": np.zeros(4, "float32")}, prefix, 1)
    other = _Slices({"trainable/7": np.zeros(4, "float32")}, 0, 1)
    with pytest.raises(KeyError, match="hold no trainable/7"):
        shard_reads.read(other, prefix)


def test_parts_are_written_and_read_in_bounded_buffers(tmp_path, monkeypatch):
    """With buffers of 1 KiB, each rank writes its part as several bundles and reads its
    slices back in several reads; the values are those saved, and a process resuming on
    half the ranks reads from storage its slices' bytes (and the indexes), no more."""
    monkeypatch.setattr(shards, "BUCKET_BYTES", 1024)
    monkeypatch.setattr(shards, "WRITE_BUCKET_BYTES", 1024)
    rng = np.random.default_rng(1)
    weights = {f"trainable/{i}": rng.normal(size=(40, 30)).astype("float32") for i in range(4)}
    prefix = str(tmp_path / "ckpt-3")
    _save(weights, prefix, 4)
    # Each rank's 4 slices of 1.2 KB, a bundle each: the merge keeps their 16 data files.
    assert len(list((tmp_path / "ckpt-3.shards").glob("merged.data-*-of-00016"))) == 16
    metadata = shards.metadata_of(prefix)
    assert len(metadata["files"]) == 16
    slices = [whole.reshape(-1)[lo : lo + 300] for whole in [weights["trainable/0"]]
              for lo in range(0, 1200, 300)]  # fmt: skip
    assert metadata["entries"]["trainable/0"] == {
        "dtype": "float32", "shape": [1200], "weight_shape": [40, 30],
        "slices": [[0, 300], [300, 300], [600, 300], [900, 300]],
        # Each slice's bytes' CRC-32, a run of SUM_BYTES at a time (one run here).
        "sums": [[zlib.crc32(s.tobytes())] for s in slices],
    }  # fmt: skip
    assert metadata["sum_bytes"] == shards.SUM_BYTES
    assert shards.incomplete(prefix) is None
    part = _Slices(weights, 1, 2)
    done = shard_reads.read(part, prefix)
    assert done.reads == 4 and done.wanted_bytes == 4 * 600 * 4
    # The metadata and the merged index (about 3 KB here), and the slices' bytes.
    assert done.read_bytes is None or (
        done.wanted_bytes <= done.read_bytes <= done.wanted_bytes + 8192
    )
    for key, whole in weights.items():
        np.testing.assert_array_equal(part.read_back[key], whole.reshape(-1)[600:])


def _read_bytes() -> int | None:
    return shard_reads._bytes_read()


def test_small_slices_come_back_as_their_bytes_where_tensorflows_reader_reads_megabytes(
    tmp_path,
):
    """4 ranks each save a slice of a 64-float weight beside 2 MiB of another: a process of
    2 reads its 128 floats of the first as 512 bytes (and the index), where TensorFlow's
    reader fills a 1 MiB buffer from each data file it touches. Its checks read the runs
    of SUM_BYTES a partial slice overlaps (4 -> 3: no slice lines up), no more."""
    rng = np.random.default_rng(2)
    weights = {"trainable/0": rng.normal(size=(64,)).astype("float32"),
               "trainable/1": rng.normal(size=(2**21,)).astype("float32")}  # fmt: skip
    prefix = str(tmp_path / "ckpt-5")
    _save(weights, prefix, 4)
    small = {"trainable/0": weights["trainable/0"]}
    merged = tmp_path / "ckpt-5.shards"
    # What a read takes besides the slices: the metadata and the index.
    read_first = sum((merged / f"merged.{x}").stat().st_size for x in ("json", "index"))
    for read_by in (2, 3):
        for rank in range(read_by):
            part = _Slices(small, rank, read_by)
            done = shard_reads.read(part, prefix)
            k = math.ceil(64 / read_by)
            np.testing.assert_array_equal(
                part.read_back["trainable/0"][: min(k, 64 - rank * k)],
                weights["trainable/0"][rank * k : (rank + 1) * k],
            )
            if done.read_bytes is not None:
                # The saved slices it overlaps are 64 bytes each: at most 2 whole.
                assert done.read_bytes <= read_first + 2 * 64 + done.wanted_bytes, (read_by, rank)
    # The 8 MiB weight's 3 slices cut its 4 saved ones: a cut reads the run it falls in.
    large = {"trainable/1": weights["trainable/1"]}
    for rank in range(3):
        part = _Slices(large, rank, 3)
        done = shard_reads.read(part, prefix)
        k = math.ceil(2**21 / 3)
        np.testing.assert_array_equal(
            part.read_back["trainable/1"][: min(k, 2**21 - rank * k)],
            weights["trainable/1"][rank * k : (rank + 1) * k],
        )
        if done.read_bytes is not None:
            assert done.read_bytes <= read_first + 2 * shards.SUM_BYTES + done.wanted_bytes
    before = _read_bytes()
    tf.raw_ops.RestoreV2(prefix=shards.merged(prefix), tensor_names=["trainable/0"],
                         shape_and_slices=["64 0,32"], dtypes=[tf.float32])  # fmt: skip
    if before is not None:  # TensorFlow's reader: a buffer from each of 2 data files
        assert _read_bytes() - before > 2**20


def test_a_damaged_byte_fails_its_checksum_where_a_process_reads_it(tmp_path):
    """A flipped byte inside a slice a process reads fails the check of its run, as
    TensorFlow's own reader would fail its checksum (DataLossError); a process whose
    slices lie elsewhere reads its own."""
    weights = {"trainable/0": np.arange(4096, dtype="float32")}
    prefix = str(tmp_path / "ckpt-6")
    _save(weights, prefix, 2)
    data = sorted((tmp_path / "ckpt-6.shards").glob("merged.data-*"))
    assert len(data) == 2
    damaged = bytearray(data[1].read_bytes())
    damaged[100] ^= 0xFF  # in rank 1's slice: elements 2048 and on
    data[1].write_bytes(bytes(damaged))
    with pytest.raises(tf.errors.DataLossError, match="checksum .* does not match"):
        shard_reads.read(_Slices(weights, 1, 2), prefix)
    first = _Slices(weights, 0, 2)
    shard_reads.read(first, prefix)
    np.testing.assert_array_equal(first.read_back["trainable/0"], np.arange(2048))


class _Without(_Slices):
    """A rank whose part leaves out `key` (a write that lost it)."""

    def __init__(self, weights, rank, ranks, key):
        super().__init__(weights, rank, ranks)
        self.left_out = key

    def entries(self):
        return [e for e in super().entries() if e.key != self.left_out]


def test_a_slice_the_shards_lack_is_found_from_the_metadata_without_reading_a_tensor(tmp_path):
    weights = {"trainable/0": np.arange(8, dtype="float32"),
               "trainable/1": np.arange(6, dtype="float32")}  # fmt: skip
    prefix = str(tmp_path / "ckpt-5")
    for rank in range(2):
        part = _Without(weights, rank, 2, "trainable/1" if rank == 1 else None)
        shards.write(part, prefix, rank=rank, ranks=2,
                     barrier=lambda failed=False: failed, is_chief=rank == 1)  # fmt: skip
    assert (
        shards.incomplete(prefix) == "the slices saved of trainable/1 do not cover its 6 elements"
    )
    shard_reads.read(
        _Slices({"trainable/1": weights["trainable/1"]}, 0, 2), prefix
    )  # its half is there
    with pytest.raises(KeyError, match=r"hold no trainable/1 \[3, 6\)"):
        shard_reads.read(_Slices({"trainable/1": weights["trainable/1"]}, 1, 2), prefix)


def test_a_data_file_gone_or_cut_short_is_found_from_the_metadata(tmp_path):
    prefix = str(tmp_path / "ckpt-2")
    _save({"trainable/0": np.arange(64, dtype="float32")}, prefix, 2)
    first, second = sorted((tmp_path / "ckpt-2.shards").glob("merged.data-*"))
    size = second.stat().st_size
    second.write_bytes(second.read_bytes()[:-8])
    assert (
        shards.incomplete(prefix)
        == f"its data file {second.name} holds {size - 8} bytes, not {size}"
    )
    first.unlink()
    assert shards.incomplete(prefix) == f"its data file {first.name} is missing"
    (tmp_path / "ckpt-2.shards" / "merged.json").write_text("{")
    assert shards.incomplete(prefix).startswith(
        "ValueError: its metadata merged.json cannot be read"
    )


def test_the_planner_states_the_read_bucket_the_checkpoint_reads_with():
    from tfdist.plan import costs

    assert costs.READ_BUCKET_BYTES == shards.BUCKET_BYTES


class _Whole(shards.Shards):
    """A job that holds the model whole: reads `key` whole, in `shape`."""

    def __init__(self, key, shape):
        self.key, self.shape, self.read_back = key, shape, None

    def entries(self):
        return []

    def wanted(self):
        return [shards.Wanted(self.key, tf.float32, self._keep, shape=self.shape)]

    def _keep(self, value):
        self.read_back = value.numpy()


def test_a_resume_into_a_model_of_other_shapes_is_refused_naming_them(tmp_path):
    """Slices of a (4, 6) weight, read as slices of a (6, 4) one (the same 24 elements) or
    whole as (3, 8), or by a model whose weight has other elements: refused, each shape
    named, nothing assigned. Read as (4, 6) whole, the weight comes back."""
    weight = np.arange(24, dtype="float32").reshape(4, 6)
    prefix = str(tmp_path / "ckpt-3")
    _save({"trainable/0": weight}, prefix, 2)
    other = _Slices({"trainable/0": weight.reshape(6, 4)}, 0, 2)
    with pytest.raises(KeyError, match=r"other shapes: trainable/0 saved \(4, 6\), here \(6, 4\)"):
        shard_reads.read(other, prefix)
    assert other.read_back == {}
    for shape in [(3, 8), (5, 5)]:
        with pytest.raises(KeyError, match=rf"saved \(4, 6\), here \({shape[0]}, {shape[1]}\)"):
            shard_reads.read(_Whole("trainable/0", shape), prefix)
    whole = _Whole("trainable/0", (4, 6))
    shard_reads.read(whole, prefix)
    np.testing.assert_array_equal(whole.read_back, weight)
