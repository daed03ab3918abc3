"""Tests for `tfdist-k8s jobset` (tfdist/k8s/jobset.py, jobset_env.py, cli.py) and for
`tfdist.cluster.cluster_from_environment`, which turns a JobSet pod's environment into its cluster.

The manifests are checked against JobSet's published CRD schema (tests/fixtures/jobset_crd.yaml),
their NetworkPolicy and each pod's securityContext, resources and volumes against the Kubernetes
API's published schema (tests/fixtures/k8s_openapi.yaml); then every pod's environment is rebuilt here the way JobSet and Kubernetes fill it in (JobSet's
pod annotations behind each downward-API fieldRef, the Job's JOB_COMPLETION_INDEX, host names as
JobSet makes them) and taken the whole way: environment -> cluster_from_environment -> TF_CONFIG
-> the strategy 'auto' resolves to (or serving, for parameter-server workers and ps).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import jsonschema
import pytest
import yaml

from tests.conftest import REPO
from tfdist.cluster import cluster_from_environment, parse_tf_config
from tfdist.k8s import (
    JobSetEnvError,
    TrainingJob,
    jobset_manifest,
    jobset_tf_configs,
    network_policy,
)
from tfdist.k8s import cli as k8s_cli
from tfdist.layout import Layout
from tfdist.roles import is_server_role

pytestmark = pytest.mark.fast

IMAGE = "example.com/tfdist:1"
COMMAND = ["python", "my_train.py", "--model_dir=gs://bucket/runs"]
CRD = yaml.safe_load((REPO / "tests" / "fixtures" / "jobset_crd.yaml").read_text())
OPENAPI = yaml.safe_load((REPO / "tests" / "fixtures" / "k8s_openapi.yaml").read_text())
LOCKED_DOWN = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
    "readOnlyRootFilesystem": True,
}

# shape -> (tfdist-k8s options, {task type: what each of its pods does}); "serve" marks a worker
# or ps server of parameter-server training, anything else is what --strategy=auto builds there.
SHAPES = {
    "workers": (["--workers", "2"], {"worker": ["multi_worker_mirrored"] * 2}),
    "chief_workers": (
        ["--chief", "1", "--workers", "2"],
        {"chief": ["multi_worker_mirrored"], "worker": ["multi_worker_mirrored"] * 2},
    ),
    "chief_workers_ps": (
        ["--chief", "1", "--workers", "2", "--ps", "2"],
        {"chief": ["parameter_server"], "worker": ["serve"] * 2, "ps": ["serve"] * 2},
    ),
    "workers_evaluator": (
        ["--workers", "2", "--evaluator", "1"],
        {"worker": ["multi_worker_mirrored"] * 2, "evaluator": ["one_device"]},
    ),
    "parameter_server_evaluator": (
        ["--chief", "1", "--workers", "2", "--ps", "1", "--evaluator", "1"],
        {
            "chief": ["parameter_server"],
            "worker": ["serve"] * 2,
            "ps": ["serve"],
            "evaluator": ["one_device"],
        },
    ),
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """Runs tfdist-k8s in-process; returns (exit code, stdout, stderr)."""
    code = k8s_cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def documents_from_cli(capsys, *options: str, command=COMMAND) -> list[dict]:
    """Every manifest `tfdist-k8s jobset` writes: the JobSet, then its NetworkPolicy."""
    args = ["jobset", "--name", "job", "--image", IMAGE, *options, "--", *command]
    code, out, err = run_cli(capsys, *args)
    assert code == 0, err
    assert "&id" not in out  # a plain tree: no YAML anchors or aliases
    documents = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in documents] == ["JobSet", "NetworkPolicy"]
    return documents


def jobset_from_cli(capsys, *options: str, command=COMMAND) -> dict:
    return documents_from_cli(capsys, *options, command=command)[0]


def pod_specs(manifest: dict) -> list[dict]:
    """The pod spec of each replicated job of a JobSet."""
    return [
        rjob["template"]["spec"]["template"]["spec"] for rjob in manifest["spec"]["replicatedJobs"]
    ]


# -- what JobSet and Kubernetes do with the manifest, written from their documentation ----------

_FIELD_PATH = re.compile(r"metadata\.(annotations|labels)\['([^']+)'\]")


def pods(manifest: dict) -> Iterator[tuple[str, str, dict[str, str]]]:
    """Every pod of a JobSet: (its replicated job, its DNS name, its container's environment).

    JobSet creates `replicas` Jobs per replicated job, named <jobset>-<rjob>-<jobIndex>, labels
    and annotates their pods with jobset.sigs.k8s.io/{jobset-name, replicatedjob-name,
    job-index}, and, with DNS host names on, puts them in the subdomain. An Indexed Job names
    each pod's host <job>-<completionIndex>, annotates it with
    batch.kubernetes.io/job-completion-index, and sets JOB_COMPLETION_INDEX in every container.
    """
    name = manifest["metadata"]["name"]
    network = manifest["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    subdomain = network.get("subdomain") or name
    for rjob in manifest["spec"]["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        assert job_spec["completionMode"] == "Indexed"
        assert job_spec["parallelism"] == job_spec["completions"]  # every task runs at once
        for job_index in range(rjob.get("replicas", 1)):
            for completion in range(job_spec["completions"]):
                metadata = pod_metadata(name, rjob["name"], job_index, completion)
                (container,) = job_spec["template"]["spec"]["containers"]
                env = {"JOB_COMPLETION_INDEX": str(completion)}
                for entry in container.get("env", []):
                    env[entry["name"]] = resolve(entry, metadata)
                host = f"{name}-{rjob['name']}-{job_index}-{completion}.{subdomain}"
                yield rjob["name"], host, env


def pod_metadata(name: str, rjob: str, job_index: int, completion: int) -> dict:
    """The labels and annotations JobSet and the Indexed Job put on one pod of JobSet `name`."""
    labels = {
        "jobset.sigs.k8s.io/jobset-name": name,
        "jobset.sigs.k8s.io/replicatedjob-name": rjob,
        "jobset.sigs.k8s.io/job-index": str(job_index),
    }
    annotations = {**labels, "batch.kubernetes.io/job-completion-index": str(completion)}
    return {"labels": labels, "annotations": annotations}


def every_pod_labels(manifest: dict) -> list[dict[str, str]]:
    """The labels of every pod of a JobSet."""
    name = manifest["metadata"]["name"]
    return [
        pod_metadata(name, rjob["name"], job_index, completion)["labels"]
        for rjob in manifest["spec"]["replicatedJobs"]
        for job_index in range(rjob.get("replicas", 1))
        for completion in range(rjob["template"]["spec"]["completions"])
    ]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels only, as tfdist writes) selects these labels."""
    assert set(selector) == {"matchLabels"} and selector["matchLabels"]
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def resolve(entry: dict, metadata: dict) -> str:
    """An env entry's value in a pod with this metadata, as the kubelet fills it in."""
    if "value" in entry:
        return entry["value"]
    match = _FIELD_PATH.fullmatch(entry["valueFrom"]["fieldRef"]["fieldPath"])
    assert match, f"a fieldRef this test does not resolve: {entry}"
    kind, key = match.groups()
    assert key in metadata[kind], f"no {kind} {key!r} on a JobSet pod: {entry}"
    return metadata[kind][key]


def role_of(info) -> str:
    from tfdist.strategies import resolve_auto  # deferred: the module imports TensorFlow

    if is_server_role(info):
        return "serve"
    return resolve_auto(info, tpu_address=None, num_gpus=0)


# -- (a) the manifests are JobSets the API server accepts ---------------------------------------

_PERMISSIVE = "x-kubernetes-preserve-unknown-fields"


def strict(schema):
    """`schema` with unknown fields refused, as `kubectl apply` (strict field validation) does,
    except where the schema says any field goes (and where the fixture was trimmed)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get(_PERMISSIVE):
        result.setdefault("additionalProperties", False)
    return result


(_VERSION,) = CRD["spec"]["versions"]
VALIDATOR = jsonschema.Draft7Validator(strict(_VERSION["schema"]["openAPIV3Schema"]))


def schema_errors(manifest: dict) -> list[str]:
    return [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in VALIDATOR.iter_errors(manifest)
    ]


_OPENAPI_VALIDATORS: dict[str, jsonschema.Draft7Validator] = {}


def openapi_errors(definition: str, value, where: str) -> list[str]:
    """`value`'s errors against a definition of the Kubernetes API (k8s_openapi.yaml), strictly."""
    if definition not in _OPENAPI_VALIDATORS:
        schema = strict({**OPENAPI, "$ref": f"#/components/schemas/{definition}"})
        _OPENAPI_VALIDATORS[definition] = jsonschema.Draft7Validator(schema)
    return [
        f"{'.'.join(map(str, [where, *e.absolute_path]))}: {e.message}"
        for e in _OPENAPI_VALIDATORS[definition].iter_errors(value)
    ]


def pod_spec_errors(pod_spec: dict) -> list[str]:
    """Errors of a pod spec's securityContext, volumes, and each container's securityContext,
    resources and volumeMounts against the Kubernetes API's published definitions."""
    core = "io.k8s.api.core.v1."
    errors = openapi_errors(core + "PodSecurityContext", pod_spec["securityContext"], "pod")
    for volume in pod_spec.get("volumes", []):
        errors += openapi_errors(core + "Volume", volume, "volumes")
    for container in pod_spec["containers"]:
        errors += openapi_errors(core + "SecurityContext", container["securityContext"], "c")
        errors += openapi_errors(core + "ResourceRequirements", container.get("resources", {}), "c")
        for mount in container.get("volumeMounts", []):
            errors += openapi_errors(core + "VolumeMount", mount, "volumeMounts")
    return errors


def network_policy_errors(policy: dict) -> list[str]:
    errors = openapi_errors("io.k8s.api.networking.v1.NetworkPolicy", policy, "policy")
    if (policy["apiVersion"], policy["kind"]) != ("networking.k8s.io/v1", "NetworkPolicy"):
        errors.append(f"not a networking.k8s.io/v1 NetworkPolicy: {policy['apiVersion']}")
    return errors


@pytest.mark.parametrize("shape", SHAPES)
def test_manifest_validates_against_jobsets_crd(capsys, shape):
    options, _ = SHAPES[shape]
    manifest, policy = documents_from_cli(
        capsys, *options, "--cpu", "2", "--memory", "4Gi", "--gpus", "1", "--workdir", "/app",
        "--model_dir_claim", "runs", command=["python", "t.py", "--model_dir=/mnt/runs/job"],
    )  # fmt: skip
    assert manifest["apiVersion"] == f"{CRD['spec']['group']}/{_VERSION['name']}"
    assert manifest["kind"] == CRD["spec"]["names"]["kind"]
    assert schema_errors(manifest) == []
    # The CRD leaves the pod spec open (x-kubernetes-preserve-unknown-fields): what tfdist
    # adds there is checked against the Kubernetes API's own definitions.
    specs = pod_specs(manifest)
    assert len(specs) == len(SHAPES[shape][1])
    assert [error for spec in specs for error in pod_spec_errors(spec)] == []
    assert network_policy_errors(policy) == []


@pytest.mark.parametrize(
    "path, value, error",
    [
        (("spec", "network", "enableDnsHostnames"), True, "'enableDnsHostnames' was unexpected"),
        (("spec", "successPolicy", "operator"), "Some", "'Some' is not one of"),
        (("spec", "failurePolicy", "maxRestarts"), "3", "'3' is not of type 'integer'"),
    ],
)
def test_the_schema_check_catches_mistakes(capsys, path, value, error):
    # The CRD check above passes only because the manifest is right, not because it checks little.
    manifest = copy.deepcopy(jobset_from_cli(capsys, "--workers", "2"))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    assert any(error in message for message in schema_errors(manifest)), schema_errors(manifest)


_CONTAINER = ("containers", 0)
_POLICY = ("policy",)


@pytest.mark.parametrize(
    "path, value, error",
    [
        ((*_CONTAINER, "securityContext", "runAsNonRoot"), "true", "'true' is not of type"),
        ((*_CONTAINER, "securityContext", "runAsNonroot"), True, "'runAsNonroot' was unexpected"),
        ((*_CONTAINER, "securityContext", "seccompProfile"), {"type": "Default"}, "not one of"),
        ((*_CONTAINER, "securityContext", "capabilities", "drop"), "ALL", "is not of type 'array'"),
        ((*_CONTAINER, "resources", "requests", "cpu"), "2 cores", "does not match"),
        ((*_CONTAINER, "volumeMounts", 0), {"name": "tmp"}, "'mountPath' is a required property"),
        (("volumes", 1, "persistentVolumeClaim"), {"claim": "runs"}, "'claimName' is a required"),
        (("securityContext", "fsGroupChangePolicy"), "Sometimes", "is not one of"),
        ((*_POLICY, "spec", "policyTypes"), ["ingress"], "'ingress' is not one of"),
        ((*_POLICY, "spec", "ingress", 0, "ports", 0, "port"), 2.5, "is not valid under any"),
        ((*_POLICY, "spec", "ingress", 0, "from", 0, "pods"), {}, "'pods' was unexpected"),
    ],
)
def test_the_kubernetes_schema_check_catches_mistakes(capsys, path, value, error):
    # As above, for the pieces checked against the Kubernetes API's definitions.
    manifest, policy = copy.deepcopy(
        documents_from_cli(
            capsys,
            "--workers",
            "2",
            "--cpu",
            "1",
            "--model_dir_claim",
            "runs",
            command=["python", "t.py", "--model_dir=/mnt/runs/job"],
        )  # fmt: skip
    )
    (spec,) = pod_specs(manifest)
    node = {"policy": policy, **spec}
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = pod_spec_errors(spec) + network_policy_errors(policy)
    assert any(error in message for message in errors), errors


def test_manifest_follows_jobsets_webhook_rules(capsys):
    manifest = jobset_from_cli(capsys, "--chief", "1", "--workers", "2", "--ps", "1")
    spec = manifest["spec"]
    for rule in spec["failurePolicy"]["rules"]:  # JobSet's webhook: the rule name pattern
        assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", rule["name"])
        assert set(rule["onJobFailureReasons"]) <= {
            "BackoffLimitExceeded",
            "DeadlineExceeded",
            "FailedIndexes",
            "MaxFailedIndexesExceeded",
            "PodFailurePolicy",
        }
    names = [rjob["name"] for rjob in spec["replicatedJobs"]]
    assert names == ["chief", "worker", "ps"]
    assert set(spec["successPolicy"]["targetReplicatedJobs"]) <= set(names)
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        # A pod failure policy is only allowed for pods the kubelet never restarts in place.
        assert job_spec["template"]["spec"]["restartPolicy"] == "Never"
        (container,) = job_spec["template"]["spec"]["containers"]
        for rule in job_spec["podFailurePolicy"]["rules"]:
            if "onExitCodes" in rule:
                assert rule["onExitCodes"]["containerName"] == container["name"]
                assert 0 not in rule["onExitCodes"]["values"]


# -- (b) every pod derives a TF_CONFIG that lists every task, and 'auto' picks the right role ----


@pytest.mark.parametrize("shape", SHAPES)
def test_every_pod_derives_its_tf_config(capsys, shape):
    options, expected = SHAPES[shape]
    manifest = jobset_from_cli(capsys, *options)
    every_pod = list(pods(manifest))
    addresses = {f"{host}:2222" for _, host, _ in every_pod}
    roles: dict[str, list[str]] = {}
    chiefs = []
    for task_type, host, env in every_pod:
        assert "TF_CONFIG" not in env
        info = cluster_from_environment(env)
        # Exported, so TensorFlow and the user's code see the same cluster, and read back alike.
        again = parse_tf_config(env["TF_CONFIG"])
        assert dataclasses.replace(again, source=info.source) == info
        assert info.task_type == task_type
        assert info.address == f"{host}:2222"  # the pod's own name, as JobSet's DNS has it
        listed = {a for type_addresses in info.cluster.values() for a in type_addresses}
        assert listed == addresses  # every task, the evaluator too
        roles.setdefault(task_type, []).append(role_of(info))
        if info.is_chief:
            chiefs.append(host)
    assert roles == expected
    first = "chief" if "chief" in expected else "worker"
    assert chiefs == [f"job-{first}-0-0.job"]
    assert manifest["spec"]["successPolicy"]["targetReplicatedJobs"] == [first]


def test_show_tf_config_agrees_with_the_pods(capsys):
    options, _ = SHAPES["parameter_server_evaluator"]
    manifest = jobset_from_cli(capsys, *options)
    from_pods = {}
    for _, host, env in pods(manifest):
        cluster_from_environment(env)
        from_pods[host] = json.loads(env["TF_CONFIG"])
    code, out, err = run_cli(
        capsys, "jobset", "--name", "job", "--image", IMAGE, *options, "--show_tf_config", "--", "p"
    )
    assert code == 0, err
    shown = {
        line.split(": ", 1)[0]: json.loads(line.split(": ", 1)[1]) for line in out.splitlines()
    }
    assert shown == from_pods


def test_custom_subdomain_and_port_reach_the_addresses(capsys):
    manifest = jobset_from_cli(capsys, "--workers", "2", "--subdomain", "net", "--port", "3333")
    assert manifest["spec"]["network"]["subdomain"] == "net"
    (container,) = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["ports"] == [{"name": "tfdist", "containerPort": 3333}]
    _, host, env = next(pods(manifest))
    info = cluster_from_environment(env)
    assert info.cluster["worker"] == ("job-worker-0-0.net:3333", "job-worker-0-1.net:3333")
    assert info.address == f"{host}:3333"


def test_manifest_structure(capsys):
    manifest = jobset_from_cli(
        capsys, "--chief", "1", "--workers", "2", "--ps", "1", "--cpu", "2", "--gpus", "1",
        "--max_restarts", "5", "--namespace", "ml",
    )  # fmt: skip
    assert manifest["metadata"] == {"name": "job", "namespace": "ml"}
    spec = manifest["spec"]
    assert spec["network"] == {
        "enableDNSHostnames": True,
        "subdomain": "job",
        "publishNotReadyAddresses": True,
    }
    assert spec["failurePolicy"]["maxRestarts"] == 5
    limits = {}
    for rjob in spec["replicatedJobs"]:
        job_spec = rjob["template"]["spec"]
        assert rjob["replicas"] == 1 and job_spec["backoffLimit"] == 0
        (container,) = job_spec["template"]["spec"]["containers"]
        assert container["command"] == COMMAND and container["image"] == IMAGE
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TFDIST_RESTARTABLE_EXIT_CODE"] == "143"
        assert env["TFDIST_JOBSET_TASKS"] == "chief=1,worker=2,ps=1"
        # The scheduler reserves what the pod may use: requests are the limits.
        assert container["resources"]["requests"] == container["resources"]["limits"]
        limits[rjob["name"]] = container["resources"]["limits"]
    # The chief only coordinates parameter-server training and ps only store: no GPUs there.
    assert limits == {
        "chief": {"cpu": "2"},
        "worker": {"cpu": "2", "nvidia.com/gpu": 1},
        "ps": {"cpu": "2"},
    }


def test_library_builds_the_same_manifest_as_the_cli(capsys):
    job = TrainingJob(name="job", image=IMAGE, command=tuple(COMMAND), layout=Layout(workers=2))
    manifest = jobset_manifest(job)
    assert [manifest, network_policy(manifest)] == documents_from_cli(capsys, "--workers", "2")
    assert list(jobset_tf_configs(job)) == ["job-worker-0-0.job", "job-worker-0-1.job"]


# -- (d) safe by default: the network policy, the locked-down pods, the namespace, model_dir ----


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("port", ["2222", "3333"])
def test_network_policy_admits_only_the_jobs_pods_to_the_task_port(capsys, shape, port):
    options, _ = SHAPES[shape]
    manifest, policy = documents_from_cli(capsys, *options, "--port", port)
    assert policy["metadata"] == {"name": "job", "namespace": "default"}
    spec = policy["spec"]
    # Ingress only: with Egress listed and no egress rule the pods could not even reach DNS.
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    (rule,) = spec["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": int(port)}]
    (source,) = rule["from"]
    assert set(source) == {"podSelector"}  # this namespace's pods, not every namespace's
    job_pods = every_pod_labels(manifest)
    assert len(job_pods) == sum(int(n) for n in options[1::2])
    for labels in job_pods:  # the policy covers every task, and admits every task
        assert selects(spec["podSelector"], labels) and selects(source["podSelector"], labels)
    # ... and no pod of another JobSet in the namespace.
    other = every_pod_labels({**manifest, "metadata": {"name": "other"}})
    assert not any(selects(source["podSelector"], labels) for labels in other)
    assert not any(selects(spec["podSelector"], labels) for labels in other)


