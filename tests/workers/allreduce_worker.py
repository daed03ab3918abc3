"""Runs on every worker of a launched job: tfdist's ring (and the naive gather-broadcast)
against TensorFlow's all-reduce.

Prints one line "ALLREDUCE_RESULT {json}" per case: the largest difference between the
results (0 for integers means bit-exact). Then "FUSED_RESULT {json}" lines for a list of
mixed tensors all-reduced with fusion on and off, with and without compression, called
eagerly and from a tf.function (a training step: there the rings run concurrently). With --mismatch, rank 0
passes a longer tensor than the others, and the line reports the error each rank got instead.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402
from tfdist.collective import CollectiveMismatchError, GatherBroadcast, ProcessRing  # noqa: E402

DTYPES = (
    sys.argv[1].split(",")
    if len(sys.argv) > 1 and not sys.argv[1].startswith("--")
    else ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
)


def max_abs_diff(a, b) -> float:
    """Largest |a - b| in float64; 0 for empty tensors."""
    if a.shape.num_elements() == 0:
        return 0.0
    return float(tf.reduce_max(tf.abs(tf.cast(a, tf.float64) - tf.cast(b, tf.float64))))


def main() -> None:
    cluster = tfdist.parse_tf_config()
    # No collective timeouts: TensorFlow keeps a thread asleep for the timeout after every
    # collective op given one, and these cases run thousands of ops in seconds.
    strategy = tfdist.build_strategy("multi_worker_mirrored", cluster=cluster)
    rank, ranks = cluster.task_index, cluster.num_workers
    # Tiny pieces, so even these short tensors go through several concurrent rings.
    ring = ProcessRing(rank=rank, ranks=ranks, min_piece_bytes=16)
    naive = GatherBroadcast(rank=rank, ranks=ranks)
    if "--mismatch" in sys.argv:
        try:
            ring.all_reduce(tf.ones([12 if rank == 0 else 11]))
            outcome = "no error"
        except CollectiveMismatchError as e:
            outcome = str(e)
        except tf.errors.OpError as e:  # the peer that explained it has gone
            outcome = f"{type(e).__name__}: {e.message[:200]}"
        print("ALLREDUCE_RESULT " + json.dumps({"rank": rank, "error": outcome}), flush=True)
        return
    rng = np.random.default_rng(rank)
    lengths = [0, 1, ranks - 1, ranks + 1, 1001, 3 * ranks]
    for dtype in DTYPES:
        for length in lengths:
            for reduction in ("sum", "mean"):
                values = (
                    rng.integers(-1000, 1000, size=length)
                    if "int" in dtype
                    else rng.normal(size=length) * 10
                )
                tensor = tf.cast(tf.constant(values), dtype)
                ours = ring.all_reduce(tensor, reduction)
                gathered = naive.all_reduce(tensor, reduction)
                op = (
                    tf.distribute.ReduceOp.SUM
                    if reduction == "sum"
                    else tf.distribute.ReduceOp.MEAN
                )
                # TensorFlow's all-reduce takes no bfloat16: its reference runs in float32.
                reference = tf.cast(tensor, tf.float32) if dtype == "bfloat16" else tensor
                if length:
                    theirs = strategy.reduce(
                        op,
                        strategy.experimental_distribute_values_from_function(
                            lambda _, value=reference: value
                        ),
                        axis=None,
                    )
                    theirs = tf.cast(theirs, tensor.dtype)
                else:  # TensorFlow 2.21's all-reduce of an empty float64 tensor crashes the process
                    theirs = tensor
                diff, naive_diff = max_abs_diff(ours, theirs), max_abs_diff(gathered, theirs)
                scale = max_abs_diff(theirs, tf.zeros_like(theirs))
                case = {"rank": rank, "dtype": dtype, "length": length, "reduction": reduction, "diff": diff, "scale": scale,
                        "naive_diff": naive_diff,
                        "shape_ok": ours.shape == tensor.shape and ours.dtype == tensor.dtype
                        and gathered.shape == tensor.shape and gathered.dtype == tensor.dtype}  # fmt: skip
                print("ALLREDUCE_RESULT " + json.dumps(case), flush=True)
    fused_cases(strategy, ring, rank)


def fused_cases(strategy, ring, rank):
    """A model's worth of mixed tensors through fusion, against one built-in all-reduce each."""
    rng = np.random.default_rng(100 + rank)
    # Shapes that repeat, as a model's do: unfused, their rings run at once in a traced step.
    shapes = [(3, 3, 1, 8), (8,), (), (0,), (17, 5), (5,), (4, 4), (8,), (17, 5)]
    tensors = [tf.constant(rng.normal(size=s), tf.float32) for s in shapes]
    tensors.insert(2, tf.constant(rng.integers(-50, 50, size=(6,)), tf.int64))

    def builtin(t):
        if t.shape.num_elements() == 0:
            return t
        return strategy.reduce(
            tf.distribute.ReduceOp.SUM,
            strategy.experimental_distribute_values_from_function(lambda _: t),
            axis=None,
        )

    expected = [builtin(t) for t in tensors]
    for traced in (False, True):
        for bucket_bytes in (0, 64, 1 << 20):
            for compression in (None, "float16", "bfloat16"):

                def reduce(values, bucket_bytes=bucket_bytes, compression=compression):
                    return ring.all_reduce_many(
                        values, bucket_bytes=bucket_bytes, compression=compression
                    )

                got = (tf.function(reduce) if traced else reduce)(tensors)
                case = {"rank": rank, "traced": traced, "bucket_bytes": bucket_bytes,
                        "compression": compression, **compare(got, tensors, expected)}  # fmt: skip
                print("FUSED_RESULT " + json.dumps(case), flush=True)


def compare(got, tensors, expected) -> dict:
    return {
        "same_layout": [(g.dtype.name, g.shape.as_list()) for g in got]
        == [(t.dtype.name, t.shape.as_list()) for t in tensors],
        "diffs": [max_abs_diff(g, e) for g, e in zip(got, expected, strict=True)],
        "scales": [max_abs_diff(e, tf.zeros_like(e)) for e in expected],
        "dtypes": [t.dtype.name for t in tensors],
    }  # fmt: skip


if __name__ == "__main__":
    main()
