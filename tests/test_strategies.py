"""build_strategy: 'auto' resolution, option checks, and a real training step on each strategy.

Every strategy that can run here trains the same tiny model from the same seed; synchronous
data parallelism must end with one_device's weights, so each check below can fail.
"""

from __future__ import annotations

import sys

import pytest
import tensorflow as tf

import tfdist
from tests.conftest import NUM_CPU_DEVICES, run_module
from tfdist.cluster import parse_tf_config
from tfdist.strategies import (
    StrategyError,
    check_tpu_node_paths,
    detect_tpu,
    resolve_auto,
    strategy_kind,
    task_name_in_tf_config,
    tpu_node_address,
)
from tfdist.strategies.parameter_server import PresentWorkersResolver
from tfdist.strategies.smoke import run_smoke_steps
from tools.smoke import parse_results

pytestmark = pytest.mark.fast

TOLERANCE = 1e-5
STEPS = 3

CLUSTERS = {
    "none": None,
    "one_worker": {"cluster": {"worker": ["w:1"]}},
    "two_workers": {"cluster": {"worker": ["w:1", "w:2"]}, "task": {"type": "worker", "index": 1}},
    "chief_and_worker": {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"]},
        "task": {"type": "chief", "index": 0},
    },
    "ps_cluster": {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"], "ps": ["p:1"]},
        "task": {"type": "chief", "index": 0},
    },
    "evaluator": {
        "cluster": {"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]},
        "task": {"type": "evaluator", "index": 0},
    },
}


@pytest.mark.parametrize(
    "cluster, tpu, gpus, expected",
    [
        ("none", None, 0, "one_device"),
        ("none", None, 1, "one_device"),
        ("none", None, 4, "mirrored"),
        ("none", "local", 4, "tpu"),
        ("one_worker", None, 0, "one_device"),
        ("one_worker", None, 2, "mirrored"),
        ("two_workers", None, 0, "multi_worker_mirrored"),
        ("two_workers", "local", 8, "multi_worker_mirrored"),
        ("chief_and_worker", None, 0, "multi_worker_mirrored"),
        ("ps_cluster", None, 0, "parameter_server"),
        ("ps_cluster", "local", 2, "parameter_server"),
        ("evaluator", None, 0, "one_device"),
    ],
)
def test_auto_resolution(cluster, tpu, gpus, expected):
    info = parse_tf_config(CLUSTERS[cluster]) if CLUSTERS[cluster] else None
    assert resolve_auto(info, tpu_address=tpu, num_gpus=gpus) == expected


def test_tpu_detection_from_environment(monkeypatch):
    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    assert detect_tpu() is None  # no TPU on this machine
    assert detect_tpu("my-tpu") == "my-tpu"
    monkeypatch.setenv("COLAB_TPU_ADDR", "10.0.0.2:8470")
    assert detect_tpu() == "grpc://10.0.0.2:8470"
    monkeypatch.setenv("TPU_NAME", "node-1")
    assert detect_tpu() == "node-1"


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("mirored", {}, r"Unknown strategy 'mirored'\. Valid names: auto, one_device, mirrored, "),
        (
            "mirrored",
            {"all_reduce": "ring_allreduce"},
            r"all_reduce must be one of ring, nccl, hierarchical_copy",
        ),
        (
            "mirrored",
            {"compression": "bfloat16"},
            r"compression='bfloat16' only applies to tfdist's ring all-reduce; add all_reduce='ring'",
        ),
        (
            "mirrored",
            {"all_reduce": "ring", "fusion_bytes": -1},
            r"fusion_bytes must be a whole number of bytes >= 0",
        ),
        (
            "mirrored",
            {"all_reduce": "ring", "compression": "int8"},
            r"compression must be one of float16, bfloat16 \(or None\)",
        ),
        ("mirrored", {"all_reduce": "nccl"}, r"all_reduce='nccl' needs GPUs but the devices are"),
        ("mirrored", {"devices": ("/cpu:0",), "num_gpus": 1}, r"devices and num_gpus both choose"),
        ("mirrored", {"num_gpus": 2}, r"2 GPUs were asked for but TensorFlow sees 0"),
        ("mirrored", {"collective": "ring"}, r"Option collective does not apply to the 'mirrored'"),
        (
            "one_device",
            {"all_reduce": "hierarchical_copy"},
            r"all_reduce does not apply to the 'one_device'",
        ),
        ("one_device", {"devices": ("/cpu:0", "/cpu:1")}, r"one_device runs on exactly one device"),
        # A device the process lacks: its collectives would wait forever, not fail.
        (
            "mirrored",
            {"devices": ("/cpu:0", "/cpu:9")},
            r"/cpu:9 is not a device of this process \(it has /cpu:0, .*configure_cpu_devices",
        ),
        ("parameter_server", {"tpu": "local"}, r"Option tpu does not apply"),
        (
            "mirrored",
            {"alreduce": "nccl"},
            r"Unknown strategy option 'alreduce'\. Valid options: devices",
        ),
        (
            "multi_worker_mirrored",
            {"collective_timeout": -1.0},
            r"collective_timeout must be a positive",
        ),
        (
            "multi_worker_mirrored",
            {},
            r"needs a cluster \(2\+ workers\) but TF_CONFIG is not set.*--workers 2",
        ),
        ("parameter_server", {}, r"needs a cluster .* --chief --workers 2 --ps 1"),
        ("tpu", {}, r"No TPU found.*Runtime > Change runtime type > TPU"),
    ],
)
def test_mistakes_are_explained(no_tf_config, monkeypatch, name, kwargs, message):
    monkeypatch.delenv("TPU_NAME", raising=False)
    monkeypatch.delenv("COLAB_TPU_ADDR", raising=False)
    with pytest.raises(StrategyError, match=message):
        tfdist.build_strategy(name, **kwargs)