def test_every_pod_runs_locked_down(capsys):
    options, _ = SHAPES["parameter_server_evaluator"]
    manifest = jobset_from_cli(capsys, *options)
    for spec in pod_specs(manifest):
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 1000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = spec["containers"]
        assert container["securityContext"] == LOCKED_DOWN
        # A read-only root needs somewhere to write: /tmp (tempfile, autograph) and HOME.
        scratch = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}["/tmp"]
        assert {"name": scratch, "emptyDir": {}} in spec["volumes"]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
    other_user = jobset_from_cli(capsys, "--run_as_user", "2000")
    (spec,) = pod_specs(other_user)
    assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["fsGroup"] == 2000
    assert spec["containers"][0]["securityContext"] == {**LOCKED_DOWN, "runAsUser": 2000}


def test_namespace_lands_on_every_object(capsys):
    documents = documents_from_cli(capsys, "--workers", "2", "--namespace", "team-a")
    assert [d["metadata"]["namespace"] for d in documents] == ["team-a", "team-a"]
    assert {d["metadata"]["namespace"] for d in documents_from_cli(capsys)} == {"default"}


def test_local_model_dir_is_mounted_from_the_claim(capsys):
    command = ["python", "t.py", "--model_dir", "/mnt/runs/job"]
    options, _ = SHAPES["chief_workers_ps"]
    manifest = jobset_from_cli(capsys, *options, "--model_dir_claim", "runs", command=command)
    for spec in pod_specs(manifest):  # every task: the chief writes, the others may read
        volume = {"name": "model-dir", "persistentVolumeClaim": {"claimName": "runs"}}
        assert volume in spec["volumes"]
        (container,) = spec["containers"]
        assert {"name": "model-dir", "mountPath": "/mnt/runs/job"} in container["volumeMounts"]
        assert pod_spec_errors(spec) == []


