"""Each private TensorFlow entry point in tfdist.compat still does what tfdist relies on.

When a TensorFlow or Keras upgrade renames or changes one, the test named after it fails here,
instead of a distant symptom in a training test.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import tensorflow as tf

from tfdist import compat
from tfdist.collective import RingAllReduce

pytestmark = pytest.mark.fast

CPUS = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]  # tests/conftest.py makes four
# Key ranges far above those tfdist.build_strategy hands out (from 0 up, 100,000 apart), so
# these strategies never share a collective group with another test's.
_KEY_BASES = itertools.count(2_000_000_000, 100_000)


def _mirrored(devices):
    return compat.mirrored_strategy(
        devices, cross_device_ops=None, collective_key_base=next(_KEY_BASES)
    )


def _all_reduce_ones(strategy: tf.distribute.Strategy) -> list[float]:
    @tf.function
    def step():
        return strategy.run(
            lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))
        )

    return [float(t) for t in strategy.experimental_local_results(step())]


def test_mirrored_strategies_get_their_own_collective_keys_and_leave_the_class_alone():
    before = tf.distribute.MirroredStrategy._collective_key_base
    # Two device counts with overlapping key ranges fail with "joining a group with size 4,
    # but that group has size 2"; apart they both reduce.
    four, two = _mirrored(CPUS), _mirrored(CPUS[:2])
    assert _all_reduce_ones(four) == [4.0] * 4
    assert _all_reduce_ones(two) == [2.0] * 2
    assert tf.distribute.MirroredStrategy._collective_key_base == before
    assert isinstance(two, tf.distribute.MirroredStrategy)
    assert type(two).__name__ == "MirroredStrategy"  # messages naming the type read the same


def test_replaced_cross_device_ops_carry_the_reductions():
    strategy = _mirrored(CPUS[:2])
    replaced, ring = [], RingAllReduce(bucket_bytes=0)

    def build(current):
        replaced.append(current)
        return ring

    compat.replace_cross_device_ops(strategy, build)
    assert isinstance(replaced[0], tf.distribute.CrossDeviceOps)  # TensorFlow's, handed over
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant([1.0, 2.0]) * (context.replica_id_in_sync_group + 1)
    )
    (total,) = strategy.extended.batch_reduce_to("sum", [(value, value)])
    assert ring.rings_built == 1  # the ring ran the sum
    for local in strategy.experimental_local_results(total):
        np.testing.assert_allclose(local.numpy(), [3.0, 6.0])


def test_intercepted_variable_creation_sees_every_variable_of_that_strategy_only():
    strategy = _mirrored(CPUS[:2])
    other = _mirrored(CPUS[:2])
    seen = []

    def wrap(create):
        def creator(next_creator, **kwargs):
            seen.append(kwargs.get("name"))
            return create(next_creator, **kwargs)

        return creator

    compat.intercept_variable_creation(strategy, wrap)
    with strategy.scope():
        variable = tf.Variable([1.0, 2.0], name="mine")
    with other.scope():
        tf.Variable([3.0], name="not_mine")
    assert seen == ["mine"]
    assert isinstance(variable, tf.distribute.DistributedValues)


def test_cross_device_ops_hooks_keep_tensorflows_private_names():
    # TensorFlow reads these two names on every CrossDeviceOps; compat.CrossDeviceOps maps
    # them to public ones, which is only right while TensorFlow's base class has them.
    for name in ("_num_between_graph_workers", "_gather_implementation", "_gather"):
        assert hasattr(tf.distribute.CrossDeviceOps, name), name

    class TwoProcesses(compat.CrossDeviceOps):
        num_between_graph_workers = 2

    assert TwoProcesses()._num_between_graph_workers == 2
    with pytest.raises(NotImplementedError, match="TwoProcesses does not gather"):
        TwoProcesses()._gather_implementation(None, None, 0, None)


def test_gather_and_mirrored_value():
    strategy = _mirrored(CPUS[:2])
    value = strategy.experimental_distribute_values_from_function(
        lambda context: tf.fill([1, 2], float(context.replica_id_in_sync_group))
    )
    gathered = compat.gather(tf.distribute.ReductionToOneDevice(), value, "/cpu:0", axis=0)
    np.testing.assert_array_equal(gathered.numpy(), [[0.0, 0.0], [1.0, 1.0]])

    tensors = []
    for device in CPUS[:2]:
        with tf.device(device):
            tensors.append(tf.constant(5.0))
    mirrored = compat.mirrored_value(tensors)
    assert isinstance(mirrored, tf.distribute.DistributedValues)
    assert [v.device for v in mirrored.values] == [t.device for t in tensors]


def test_the_coordination_service_state_can_be_read():
    assert compat.coordination_service_configured() in (True, False)


def test_a_trackable_of_tfdists_own_is_checkpointed_as_a_variable_is(tmp_path):
    class Doubled(compat.Trackable):  # saved as twice the variable's value, as ps_shards does
        def __init__(self, variable):
            self.variable = variable

        def _serialize_to_tensors(self):
            return {"VARIABLE_VALUE": self.variable * 2.0}

        def _restore_from_tensors(self, restored_tensors):
            self.variable.assign(restored_tensors["VARIABLE_VALUE"] / 2.0)
            return tf.no_op()

    saved = tf.Variable(3.0)
    path = tf.train.Checkpoint(item=Doubled(saved)).write(str(tmp_path / "ckpt"))
    assert tf.train.load_checkpoint(path).get_tensor("item/.ATTRIBUTES/VARIABLE_VALUE") == 6.0
    restored = tf.Variable(0.0)
    tf.train.Checkpoint(item=Doubled(restored)).read(path).assert_consumed()
    assert float(restored.numpy()) == 3.0


def test_keras_take_can_be_replaced_for_a_block_and_comes_back():
    import keras

    table = np.arange(6.0, dtype="float32").reshape(3, 2)
    original = compat.keras_take()
    with compat.keras_take_replaced(lambda x, indices, axis=None: tf.zeros([7])):
        assert keras.ops.take(table, [0], axis=0).shape == (7,)  # Embedding's path went here
    assert compat.keras_take() is original
    np.testing.assert_array_equal(keras.ops.take(table, [2], axis=0), [[4.0, 5.0]])
