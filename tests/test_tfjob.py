"""Tests for `tfdist-k8s tfjob` (tfdist/k8s/tfjob.py, tfjob_operator.py) and its old name, the
tools/tfjob.py shim: TFJob manifests, the TF_CONFIG the training-operator gives each pod, and the
role tfdist then picks in that pod.

Every layout goes the whole way: CLI -> manifest text -> decoded manifest -> each pod's TF_CONFIG
-> tfdist.parse_tf_config -> the strategy 'auto' resolves to (or serving, for the worker and ps
servers of parameter-server training). Most tests run the old command line (`python -m
tools.tfjob ... -- TRAIN_FLAGS`), which must keep writing the same manifests. The NetworkPolicy
written beside the TFJob, and each pod's securityContext, resources and volumes, are checked
against the Kubernetes API's published definitions (tests/fixtures/k8s_openapi.yaml, through
tests/test_k8s.py's helpers). Nothing here starts TensorFlow.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.test_k8s import LOCKED_DOWN, network_policy_errors, pod_spec_errors, selects
from tfdist.cluster import parse_tf_config
from tfdist.k8s import (
    ManifestError,
    Resources,
    TrainingJob,
    network_policy,
    operator_tf_config,
    operator_tf_configs,
    tfjob_manifest,
)
from tfdist.k8s import cli as k8s_cli
from tfdist.layout import Layout, LayoutError
from tfdist.roles import is_server_role
from tools import tfjob

pytestmark = pytest.mark.fast

IMAGE = "example.com/tfdist:1"

# layout name -> (tool flags, {pod: what that pod does}); "serve" marks a worker or ps server of
# parameter-server training, anything else is the strategy that --strategy=auto builds there.
LAYOUTS = {
    "workers": (
        ["--workers", "2"],
        {"job-worker-0": "multi_worker_mirrored", "job-worker-1": "multi_worker_mirrored"},
    ),
    "chief_workers": (
        ["--chief", "1", "--workers", "2"],
        {
            "job-chief-0": "multi_worker_mirrored",
            "job-worker-0": "multi_worker_mirrored",
            "job-worker-1": "multi_worker_mirrored",
        },
    ),
    "parameter_server": (
        ["--chief", "1", "--workers", "2", "--ps", "1"],
        {
            "job-chief-0": "parameter_server",
            "job-worker-0": "serve",
            "job-worker-1": "serve",
            "job-ps-0": "serve",
        },
    ),
    "parameter_server_evaluator": (
        ["--chief", "1", "--workers", "2", "--ps", "2", "--evaluator", "1"],
        {
            "job-chief-0": "parameter_server",
            "job-worker-0": "serve",
            "job-worker-1": "serve",
            "job-ps-0": "serve",
            "job-ps-1": "serve",
            "job-evaluator-0": "one_device",
        },
    ),
    "workers_evaluator": (
        ["--workers", "2", "--evaluator", "1"],
        {
            "job-worker-0": "multi_worker_mirrored",
            "job-worker-1": "multi_worker_mirrored",
            "job-evaluator-0": "one_device",
        },
    ),
    # One worker and an evaluator are two pods, so both get a TF_CONFIG; one worker alone is
    # no multi-worker cluster, so it trains on one device.
    "worker_evaluator": (
        ["--workers", "1", "--evaluator", "1"],
        {"job-worker-0": "one_device", "job-evaluator-0": "one_device"},
    ),
    "single_worker": (["--workers", "1"], {"job-worker-0": "one_device"}),
}


def run_cli(capsys, *args: str, main=tfjob.main) -> tuple[int, str, str]:
    """Runs tools.tfjob (or another `main`) in-process; returns (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def documents_from_cli(capsys, *args: str) -> list[dict]:
    """The TFJob and its NetworkPolicy, from the JSON List the command writes."""
    code, out, err = run_cli(capsys, "--name", "job", "--image", IMAGE, "--format", "json", *args)
    assert code == 0, err
    listed = json.loads(out)
    assert (listed["apiVersion"], listed["kind"]) == ("v1", "List")
    assert [item["kind"] for item in listed["items"]] == ["TFJob", "NetworkPolicy"]
    return listed["items"]


def manifest_from_cli(capsys, *args: str) -> dict:
    return documents_from_cli(capsys, *args)[0]


def operator_pod_labels(manifest: dict) -> dict[str, dict[str, str]]:
    """Pod name -> the labels the training-operator puts on that pod of a TFJob.

    As read from kubeflow/training-operator (JobController.GenLabels, and the replica labels
    its pod reconciler adds): operator-name, job-name, replica-type and replica-index, all
    prefixed training.kubeflow.org/.
    """
    name = manifest["metadata"]["name"]
    labels = {}
    for replica_type, spec in manifest["spec"]["tfReplicaSpecs"].items():
        for index in range(spec.get("replicas", 1)):
            labels[f"{name}-{replica_type.lower()}-{index}"] = {
                "training.kubeflow.org/operator-name": "tfjob-controller",
                "training.kubeflow.org/job-name": name,
                "training.kubeflow.org/replica-type": replica_type.lower(),
                "training.kubeflow.org/replica-index": str(index),
            }
    return labels


def role_in_pod(tf_config: dict | None) -> str:
    """What tfdist does in a pod with this TF_CONFIG (None: the operator set none)."""
    from tfdist.strategies import resolve_auto  # deferred: the module imports TensorFlow

    info = None if tf_config is None else parse_tf_config(json.dumps(tf_config), source="a test")
    if is_server_role(info):
        return "serve"
    return resolve_auto(info, tpu_address=None, num_gpus=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_pod_gets_the_intended_role(capsys, layout):
    flags, expected = LAYOUTS[layout]
    manifest = manifest_from_cli(capsys, *flags)
    tf_configs = operator_tf_configs(manifest)
    assert list(tf_configs) == list(expected)  # one pod per replica, in TFJob order
    assert {pod: role_in_pod(tf_config) for pod, tf_config in tf_configs.items()} == expected


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "single_worker"])
def test_exactly_one_pod_is_chief(capsys, layout):
    flags, _ = LAYOUTS[layout]
    tf_configs = operator_tf_configs(manifest_from_cli(capsys, *flags))
    chiefs = [pod for pod, tf_config in tf_configs.items() if parse_tf_config(tf_config).is_chief]
    assert chiefs == (["job-chief-0"] if "--chief" in flags else ["job-worker-0"])