@pytest.mark.parametrize("model_dir", ["gs://bucket/runs", "s3://bucket/runs", "hdfs://nn/runs"])
def test_remote_model_dir_needs_no_volume(capsys, model_dir):
    manifest = jobset_from_cli(capsys, command=["python", "t.py", f"--model_dir={model_dir}"])
    (spec,) = pod_specs(manifest)
    assert [volume["name"] for volume in spec["volumes"]] == ["tmp"]


@pytest.mark.parametrize(
    "options, command, message",
    [
        (
            [],
            ["--model_dir=/mnt/runs/job"],
            r"--model_dir=/mnt/runs/job is a path inside the pod, .* lost when the pod goes .* "
            r"--model_dir_claim NAME, or .* --model_dir=gs://BUCKET/job\. "
            r"Received: --model_dir=/mnt/runs/job$",
        ),
        ([], ["--model_dir", "runs"], r"--model_dir=runs is a path inside the pod"),
        ([], ["--model_dir=file:///mnt/runs"], r"--model_dir=/mnt/runs is a path inside the pod"),
        (["--model_dir_claim", "runs"], ["--model_dir=runs"], r"must be an absolute path"),
        (["--model_dir_claim", "runs"], ["--model_dir=/tmp"], r"other than / and /tmp"),
        (
            ["--model_dir_claim", "runs"],
            ["--model_dir=gs://b/r"],
            r"the command has no --model_dir in the pod.* Received: model_dir_claim='runs'$",
        ),
        (
            ["--model_dir_claim", "Runs"],
            ["--model_dir=/mnt/runs"],
            r"model_dir_claim must name a PersistentVolumeClaim",
        ),
    ],
)
def test_model_dir_the_pod_would_lose_is_refused(capsys, options, command, message):
    args = ["jobset", "--name", "job", "--image", IMAGE, *options, "--", "python", "t.py"]
    code, out, err = run_cli(capsys, *args, *command)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert re.search(message, err.rstrip("\n")), err


