"""Each parameter-server worker streams the data in an order of its own (tfdist/data/streams.py).

Every worker streams its own copy of the data. Shuffled alike, the workers would apply the
same batch one after another: the ids drawn by closures that any of 3 workers ran must
replay as the interleaving of the orders seed + 0, seed + 1, ... (one per worker), each
taken in order from its start.
"""

from __future__ import annotations

import json
import sys

import pytest
import tensorflow as tf

import tfdist
from tests.conftest import run_module

WORKERS = 3


def replay(ids: list[int], orders: list[list[int]]) -> list[int]:
    """How many ids each order supplied, reading `ids` as an interleaving of their starts."""
    taken = [0] * len(orders)
    for i in ids:
        streams = [n for n, order in enumerate(orders) if order[taken[n]] == i]
        assert streams, f"id {i} is next in no worker's order (taken so far: {taken})"
        taken[streams[0]] += 1
    return taken


@pytest.mark.multiprocess
def test_each_worker_streams_its_own_order(tmp_path):
    result = run_module(
        "tools.launch", "--chief", "--workers", str(WORKERS), "--ps", "2", "--timeout", "280",
        "--", sys.executable, "-m", "tests.workers.streams_worker", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    for form in ("arrays", "arrays_class_weight", "dataset_fn"):
        record = json.loads((tmp_path / f"{form}.json").read_text())
        orders = record["orders"]
        assert len({tuple(order) for order in orders}) == WORKERS, form  # the seeds differ
        taken = replay(record["ids"], orders)
        assert sum(taken) == len(record["ids"])
        # The closures went to more than one worker, each reading its own order.
        assert sum(1 for n in taken if n) >= 2, (form, taken)


def test_replay_refuses_workers_that_read_the_same_order():
    order = list(range(10))
    with pytest.raises(AssertionError, match="next in no worker's order"):
        replay([0, 0, 1, 1], [order, list(reversed(order))])


def test_outside_a_parameter_server_dataset_it_is_the_plain_shuffle():
    ids = tf.data.Dataset.range(50)
    plain = list(ids.shuffle(50, seed=3).as_numpy_iterator())
    assert list(tfdist.data.worker_shuffle(ids, 50, 3).as_numpy_iterator()) == plain
    assert plain != list(range(50))

    @tf.function
    def traced():  # traced, but not for a per-worker dataset
        return tfdist.data.worker_shuffle(ids, 50, 3).batch(50).get_single_element()

    assert list(traced().numpy()) == plain