def test_single_replica_job_gets_no_tf_config(capsys):
    manifest = manifest_from_cli(capsys, "--workers", "1")
    assert operator_tf_config(manifest, task_type="Worker", index=0) is None
    code, out, _ = run_cli(capsys, "--name", "job", "--image", IMAGE, "--show_tf_config")
    assert code == 0 and out == "job-worker-0: (no TF_CONFIG: one pod)\n"


def test_tf_config_has_the_operators_shape(capsys):
    manifest = manifest_from_cli(
        capsys, "--namespace", "ml", "--chief", "1", "--workers", "2", "--ps", "1",
        "--evaluator", "1", "--port", "3333",
    )  # fmt: skip
    tf_config = operator_tf_config(manifest, task_type="worker", index=1)
    assert tf_config == {
        "cluster": {  # lower-case types, sorted as Go marshals a map; the evaluator is listed
            "chief": ["job-chief-0.ml.svc:3333"],
            "evaluator": ["job-evaluator-0.ml.svc:3333"],
            "ps": ["job-ps-0.ml.svc:3333"],
            "worker": ["job-worker-0.ml.svc:3333", "job-worker-1.ml.svc:3333"],
        },
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    info = parse_tf_config(tf_config)
    assert info.environment == "cloud" and info.address == "job-worker-1.ml.svc:3333"
    assert "evaluator" not in info.training_cluster()  # never handed to TensorFlow


def test_custom_cluster_domain_extends_addresses(capsys):
    manifest = manifest_from_cli(capsys, "--workers", "2")
    tf_config = operator_tf_config(
        manifest, task_type="Worker", index=0, cluster_domain="cluster.local"
    )
    assert tf_config["cluster"]["worker"] == [
        "job-worker-0.default.svc.cluster.local:2222",
        "job-worker-1.default.svc.cluster.local:2222",
    ]
    assert parse_tf_config(tf_config).num_workers == 2


def test_master_replica_is_read_as_the_chief():
    # Manifests written for the older API name the chief "Master"; its pod gets type "master".
    container = {"name": "tensorflow", "image": IMAGE}
    template = {"spec": {"containers": [container]}}
    manifest = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": "old"},  # no namespace: "default"
        "spec": {
            "tfReplicaSpecs": {
                "Master": {"template": template},  # replicas default to 1
                "Worker": {"replicas": 1, "template": template},
            }
        },
    }
    tf_config = operator_tf_config(manifest, task_type="Master", index=0)
    assert tf_config["task"] == {"type": "master", "index": 0}
    assert tf_config["cluster"]["master"] == ["old-master-0.default.svc:2222"]
    info = parse_tf_config(tf_config)
    assert info.task_type == "chief" and info.is_chief
    assert role_in_pod(tf_config) == "multi_worker_mirrored"