# -- cluster_from_environment and the JobSet environment --------------------------------------


def jobset_env(**changes: str | None) -> dict[str, str]:
    """The environment of worker 1 of a 2-worker JobSet, with some variables changed or removed."""
    env = {
        "TFDIST_JOBSET_NAME": "job",
        "TFDIST_JOBSET_REPLICATED_JOB": "worker",
        "TFDIST_JOBSET_JOB_INDEX": "0",
        "JOB_COMPLETION_INDEX": "1",
        "TFDIST_JOBSET_SUBDOMAIN": "job",
        "TFDIST_JOBSET_PORT": "2222",
        "TFDIST_JOBSET_TASKS": "worker=2",
    }
    for name, value in changes.items():
        if value is None:
            del env[name]
        else:
            env[name] = value
    return env


def test_tf_config_wins_over_the_jobset_environment():
    tf_config = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}
    env = {**jobset_env(), "TF_CONFIG": json.dumps(tf_config)}
    info = cluster_from_environment(env)
    assert info.cluster["worker"] == ("a:1", "b:1")
    assert env["TF_CONFIG"] == json.dumps(tf_config)  # untouched


def test_no_cluster_in_the_environment():
    env = {"JOB_COMPLETION_INDEX": "0", "TF_CONFIG": " "}  # any Indexed Job has the index
    assert cluster_from_environment(env) is None
    # A blank TF_CONFIG is dropped: TensorFlow's own resolvers (MirroredStrategy's) would
    # fail to parse it as JSON.
    assert env == {"JOB_COMPLETION_INDEX": "0"}