@pytest.mark.parametrize(
    "name, cluster, message",
    [
        (
            "parameter_server",
            "two_workers",
            r"^The cluster in .* does not fit: 'parameter_server' needs a chief, workers and ps "
            r"tasks: use e.g. `tfdist-launch --chief --workers 2 --ps 1 .*Received: .*2 workers$",
        ),
        (
            "multi_worker_mirrored",
            "ps_cluster",
            r"has 1 ps task\(s\), which 'multi_worker_mirrored' does not use: use 'parameter_server'",
        ),
        ("multi_worker_mirrored", "evaluator", r"This task is the evaluator"),
    ],
)
def test_cluster_mismatches_are_explained(name, cluster, message):
    with pytest.raises(StrategyError, match=message):
        tfdist.build_strategy(name, cluster=parse_tf_config(CLUSTERS[cluster]))


def test_only_the_chief_builds_parameter_server():
    worker = parse_tf_config({**CLUSTERS["ps_cluster"], "task": {"type": "worker", "index": 0}})
    with pytest.raises(StrategyError, match=r"only the chief builds.*tfdist.serve_if_needed\(\)"):
        tfdist.build_strategy("parameter_server", cluster=worker)


@pytest.mark.parametrize(
    "key, workers, present, names",
    [
        ("cluster", ["w0:1", "w1:1", "w2:1"], [0, 2], {"worker:1": "worker:2"}),
        # Kubeflow's dynamic workers: TF_CONFIG lists only some indices
        ("sparseCluster", {"1": "w1:1", "2": "w2:1", "4": "w4:1"}, [1, 4],
         {"worker:0": "worker:1", "worker:1": "worker:4"}),
    ],
    ids=["cluster", "sparse"],
)  # fmt: skip
def test_a_parameter_server_chief_trains_on_the_workers_present_under_new_indices(
    key, workers, present, names
):
    chief = parse_tf_config(
        {
            key: {"chief": ["c:1"], "worker": workers, "ps": ["p:1"]},
            "task": {"type": "chief", "index": 0},
        }
    )
    resolver = PresentWorkersResolver(chief, present=present)  # the others never started
    assert resolver.cluster_spec().as_dict() == {
        "chief": ["c:1"],
        "worker": [f"w{i}:1" for i in present],
        "ps": ["p:1"],
    }
    assert (resolver.task_type, resolver.task_id) == ("chief", 0)
    assert {k: v for k, v in resolver.tf_config_names.items() if k != v} == names


def test_task_names_are_unchanged_for_a_strategy_that_renumbered_no_workers():
    strategy = tfdist.build_strategy("one_device", cluster=None)
    assert task_name_in_tf_config(strategy, "worker:1") == "worker:1"


def test_tpu_without_tpu_kernels_is_explained():
    # 'local' reaches TensorFlow's TPU initialisation, which this CPU-only build cannot run.
    with pytest.raises(StrategyError, match=r"No TPU is attached at 'local'.*tensorflow-tpu"):
        tfdist.build_strategy("tpu", cluster=None, tpu="local")


def test_tpu_name_that_cannot_be_looked_up_is_explained(monkeypatch):
    # A TPU name is resolved through Google Cloud's metadata server; '.invalid' never resolves
    # (RFC 6761), so the look-up fails here as it does anywhere off Google Cloud.
    monkeypatch.setenv("GCE_METADATA_HOST", "metadata.invalid")
    with pytest.raises(StrategyError, match=r"Could not find the TPU 'my-tpu' \(.*grpc://host"):
        tfdist.build_strategy("tpu", cluster=None, tpu="my-tpu")


def test_tpu_node_address_is_none_off_tpu_and_for_a_tpu_vm():
    assert tpu_node_address(tfdist.build_strategy("one_device", cluster=None)) is None
    local = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="local")
    assert tpu_node_address(local) is None
    node = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="grpc://10.0.0.2:8470")
    assert tpu_node_address(node) == "grpc://10.0.0.2:8470"