def test_manifest_structure(capsys):
    manifest = manifest_from_cli(
        capsys, "--chief", "1", "--workers", "2", "--ps", "1", "--cpu", "2", "--memory", "4Gi",
        "--gpus", "1", "--workdir", "/app", "--model_dir_claim", "runs",
        "--", "--config=digits_cnn", "--model_dir=/mnt/runs",
    )  # fmt: skip
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "TFJob"
    assert manifest["metadata"] == {"name": "job", "namespace": "default"}
    assert manifest["spec"]["runPolicy"] == {"cleanPodPolicy": "Running"}
    specs = manifest["spec"]["tfReplicaSpecs"]
    assert list(specs) == ["Chief", "Worker", "PS"]
    assert [specs[t]["replicas"] for t in specs] == [1, 2, 1]
    limits = {}
    for replica_type, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode"
        (container,) = spec["template"]["spec"]["containers"]
        assert container["name"] == "tensorflow"
        assert container["image"] == IMAGE and container["workingDir"] == "/app"
        assert container["ports"] == [{"name": "tfjob-port", "containerPort": 2222}]
        # ExitCode retries 128-255 only: tfdist's restartable exits must use such a code.
        assert container["env"] == [
            {"name": "TFDIST_RESTARTABLE_EXIT_CODE", "value": "143"},
            {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
        ]
        assert container["command"] == [
            "python", "-m", "experiments.train", "--config=digits_cnn", "--model_dir=/mnt/runs",
        ]  # fmt: skip
        assert container["securityContext"] == LOCKED_DOWN
        assert container["volumeMounts"] == [
            {"name": "tmp", "mountPath": "/tmp"},
            {"name": "model-dir", "mountPath": "/mnt/runs"},
        ]
        assert spec["template"]["spec"]["volumes"] == [
            {"name": "tmp", "emptyDir": {}},
            {"name": "model-dir", "persistentVolumeClaim": {"claimName": "runs"}},
        ]
        assert pod_spec_errors(spec["template"]["spec"]) == []
        assert container["resources"]["requests"] == container["resources"]["limits"]
        limits[replica_type] = container["resources"]["limits"]
    # The chief only coordinates parameter-server training and ps only store: no GPUs there.
    assert limits == {
        "Chief": {"cpu": "2", "memory": "4Gi"},
        "Worker": {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": 1},
        "PS": {"cpu": "2", "memory": "4Gi"},
    }


def test_chief_of_synchronous_training_gets_gpus():
    job = TrainingJob(
        name="job",
        image=IMAGE,
        command=("python", "train.py"),
        layout=Layout(chief=1, workers=1),
        resources=Resources(gpus=2),
    )
    manifest = tfjob_manifest(job)
    for spec in manifest["spec"]["tfReplicaSpecs"].values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["resources"] == {
            "requests": {"nvidia.com/gpu": 2},
            "limits": {"nvidia.com/gpu": 2},
        }


@pytest.mark.parametrize("layout", LAYOUTS)
def test_yaml_and_json_output_describe_the_same_manifest(capsys, layout):
    flags, _ = LAYOUTS[layout]
    args = ["--name", "job", "--image", IMAGE, *flags, "--", "--config=digits_cnn", "-x", "on"]
    code, yaml_text, err = run_cli(capsys, *args)
    assert code == 0, err
    assert list(yaml.safe_load_all(yaml_text)) == documents_from_cli(
        capsys, *flags, "--", "--config=digits_cnn", "-x", "on"
    )
    assert "&id" not in yaml_text  # a plain tree: no anchors or aliases for kubectl to expand


@pytest.mark.parametrize(
    "text",
    [
        "false",  # would read back as a bool
        "No",  # YAML 1.1 bool
        "null",
        "",
        "2222",  # would read back as an int
        "1e3",
        "2024-01-01",  # a date to YAML 1.1
        "--flag=a b # c",
        'say "hi"\\',
        "line\nbreak\ttab",
        "bell\x07del\x7f",
        "café",
    ],
)
def test_every_argument_reads_back_as_the_same_string(capsys, text):
    code, out, err = run_cli(capsys, "--name", "job", "--image", IMAGE, "--", "-x", text)
    assert code == 0, err
    tfjob, _ = yaml.safe_load_all(out)
    (container,) = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["command"][-2:] == ["-x", text]


def test_json_output_is_valid_json_and_kubectl_shaped(capsys):
    code, out, err = run_cli(capsys, "--name", "job", "--image", IMAGE, "--format", "json")
    assert code == 0 and err == ""
    tfjob, policy = json.loads(out)["items"]
    assert tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 1
    assert policy["kind"] == "NetworkPolicy"


def test_out_writes_the_file(capsys, tmp_path):
    target = tmp_path / "job.yaml"
    args = ["--name", "job", "--image", IMAGE, "--workers", "2"]
    code, out, _ = run_cli(capsys, *args, "--out", str(target))
    assert code == 0 and f"kubectl apply -f {target}" in out
    _, stdout_yaml, _ = run_cli(capsys, *args)
    assert target.read_text() == stdout_yaml


def test_show_tf_config_lists_every_pod(capsys):
    code, out, _ = run_cli(
        capsys, "--name", "job", "--image", IMAGE, "--chief", "1", "--ps", "1", "--show_tf_config"
    )
    assert code == 0
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["job-chief-0", "job-worker-0", "job-ps-0"]
    pod, _, tf_config = lines[2].partition(": ")
    assert json.loads(tf_config)["task"] == {"type": "ps", "index": 0}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--chief", "2"], r"at most one chief .* Received: 2 chief, 1 worker$"),
        (["--evaluator", "2"], r"at most one evaluator"),
        (["--workers", "-1"], r"workers must be 0 or more\. Received: workers=-1$"),
        (["--workers", "0"], r"no chief and no worker"),
        (["--workers", "2", "--ps", "1"], r"needs a chief .* Received: 2 workers, 1 ps$"),
        (["--chief", "1", "--workers", "0", "--ps", "1"], r"needs workers .* 1 chief, 1 ps$"),
        (["--name", "Digits"], r"name must be a DNS-1035 label.* Received: name='Digits'$"),
        (["--name", "1job"], r"DNS-1035"),
        (["--name", "job_1"], r"DNS-1035"),
        (["--name", "a" * 60], r"'a{60}-worker-0' has 69 characters .* at most 54\b"),
        (["--namespace", "My_NS"], r"namespace must be a DNS-1123 label"),
        (["--image", "has space"], r"image must name a container image"),
        (["--port", "70000"], r"port must be from 1 to 65535"),
        (["--restart_policy", "Always"], r"valid ones are ExitCode, OnFailure, Never"),
        (["--cpu", "2x"], r"cpu is not a Kubernetes quantity.* Received: cpu='2x'$"),
        (["--memory", "lots"], r"memory is not a Kubernetes quantity"),
        (["--gpus", "-1"], r"gpus must be 0 or more"),
        (["--workdir", "app"], r"workdir must be an absolute path"),
        (
            ["--workers", "2", "--", "--strategy=parameter_server"],
            r"'parameter_server' needs a chief, workers and ps tasks: use e\.g\. "
            r"`--chief 1 --workers 2 --ps 1`",
        ),
        (
            ["--", "--strategy", "multi_worker_mirrored"],
            r"the TFJob operator gives a job of one replica \(1 worker\) none.* `--workers 2`",
        ),
        (["--workers", "2", "--", "--strategy=mirrored"], r"'mirrored' trains within one process"),
        (["--bogus", "1"], r"unrecognised option\(s\) --bogus: tfdist-k8s tfjob's options"),
        (["--workers", "x"], r"argument --workers: invalid int value: 'x'"),
        (["--format", "toml"], r"argument --format: invalid choice"),
        (["--run_as_user", "-5"], r"run_as_user must be a user id of 1 or more"),
        (
            ["--", "--model_dir=/mnt/runs/job"],
            r"--model_dir=/mnt/runs/job is a path inside the pod.* --model_dir_claim NAME",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, "--name", "job", "--image", IMAGE, *args)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("tfdist-k8s: error: ")
    assert re.search(message, err.rstrip("\n")), err


def test_missing_required_flags(capsys):
    code, _, err = run_cli(capsys, "--workers", "2")
    assert code == 2 and len(err.splitlines()) == 1
    assert "required: --name, --image" in err


def test_strategy_flag_matching_the_layout_is_accepted(capsys):
    for flags, strategy in [
        (["--workers", "2"], "multi_worker_mirrored"),
        (["--chief", "1", "--ps", "1"], "parameter_server"),
        (["--workers", "1"], "one_device"),
        (["--workers", "2", "--evaluator", "1"], "auto"),
        # The evaluator builds one_device itself, whatever --strategy the others get.
        (["--chief", "1", "--ps", "1", "--evaluator", "1"], "parameter_server"),
    ]:
        manifest = manifest_from_cli(capsys, *flags, "--", f"--strategy={strategy}")
        command = manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
        assert command[0]["command"][-1] == f"--strategy={strategy}"


def test_library_errors_name_the_field():
    command = ("python", "train.py")
    with pytest.raises(LayoutError, match=r"chief must be a whole number\. Received: chief=True"):
        TrainingJob(name="job", image=IMAGE, command=command, layout=Layout(chief=True))
    job = TrainingJob(name="job", image=IMAGE, command=command, layout=Layout(workers=2))
    with pytest.raises(ManifestError, match=r"valid ones are ExitCode.* restart_policy='Always'"):
        tfjob_manifest(job, restart_policy="Always")
    manifest = tfjob_manifest(job)
    with pytest.raises(ManifestError, match=r"no 'ps' replicas; it has Worker"):
        operator_tf_config(manifest, task_type="ps", index=0)
    with pytest.raises(ManifestError, match=r"index must be from 0 to 1\. Received: index=2"):
        operator_tf_config(manifest, task_type="worker", index=2)
    with pytest.raises(ManifestError, match=r"expected a TFJob manifest .* kind='Pod'"):
        operator_tf_config({"kind": "Pod"}, task_type="worker", index=0)


def test_old_flags_only_form_and_a_full_command_write_the_same_manifest(capsys):
    flags = ["--name", "job", "--image", IMAGE, "--workers", "2"]
    _, old, _ = run_cli(capsys, *flags, "--", "--config=digits_cnn")
    train = ["python", "-m", "experiments.train", "--config=digits_cnn"]
    _, shim_full, _ = run_cli(capsys, *flags, "--", *train)
    code, new, err = run_cli(capsys, "tfjob", *flags, "--", *train, main=k8s_cli.main)
    assert code == 0, err
    assert old == shim_full == new
    tfjob, _ = yaml.safe_load_all(new)
    assert tfjob["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] == 2


@pytest.mark.parametrize("policy", ["OnFailure", "Never"])
def test_only_the_exit_code_policy_needs_a_restartable_exit_code(capsys, policy):
    manifest = manifest_from_cli(capsys, "--workers", "2", "--restart_policy", policy)
    (container,) = manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["env"] == [{"name": "HOME", "value": "/tmp"}]
    assert container["name"] == "tensorflow"


def test_help_explains_roles_and_restart_policy(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for text in ("--restart_policy", "ExitCode", "OnFailure", "-- COMMAND", "--model_dir_claim"):
        assert text in out
    code, out, _ = run_cli(capsys, "--help", main=k8s_cli.main)
    assert code == 0 and "parameter_server on the chief" in out


# -- safe by default: the network policy, the locked-down pods, the namespace, model_dir --------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_network_policy_admits_only_the_jobs_pods_to_the_task_port(capsys, layout):
    flags, expected = LAYOUTS[layout]
    tfjob, policy = documents_from_cli(capsys, *flags, "--port", "3333")
    assert network_policy_errors(policy) == []
    assert policy["metadata"] == {"name": "job", "namespace": "default"}
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec  # egress stays open
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 3333}]  # the port in TF_CONFIG
    (source,) = rule["from"]
    pods = operator_pod_labels(tfjob)
    assert list(pods) == list(expected)
    for labels in pods.values():
        assert selects(spec["podSelector"], labels) and selects(source["podSelector"], labels)
    other = operator_pod_labels({**tfjob, "metadata": {"name": "other"}})
    assert not any(selects(source["podSelector"], labels) for labels in other.values())
    assert not any(selects(spec["podSelector"], labels) for labels in other.values())


def test_every_pod_validates_and_runs_locked_down(capsys):
    flags, _ = LAYOUTS["parameter_server_evaluator"]
    tfjob = manifest_from_cli(capsys, *flags, "--cpu", "1", "--memory", "2Gi", "--gpus", "1")
    for spec in tfjob["spec"]["tfReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        assert pod_spec_errors(pod) == []
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        assert container["securityContext"] == LOCKED_DOWN
        assert container["resources"]["requests"] == container["resources"]["limits"]
        assert pod["volumes"] == [{"name": "tmp", "emptyDir": {}}]  # gs:// or none: no claim


def test_namespace_lands_on_every_object(capsys):
    documents = documents_from_cli(capsys, "--workers", "2", "--namespace", "team-a")
    assert [d["metadata"]["namespace"] for d in documents] == ["team-a", "team-a"]
    # ... and in the addresses the operator writes.
    tf_config = operator_tf_config(documents[0], task_type="worker", index=0)
    assert tf_config["cluster"]["worker"][0] == "job-worker-0.team-a.svc:2222"


def test_model_dir_in_a_bucket_passes_and_a_local_one_needs_a_claim():
    def job(*command, claim=None):
        return TrainingJob(
            name="job",
            image=IMAGE,
            command=("python", "train.py", *command),
            layout=Layout(workers=2),
            model_dir_claim=claim,
        )

    for remote in ("--model_dir=gs://bucket/job", "--model_dir=s3://bucket/job"):
        pod = tfjob_manifest(job(remote))["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
        assert [volume["name"] for volume in pod["volumes"]] == ["tmp"]
    with pytest.raises(ManifestError, match=r"lost when the pod goes.*--model_dir_claim NAME"):
        job("--model_dir=/mnt/runs/job")
    with pytest.raises(ManifestError, match=r"no --model_dir in the pod"):
        job("--model_dir=gs://bucket/job", claim="runs")
    manifest = tfjob_manifest(job("--model_dir=/mnt/runs/job", claim="runs"))
    pod = manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    assert {"name": "model-dir", "persistentVolumeClaim": {"claimName": "runs"}} in pod["volumes"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "model-dir", "mountPath": "/mnt/runs/job"} in mounts
    assert network_policy(manifest)["spec"]["podSelector"] == {
        "matchLabels": {"training.kubeflow.org/job-name": "job"}
    }


def test_network_policy_refuses_what_it_cannot_read():
    with pytest.raises(ManifestError, match=r"expected a JobSet or TFJob manifest.* kind='Pod'"):
        network_policy({"kind": "Pod", "metadata": {"name": "p"}})
    manifest = tfjob_manifest(TrainingJob(name="job", image=IMAGE, command=("python", "train.py")))
    del manifest["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["ports"]
    with pytest.raises(ManifestError, match=r"declares no containerPort"):
        network_policy(manifest)