def test_jobset_environment_is_derived_and_exported():
    env = jobset_env()
    info = cluster_from_environment(env)
    assert info.task_name == "worker:1" and not info.is_chief
    assert info.address == "job-worker-0-1.job:2222"
    assert "derived from the JobSet environment" in info.source
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "worker", "index": 1}


def test_partial_jobset_environment_names_what_is_missing():
    env = jobset_env(TFDIST_JOBSET_PORT=None, JOB_COMPLETION_INDEX=None)
    with pytest.raises(JobSetEnvError, match=r"JOB_COMPLETION_INDEX, TFDIST_JOBSET_PORT not set"):
        cluster_from_environment(env)
    assert "TF_CONFIG" not in env


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"TFDIST_JOBSET_TASKS": "worker=two"}, r"Invalid TFDIST_JOBSET_TASKS: expected each"),
        ({"TFDIST_JOBSET_TASKS": "worker=2,worker=1"}, r"Invalid TFDIST_JOBSET_TASKS"),
        ({"TFDIST_JOBSET_TASKS": "master=1,worker=2"}, r"Invalid TFDIST_JOBSET_TASKS"),
        (
            {"TFDIST_JOBSET_REPLICATED_JOB": "ps"},
            r"REPLICATED_JOB='ps' does not fit: .* \(worker\)",
        ),
        ({"TFDIST_JOBSET_JOB_INDEX": "1"}, r"JOB_INDEX='1' does not fit: .* one Indexed Job"),
        ({"JOB_COMPLETION_INDEX": "2"}, r"JOB_COMPLETION_INDEX='2' .* must be below 2"),
        ({"JOB_COMPLETION_INDEX": "-1"}, r"JOB_COMPLETION_INDEX='-1' .* a whole number"),
        ({"TFDIST_JOBSET_PORT": "0"}, r"TFDIST_JOBSET_PORT='0' .* from 1 to 65535"),
        ({"TFDIST_JOBSET_NAME": "Job"}, r"TFDIST_JOBSET_NAME='Job' .* DNS label"),
    ],
)
def test_malformed_jobset_environment_is_one_clear_error(changes, message):
    with pytest.raises(JobSetEnvError, match=message) as error:
        cluster_from_environment(jobset_env(**changes))
    assert "\n" not in str(error.value)