@pytest.mark.parametrize(
    "address, paths",
    [
        (None, {"model_dir": "/tmp/run", "data_dir": None}),
        ("local", {"model_dir": "/tmp/run", "data_dir": "/content/data"}),
        ("grpc://10.0.0.2:8470", {"model_dir": "gs://b/run", "data_dir": "gs://b/data"}),
        ("grpc://10.0.0.2:8470", {}),
    ],
)
def test_tpu_node_paths_that_are_fine(address, paths):
    check_tpu_node_paths(address, paths)  # raises nothing


@pytest.mark.parametrize(
    "paths, message",
    [
        (
            {"model_dir": "/tmp/run", "data_dir": "gs://b/data"},
            r"so model_dir must be gs:// URLs.*Received: model_dir='/tmp/run'$",
        ),
        (
            {"model_dir": "gs://b/run", "data_dir": None},
            r"so data_dir must be.*Received: data_dir=None \(a default on the local disk\)$",
        ),
        (
            {"model_dir": "runs/x", "data_dir": "/content/data"},
            r"model_dir and data_dir must be.*or use a TPU VM.*"
            r"Received: model_dir='runs/x', data_dir='/content/data'$",
        ),
    ],
)
def test_local_paths_on_a_tpu_node_are_explained(paths, message):
    with pytest.raises(StrategyError, match=r"'grpc://10\.0\.0\.2:8470' is a TPU Node") as info:
        check_tpu_node_paths("grpc://10.0.0.2:8470", paths)
    assert info.match(message)


@pytest.fixture(scope="module")
def reference():
    """The one-device result every synchronous strategy must reproduce."""
    strategy = tfdist.build_strategy("one_device", cluster=None)
    return run_smoke_steps(strategy, steps=STEPS)


@pytest.mark.slow  # trains a model under each strategy, in this process
@pytest.mark.parametrize(
    "name, kwargs, replicas",
    [
        ("default", {}, 1),
        ("auto", {}, 1),
        ("mirrored", {"devices": ("/cpu:0", "/cpu:1")}, 2),
        ("mirrored", {}, NUM_CPU_DEVICES),
        ("mirrored", {"all_reduce": "hierarchical_copy", "devices": ("/cpu:0", "/cpu:1")}, 2),
        ("mirrored", {"all_reduce": "reduction_to_one_device"}, NUM_CPU_DEVICES),
        ("mirrored", {"all_reduce": "ring"}, NUM_CPU_DEVICES),
        ("mirrored", {"all_reduce": "ring", "fusion_bytes": 0, "devices": ("/cpu:0", "/cpu:1")}, 2),
        ("central_storage", {"devices": ("/cpu:0", "/cpu:1")}, 2),
    ],
)
def test_in_process_strategies_match_one_device(reference, name, kwargs, replicas):
    strategy = tfdist.build_strategy(name, cluster=None, **kwargs)
    result = run_smoke_steps(strategy, steps=STEPS)
    assert strategy.num_replicas_in_sync == replicas
    assert result.max_abs_diff(reference) <= TOLERANCE
    assert result.losses == pytest.approx(reference.losses, abs=TOLERANCE)


def test_strategy_kind_names():
    assert (
        strategy_kind(tfdist.build_strategy("central_storage", cluster=None)) == "central_storage"
    )
    assert strategy_kind(tf.distribute.get_strategy()) == "default"


def test_indivisible_global_batch_is_rejected():
    strategy = tfdist.build_strategy("mirrored", cluster=None)
    with pytest.raises(ValueError, match=r"divisible by the 4 replicas.*global_batch_size=10"):
        run_smoke_steps(strategy, global_batch_size=10)


@pytest.mark.multiprocess
def test_multi_worker_mirrored_with_two_processes(reference):
    result = run_module(
        "tools.launch", "--workers", "2", "--timeout", "240", "--",
        sys.executable, "-m", "experiments.smoke", "--strategy=multi_worker_mirrored",
        f"--steps={STEPS}", "--collective_timeout=120",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    results = parse_results(result.stdout)
    assert set(results) == {"worker:0", "worker:1"}
    for task in results.values():
        assert task["strategy"] == "multi_worker_mirrored" and task["replicas"] == 2
        assert (
            max(abs(a - b) for a, b in zip(task["weights"], reference.weights, strict=True))
            <= TOLERANCE
        )
    assert results["worker:0"]["weights"] == results["worker:1"]["weights"]


@pytest.mark.multiprocess
def test_parameter_server_with_chief_two_workers_and_a_ps(reference):
    # 'auto' must see the ps task in TF_CONFIG and pick parameter_server on the chief, while
    # the workers and the ps serve until the launcher stops them.
    result = run_module(
        "tools.launch", "--chief", "--workers", "2", "--ps", "1", "--timeout", "240", "--",
        sys.executable, "-m", "experiments.smoke", "--strategy=auto", f"--steps={STEPS}",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    results = parse_results(result.stdout)
    assert set(results) == {"chief:0"}
    chief = results["chief:0"]
    assert chief["strategy"] == "parameter_server"
    assert (
        max(abs(a - b) for a, b in zip(chief["weights"], reference.weights, strict=True))
        <= TOLERANCE
    )
    assert "[worker:1]" in result.stdout and "Serving as worker:1" in result.stdout
