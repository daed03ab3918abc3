"""Logical CPU devices: created once, before TensorFlow initialises its runtime."""

import sys

import pytest

from tests.conftest import NUM_CPU_DEVICES, run_python
from tfdist.devices import DeviceConfigurationError, configure_cpu_devices, cpu_device_names


def test_session_has_the_logical_cpus():
    assert len(cpu_device_names()) == NUM_CPU_DEVICES


def test_same_count_again_is_a_no_op():
    assert configure_cpu_devices(NUM_CPU_DEVICES) == cpu_device_names()


def test_changing_the_split_after_start_up_is_explained():
    cpu_device_names()  # make sure the runtime is initialised
    with pytest.raises(
        DeviceConfigurationError, match=r"already initialised its devices \(4 logical"
    ):
        configure_cpu_devices(2)


@pytest.mark.parametrize("count", [0, -1, 1.5, True, "2"])
def test_count_must_be_a_positive_integer(count):
    with pytest.raises(ValueError, match=r"count must be a positive integer"):
        configure_cpu_devices(count)


def test_importing_tfdist_leaves_the_runtime_uninitialised():
    # A module-level tensor anywhere in tfdist would initialise TensorFlow's runtime at import
    # time, after which neither logical devices nor multi_worker_mirrored can be set up.
    code = (
        "import tfdist, tfdist.data, tfdist.training, tfdist.strategies, tfdist.roles;"
        "print(len(tfdist.configure_cpu_devices(3)))"
    )
    result = run_python([sys.executable, "-c", code], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "3"