def test_build_strategy_reads_the_jobset_environment(monkeypatch):
    import tfdist
    from tfdist.strategies import StrategyError

    monkeypatch.setenv("TF_CONFIG", "")  # restored (unset) after the test
    for name, value in jobset_env(TFDIST_JOBSET_TASKS="chief=1,worker=2,ps=1").items():
        monkeypatch.setenv(name, value)
    # Only possible with the JobSet's cluster: without it, the message would be that
    # TF_CONFIG is not set.
    with pytest.raises(StrategyError, match=r"only the chief builds the strategy"):
        tfdist.build_strategy("parameter_server")
    assert json.loads(os.environ["TF_CONFIG"])["task"]["type"] == "worker"


# -- (c) the command line -----------------------------------------------------------------


def test_yaml_and_json_describe_the_same_manifest(capsys):
    args = ["jobset", "--name", "job", "--image", IMAGE, "--workers", "2", "--", *COMMAND]
    _, yaml_text, _ = run_cli(capsys, *args)
    code, json_text, err = run_cli(capsys, *args[:-4], "--format", "json", *args[-4:])
    assert code == 0, err
    as_json = json.loads(json_text)  # one document: a List, which kubectl applies item by item
    assert (as_json["apiVersion"], as_json["kind"]) == ("v1", "List")
    assert list(yaml.safe_load_all(yaml_text)) == as_json["items"]
    assert [item["kind"] for item in as_json["items"]] == ["JobSet", "NetworkPolicy"]


