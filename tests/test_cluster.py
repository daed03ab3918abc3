"""TF_CONFIG parsing: the shapes real launchers write, and every mistake they can make."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import run_module
from tfdist.cluster import ClusterInfo, TFConfigError, parse_tf_config

pytestmark = pytest.mark.fast

W2 = {"worker": ["host0:2222", "host1:2222"]}


def config(cluster, task_type=None, index=0, **extra):
    value = {"cluster": cluster, **extra}
    if task_type is not None:
        value["task"] = {"type": task_type, "index": index}
    return value


@pytest.mark.parametrize("raw", ["", "   ", "{}", {}, {"task": {"type": "worker", "index": 0}}])
def test_no_cluster_means_single_host(raw):
    assert parse_tf_config(raw) is None


def test_unset_environment_variable_means_single_host(no_tf_config):
    assert parse_tf_config() is None


def test_reads_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(config(W2, "worker", 1)))
    info = parse_tf_config()
    assert (info.task_type, info.task_index, info.address) == ("worker", 1, "host1:2222")
    assert info.source == "the TF_CONFIG environment variable"


def test_multi_worker_fields():
    info = parse_tf_config(json.dumps(config(W2, "worker", 0)))
    assert info.cluster == {"worker": ("host0:2222", "host1:2222")}
    assert (info.num_workers, info.num_ps, info.has_chief, info.has_evaluator) == (
        2,
        0,
        False,
        False,
    )
    assert info.is_chief and info.rpc_layer == "grpc"
    assert info.cluster_strategy == "multi_worker_mirrored"
    assert info.describe() == "worker:0 at host0:2222 in a cluster of 2 workers (chief)"


def test_cluster_info_is_frozen():
    info = parse_tf_config(config(W2, "worker", 0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.task_index = 1
    with pytest.raises(TypeError):
        info.cluster["ps"] = ("x:1",)


def test_kubeflow_tfjob_with_legacy_master():
    info = parse_tf_config(
        {
            "cluster": {
                "master": ["job-master-0.ns.svc:2222"],
                "worker": ["job-worker-0.ns.svc:2222"],
                "ps": ["job-ps-0.ns.svc:2222"],
            },
            "task": {"type": "master", "index": 0},
            "environment": "cloud",
        }
    )
    assert info.task_type == "chief" and info.is_chief
    assert list(info.cluster) == ["chief", "worker", "ps"]
    assert info.environment == "cloud"
    assert info.cluster_strategy == "parameter_server"
    assert (info.num_workers, info.num_ps) == (2, 1)


def test_vertex_ai_job_and_trial_keys_are_accepted():
    info = parse_tf_config(
        config(
            {"chief": ["cmle-training-master-0:2222"], "worker": ["cmle-training-worker-0:2222"]},
            "worker",
            0,
            job={"python_module": "trainer.task", "args": []},
            trial="1",
            environment="cloud",
        )
    )
    assert info.num_workers == 2 and not info.is_chief  # there is a chief, so worker 0 is not it


def test_sagemaker_parameter_server_shape():
    info = parse_tf_config(
        config(
            {
                "master": ["algo-1:2222"],
                "ps": ["algo-1:2223", "algo-2:2223"],
                "worker": ["algo-2:2222"],
            },
            "ps",
            1,
        )
    )
    assert (info.task_type, info.address, info.num_ps) == ("ps", "algo-2:2223", 2)


def test_kubeflow_sparse_cluster_for_dynamic_workers():
    info = parse_tf_config(
        {
            "sparseCluster": {"ps": ["ps-0:2222"], "worker": {"3": "worker-3:2222"}},
            "task": {"type": "worker", "index": 3},
        }
    )
    assert info.sparse and info.address == "worker-3:2222"
    assert info.training_cluster() == {"ps": ["ps-0:2222"], "worker": {3: "worker-3:2222"}}


def test_evaluator_is_kept_out_of_the_training_cluster():
    info = parse_tf_config(
        config({"chief": ["c:1"], "worker": ["w:1"], "evaluator": ["e:1"]}, "evaluator", 0)
    )
    assert info.is_evaluator and info.has_evaluator and not info.is_chief
    assert info.training_cluster() == {"chief": ["c:1"], "worker": ["w:1"]}


def test_evaluator_may_stay_outside_the_cluster():
    info = parse_tf_config(config(W2, "evaluator", 0))
    assert info.is_evaluator and info.address is None and info.has_evaluator


@pytest.mark.parametrize(
    "cluster, task, is_chief",
    [
        ({"chief": ["c:1"], "worker": ["w:1"]}, ("chief", 0), True),
        ({"chief": ["c:1"], "worker": ["w:1"]}, ("worker", 0), False),
        (W2, ("worker", 0), True),
        (W2, ("worker", 1), False),
        ({"worker": ["w:1"], "ps": ["p:1"]}, ("ps", 0), False),
        ({"worker": ["w:1"], "evaluator": ["e:1"]}, ("evaluator", 0), False),
    ],
)
def test_chief_rule(cluster, task, is_chief):
    assert parse_tf_config(config(cluster, *task)).is_chief is is_chief


def test_single_task_needs_no_task_section():
    info = parse_tf_config({"cluster": {"worker": ["only:2222"]}})
    assert (info.task_type, info.task_index, info.is_chief) == ("worker", 0, True)


@pytest.mark.parametrize(
    "address, normalised",
    [
        ("[::1]:2222", "[::1]:2222"),
        (" Host-A.Example.COM:80 ", "host-a.example.com:80"),
        ("10.0.0.1:65535", "10.0.0.1:65535"),
        ("[2001:db8::5]:1", "[2001:db8::5]:1"),
    ],
)
def test_valid_addresses_are_normalised(address, normalised):
    assert parse_tf_config({"cluster": {"worker": [address]}}).address == normalised


BAD = [
    ('{"cluster": {"worker": ["a:1"]', r"not valid JSON \(.* at line 1, column \d+"),
    ("[1, 2]", r"the JSON is a list, not an object"),
    ('"worker"', r"the JSON is a str, not an object"),
    ({"cluster": ["a:1"]}, r"'cluster' is not a mapping of task type to a list of addresses"),
    ({"cluster": {"worker": "a:1"}}, r"single string, not a list.*Wrap it in a list"),
    ({"cluster": {"worker": {"a": 1}}}, r"is not a list of addresses"),
    (config({"wroker": ["a:1"]}, "worker"), r"unknown task type 'wroker'.*did you mean 'worker'"),
    (config(W2, "wrker"), r"unknown task type 'wrker' in 'task'.*did you mean 'worker'"),
    ({"clustr": W2}, r"unknown top-level key 'clustr'.*did you mean 'cluster'"),
    ({"cluster": W2}, r"the cluster lists 2 tasks but there is no 'task' section"),
    ({"cluster": W2, "task": {"index": 0}}, r"'task' has no 'type'"),
    ({"cluster": W2, "task": {"type": "worker"}}, r"'task' has no 'index'"),
    ({"cluster": W2, "task": "worker"}, r"'task' is not an object"),
    (config(W2, "ps"), r"this task is a 'ps' but the cluster has no 'ps' tasks"),
    (config(W2, "worker", -1), r"'task' 'index' is negative"),
    (
        config(W2, "worker", 2),
        r"task index 2 is out of range for 2 'worker' task\(s\)\. Valid indices are 0 to 1",
    ),
    (config(W2, "worker", 1.5), r"'task' 'index' is not an integer"),
    (config(W2, "worker", True), r"'task' 'index' is not an integer"),
    (config(W2, "worker", "1"), r"'task' 'index' is a string, not an integer"),
    (config({"chief": ["a:1", "b:1"]}, "chief"), r"2 chief tasks are listed"),
    (
        config({"chief": ["a:1"], "master": ["b:1"]}, "chief"),
        r"both 'master' and 'chief' are listed",
    ),
    (config({"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}, "worker"), r"2 evaluator tasks"),
    (
        config({"worker": ["a:1", "a:1"]}, "worker"),
        r"worker:0 and worker:1 both use the address a:1",
    ),
    (config({"worker": ["a:1"], "ps": ["a:1"]}, "worker"), r"worker:0 and ps:0 both use"),
    (config({"worker": ["a"]}, "worker"), r"'a' of worker:0 has no host or no port"),
    (config({"worker": [":2222"]}, "worker"), r"has no host or no port"),
    (
        config({"worker": ["grpc://a:1"]}, "worker"),
        r"looks like an IPv6 address without brackets|no host or no port",
    ),
    (
        config({"worker": ["a:0"]}, "worker"),
        r"port of worker:0 in 'a:0' is not a number from 1 to 65535",
    ),
    (config({"worker": ["a:65536"]}, "worker"), r"not a number from 1 to 65535"),
    (config({"worker": ["a:http"]}, "worker"), r"not a number from 1 to 65535"),
    (config({"worker": ["::1:2222"]}, "worker"), r"IPv6 address without brackets"),
    (config({"worker": [7]}, "worker"), r"the address of worker:0 is not a 'host:port' string"),
    ({"cluster": {"worker": []}}, r"'cluster' lists no tasks"),
    ({"cluster": W2, "sparseCluster": W2}, r"both 'cluster' and 'sparseCluster' are set"),
]


@pytest.mark.parametrize("raw, message", BAD)
def test_bad_tf_config_is_explained(raw, message):
    with pytest.raises(TFConfigError, match=message) as excinfo:
        parse_tf_config(raw)
    assert str(excinfo.value).startswith("Invalid TF_CONFIG (from the TF_CONFIG value passed")
    assert isinstance(excinfo.value, ValueError)


def test_error_names_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(
        TFConfigError, match=r"^Invalid TF_CONFIG \(from the TF_CONFIG environment variable\)"
    ):
        parse_tf_config()


def test_constructed_info_round_trips_through_training_cluster():
    info = ClusterInfo(
        task_type="worker", task_index=0, cluster={"worker": ("a:1",), "ps": ("b:1",)}
    )
    assert info.training_cluster() == {"worker": ["a:1"], "ps": ["b:1"]}


def test_checker_prints_the_role():
    tf_config = config({"chief": ["c:2222"], "worker": ["w:2222"], "ps": ["p:2222"]}, "ps", 0)
    result = run_module("tools.tf_config", env={"TF_CONFIG": json.dumps(tf_config)})
    assert result.returncode == 0, result.stderr
    assert "ps:0 at p:2222" in result.stdout
    assert "serves" in result.stdout and "parameter_server" in result.stdout


def test_checker_fails_with_one_clear_line():
    result = run_module("tools.tf_config", "--tf_config", '{"cluster": {"worker": ["a:1", "b:2"]}}')
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: Invalid TF_CONFIG (from the --tf_config flag): the "
        "cluster lists 2 tasks but there is no 'task' section. Each process must say which task "
        'it is, e.g. "task": {"type": "worker", "index": 0}; launchers such as tfdist-launch or a '
        "TFJob set it per process."
    ]