def test_out_writes_the_file(capsys, tmp_path):
    target = tmp_path / "job.yaml"
    args = ["jobset", "--name", "job", "--image", IMAGE, "--workers", "2"]
    code, out, _ = run_cli(capsys, *args, "--out", str(target), "--", *COMMAND)
    assert code == 0 and "JobSet job (2 workers) and its NetworkPolicy" in out
    assert f"kubectl apply -f {target}" in out
    _, stdout_yaml, _ = run_cli(capsys, *args, "--", *COMMAND)
    assert target.read_text() == stdout_yaml


def test_flags_after_the_separator_belong_to_the_command(capsys):
    command = ["python", "train.py", "--name=other", "--workers", "9", "--", "--help"]
    manifest = jobset_from_cli(capsys, "--workers", "2", command=command)
    (container,) = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"
    ]
    assert container["command"] == command and manifest["metadata"]["name"] == "job"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--name", "job", "--image", IMAGE],
            r"no training command: give the program .* after `--`",
        ),
        (["--name", "job", "--image", IMAGE, "--"], r"no training command"),
        (["--name", "job", "--image", IMAGE, "python", "x.py"], r"`python x\.py` before `--`"),
        (
            ["--name", "job", "--image", IMAGE, "--", "--config=x"],
            r"starts with the flag '--config=x'",
        ),
        (
            ["--image", IMAGE, "--", "p"],
            r"the following arguments are required: --name; see --help$",
        ),
        (
            ["--name", "job", "--image", IMAGE, "--bogus", "1", "--", "p"],
            r"unrecognised option\(s\) --bogus",
        ),
        (
            ["--name", "job", "--image", IMAGE, "--workers", "x", "--", "p"],
            r"invalid int value: 'x'",
        ),
        (
            ["--name", "job", "--image", IMAGE, "--ps", "1", "--", "p"],
            r"needs a chief .* `--chief 1 --workers 2 --ps 1`",
        ),
        (["--name", "job", "--image", IMAGE, "--chief", "2", "--", "p"], r"at most one chief"),
        (
            [
                "--name",
                "job",
                "--image",
                IMAGE,
                "--workers",
                "2",
                "--",
                "p",
                "--strategy=one_device",
            ],
            r"'one_device' trains within one process",
        ),
        (
            ["--name", "a" * 50, "--image", IMAGE, "--", "p"],
            r"'a{50}-worker-0-0-abcde' has 67 characters .* at most 46\b",
        ),
        (
            ["--name", "job", "--image", IMAGE, "--subdomain", "Net", "--", "p"],
            r"subdomain must be a DNS-1035 label",
        ),
        (
            ["--name", "job", "--image", IMAGE, "--max_restarts", "-1", "--", "p"],
            r"max_restarts must be a whole number, 0 or more",
        ),
        (["--name", "Job", "--image", IMAGE, "--", "p"], r"name must be a DNS-1035 label"),
        (
            ["--name", "job", "--image", IMAGE, "--run_as_user", "0", "--", "p"],
            r"run_as_user must be a user id of 1 or more: .* root \(0\) is refused",
        ),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_cli(capsys, "jobset", *args)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("tfdist-k8s: error: ")
    assert re.search(message, err.rstrip("\n")), err


@pytest.mark.parametrize("args", [[], ["kubeflow"]])
def test_a_kind_is_required(capsys, args):
    code, _, err = run_cli(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1
    assert "{jobset,tfjob}" in err or "choose from 'jobset', 'tfjob'" in err


def test_help_lists_both_kinds(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "jobset" in out and "tfjob" in out
    code, out, _ = run_cli(capsys, "jobset", "--help")
    assert code == 0 and "--max_restarts" in out and "-- COMMAND" in out
    for text in ("--run_as_user", "--model_dir_claim", "NetworkPolicy", "HOME=/tmp"):
        assert text in out


@pytest.mark.parametrize(
    "module, args, kind",
    [
        ("tfdist.k8s", ["jobset", "--name", "job", "--image", "img", "--", "p"], "JobSet"),
        ("tools.tfjob", ["--name", "job", "--image", "img"], "TFJob"),  # the old command line
    ],
)
def test_modules_run_without_importing_tensorflow(module, args, kind):
    program = (
        f"import sys, runpy; sys.argv = ['prog', *{args!r}]\n"
        f"try: runpy.run_module({module!r}, run_name='__main__')\n"
        "except SystemExit as e: print('exit', e.code, 'tensorflow' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    manifests, _, last = result.stdout.rpartition("exit")
    assert last.strip() == "0 False"
    assert [d["kind"] for d in yaml.safe_load_all(manifests)] == [kind, "NetworkPolicy"]
