"""Kubernetes: Kubeflow TFJob manifests for tfdist jobs, and the TF_CONFIG each pod will get.

On Kubernetes, Kubeflow's training-operator runs a TFJob: one pod per replica, each with a
TF_CONFIG it writes itself. `tfjob_manifest` builds the manifest for a tfdist job;
`operator_tf_config` computes, from any TFJob manifest, the TF_CONFIG the operator gives a pod,
so the roles tfdist will pick can be checked before anything is submitted. Nothing here talks
to a cluster or imports TensorFlow.

Example:

    >>> job = TFJobConfig(name="digits", image="example.com/tfdist:1", workers=2,
    ...                   train_args=("--config=digits_cnn",))
    >>> manifest = tfjob_manifest(job)
    >>> operator_tf_config(manifest, task_type="worker", index=1)["cluster"]
    {'worker': ['digits-worker-0.default.svc:2222', 'digits-worker-1.default.svc:2222']}
    >>> print(to_yaml(manifest))          # or json.dumps(manifest): kubectl reads both

What the training-operator does, as read from its source (kubeflow/training-operator:
pkg/controller.v1/tensorflow/{tensorflow.go,util.go,tfjob_controller.go,pod_test.go} and
pkg/apis/kubeflow.org/v1/{tensorflow_types.go,tensorflow_validation.go,common_types.go}):

- TF_CONFIG is ``{"cluster": {type: [address, ...]}, "task": {"type": type, "index": i},
  "environment": "cloud"}``. The type is the replica type lower-cased; an address is
  ``<job>-<type>-<i>.<namespace>.svc:<port>``, the name of the headless Service the operator
  makes for that pod, plus ``.<domain>`` when the operator runs with CUSTOM_CLUSTER_DOMAIN.
- The port is the containerPort named "tfjob-port" of the container named "tensorflow"
  (default 2222). A replica without a container named "tensorflow" is rejected.
- The evaluator IS listed in the cluster that every pod sees: the operator's own test
  (TestClusterSpec) expects ``"evaluator": [...]`` in a worker's TF_CONFIG. The older
  tf-operator (v1alpha2, kubeflow/trainer PR #650) left it out, and kubeflow/trainer issue
  #1633 shows a deployment that still did. tfdist accepts both: the evaluator may stand
  outside the cluster, and `ClusterInfo.training_cluster()` drops it before TensorFlow sees it.
- "Chief" and "Master" are both accepted replica types ("semantically equivalent", Master
  kept for backwards compatibility), at most one replica of them in all. Since the task type
  is the lower-cased replica type, a "Master" pod gets ``"type": "master"``, which tfdist reads
  as the chief. Manifests written here use "Chief".
- A job of exactly one replica in all gets no TF_CONFIG ("local training"), so it trains as a
  single host. An evaluator counts: one worker plus an evaluator is a two-pod cluster.
- restartPolicy per replica type defaults to Never. ExitCode restarts a pod whose container
  exited 128-255 (killed by a signal: preemption, node drain, OOM kill) and fails the job on
  1-127 (a bug or a usage error, which would fail again). Manifests written here with
  ExitCode set TFDIST_RESTARTABLE_EXIT_CODE=143, so that tfdist's own restartable exits (a
  preemption after its checkpoint, a lost peer) are retried too.
- With a Chief the job's outcome is the chief's; without one it is worker 0's. The
  cleanPodPolicy "Running" deletes the pods still running then: the worker and ps servers of
  parameter-server training, which never exit on their own.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from tfdist.cluster import ClusterInfo
from tfdist.errors import TfdistError
from tfdist.exit_codes import KUBERNETES_RESTARTABLE_EXIT, RESTARTABLE_EXIT_ENV

API_VERSION = "kubeflow.org/v1"
KIND = "TFJob"
CONTAINER_NAME = "tensorflow"  # the operator finds the training container by this name
PORT_NAME = "tfjob-port"  # ... and the port it puts in TF_CONFIG by this one
DEFAULT_PORT = 2222
TRAIN_COMMAND = ("python", "-m", "experiments.train")
# TFJob's replica types in the order pods are listed, and the TF_CONFIG task type of each.
REPLICA_TYPES = {"Chief": "chief", "Worker": "worker", "PS": "ps", "Evaluator": "evaluator"}
# ExitCode: a signal-killed pod (preemption) is recreated, a failing program fails the job.
RESTART_POLICIES = ("ExitCode", "OnFailure", "Never")
DEFAULT_RESTART_POLICY = "ExitCode"
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_LABEL = 63
_CPU = re.compile(r"(\d+(\.\d+)?|\.\d+)m?")
_MEMORY = re.compile(r"(\d+(\.\d+)?|\.\d+)([KMGTPE]i?|k)?")
_MULTI_WORKER_STRATEGIES = ("multi_worker_mirrored", "parameter_server")
_EVALUATOR_STRATEGIES = ("auto", "one_device", "default")


class TFJobError(TfdistError, ValueError):
    """A TFJob that cannot run as asked; the message says what is wrong and the fix."""


def _check_count(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TFJobError(f"{field} must be a whole number. Received: {field}={value!r}")
    if value < 0:
        raise TFJobError(f"{field} must be 0 or more. Received: {field}={value}")


@dataclasses.dataclass(frozen=True)
class Resources:
    """What each pod asks Kubernetes for; None or 0 leaves it to the cluster's defaults.

    They become the container's limits, and Kubernetes sets its requests equal to them.

    Args:
      cpu: CPU cores as a Kubernetes quantity, e.g. "4" or "500m".
      memory: memory as a Kubernetes quantity, e.g. "8Gi".
      gpus: NVIDIA GPUs ("nvidia.com/gpu") for each pod that computes: workers, the
        evaluator, and the chief unless it only coordinates parameter-server training.
    """

    cpu: str | None = None
    memory: str | None = None
    gpus: int = 0

    def __post_init__(self):
        for field, pattern, example in (("cpu", _CPU, "4 or 500m"), ("memory", _MEMORY, "8Gi")):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, str) and pattern.fullmatch(value)):
                raise TFJobError(
                    f"{field} is not a Kubernetes quantity: expected e.g. {example}. "
                    f"Received: {field}={value!r}"
                )
        _check_count("gpus", self.gpus)

    def limits(self, *, with_gpus: bool) -> dict[str, Any]:
        limits: dict[str, Any] = {}
        if self.cpu is not None:
            limits["cpu"] = self.cpu
        if self.memory is not None:
            limits["memory"] = self.memory
        if with_gpus and self.gpus:
            limits["nvidia.com/gpu"] = self.gpus
        return limits


@dataclasses.dataclass(frozen=True)
class TFJobConfig:
    """A tfdist training job on Kubernetes, validated when built.

    Every pod runs ``python -m experiments.train`` with `train_args`; with the default
    ``--strategy=auto`` each one picks its role from the TF_CONFIG the operator gives it.

    Args:
      name: the TFJob's name; pods and Services are named "<name>-<type>-<index>", so it
        must be a DNS-1035 label (lower-case letters, digits, '-'; starts with a letter)
        short enough for the longest such name to fit in 63 characters.
      image: the container image; it must hold tfdist and this repository's experiments/
        (in `workdir`, or the image's working directory).
      namespace: the Kubernetes namespace.
      chief, workers, ps, evaluator: how many replicas of each type. A chief and an
        evaluator are 0 or 1; parameter-server training (ps > 0) needs a chief and workers.
      port: the port every task's gRPC server listens on.
      resources: CPU, memory and GPUs per pod.
      restart_policy: one of RESTART_POLICIES, for every replica type.
      train_args: flags for experiments.train, e.g. ("--config=digits_cnn",).
      workdir: the container's working directory, if the image's is not the repository.

    Raises:
      TFJobError: a value Kubernetes, the training-operator or tfdist would refuse.
    """

    name: str
    image: str
    namespace: str = "default"
    chief: int = 0
    workers: int = 1
    ps: int = 0
    evaluator: int = 0
    port: int = DEFAULT_PORT
    resources: Resources = Resources()
    restart_policy: str = DEFAULT_RESTART_POLICY
    train_args: tuple[str, ...] = ()
    workdir: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "train_args", tuple(self.train_args))
        self._check_counts()
        self._check_names()
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise TFJobError(f"port must be an integer. Received: port={self.port!r}")
        if not 1 <= self.port <= 65535:
            raise TFJobError(f"port must be from 1 to 65535. Received: port={self.port}")
        if self.restart_policy not in RESTART_POLICIES:
            raise TFJobError(
                f"unknown restart policy; valid ones are {', '.join(RESTART_POLICIES)}. "
                f"Received: restart_policy={self.restart_policy!r}"
            )
        if self.workdir is not None and not str(self.workdir).startswith("/"):
            raise TFJobError(
                f"workdir must be an absolute path in the image, e.g. /app. "
                f"Received: workdir={self.workdir!r}"
            )
        self._check_train_args()

    def replica_counts(self) -> dict[str, int]:
        """TFJob replica type -> replicas, for the types this job has, in REPLICA_TYPES order."""
        counts = (self.chief, self.workers, self.ps, self.evaluator)
        return {t: n for t, n in zip(REPLICA_TYPES, counts, strict=True) if n}

    def describe(self) -> str:
        """The layout in words, e.g. '1 chief, 2 workers, 1 ps'."""
        return ", ".join(
            f"{n} {REPLICA_TYPES[t]}{'s' if n != 1 and t == 'Worker' else ''}"
            for t, n in self.replica_counts().items()
        )

    def _check_counts(self) -> None:
        for field in ("chief", "workers", "ps", "evaluator"):
            _check_count(field, getattr(self, field))
        for field in ("chief", "evaluator"):
            if getattr(self, field) > 1:
                raise TFJobError(
                    f"a TFJob has at most one {field} (TensorFlow and the training-operator "
                    f"allow one); make the others workers. Received: {field}={getattr(self, field)}"
                )
        if not self.chief and not self.workers:
            raise TFJobError(
                "the job has no chief and no worker, so nothing would train; set workers=N "
                f"(e.g. 2). Received: chief=0, workers=0, ps={self.ps}"
            )
        if self.ps and not self.chief:
            raise TFJobError(
                "parameter-server training needs a chief to coordinate the workers: set "
                f"chief=1 (e.g. chief=1, workers=2, ps={self.ps}). Received: ps={self.ps}, chief=0"
            )
        if self.ps and not self.workers:
            raise TFJobError(
                "parameter-server training needs workers to run the steps the chief "
                f"schedules: set workers=N (e.g. chief=1, workers=2, ps={self.ps}). "
                "Received: workers=0"
            )

    def _check_names(self) -> None:
        if not isinstance(self.name, str) or not _DNS_1035_LABEL.fullmatch(self.name):
            raise TFJobError(
                "name must be a DNS-1035 label, since it starts every pod's host name: "
                "lower-case letters, digits and '-', starting with a letter and not ending "
                f"with '-', e.g. digits-cnn. Received: name={self.name!r}"
            )
        longest = max(
            (f"{self.name}-{REPLICA_TYPES[t]}-{n - 1}" for t, n in self.replica_counts().items()),
            key=len,
        )
        if len(longest) > _MAX_LABEL:
            raise TFJobError(
                f"name is too long: the pod and Service name {longest!r} has {len(longest)} "
                f"characters and Kubernetes allows {_MAX_LABEL}; shorten the name to at most "
                f"{_MAX_LABEL - len(longest) + len(self.name)}. Received: name={self.name!r}"
            )
        if not isinstance(self.namespace, str) or not (
            _DNS_1123_LABEL.fullmatch(self.namespace) and len(self.namespace) <= _MAX_LABEL
        ):
            raise TFJobError(
                "namespace must be a DNS-1123 label: lower-case letters, digits and '-', at "
                f"most 63 characters, e.g. default. Received: namespace={self.namespace!r}"
            )
        if (
            not isinstance(self.image, str)
            or not self.image
            or any(c.isspace() for c in self.image)
        ):
            raise TFJobError(
                "image must name a container image, e.g. example.com/tfdist:1, with no spaces. "
                f"Received: image={self.image!r}"
            )

    def _check_train_args(self) -> None:
        args = self.train_args
        if any(not isinstance(a, str) for a in args):
            raise TFJobError(f"train_args must be strings. Received: train_args={args!r}")
        if args and args[0] in ("python", "python3"):
            raise TFJobError(
                f"train_args (the flags after `--`) are experiments.train's; "
                f"`{shlex.join(TRAIN_COMMAND)}` is put in front of them, so leave it out. "
                f"Received: {shlex.join(args)}"
            )
        strategy = _flag_value(args, "strategy")
        if strategy is None or strategy == "auto":
            return
        if self.evaluator and strategy not in _EVALUATOR_STRATEGIES:
            raise TFJobError(
                f"the Evaluator pod runs the same command and cannot build {strategy!r}: it "
                "evaluates on its own device. Leave --strategy at 'auto' (each pod then picks "
                f"its role), or drop the evaluator. Received: --strategy={strategy}, evaluator=1"
            )
        needed = self.cluster_strategy()
        if needed is None and strategy in _MULTI_WORKER_STRATEGIES:
            raise TFJobError(
                f"--strategy={strategy} needs a multi-worker job, but {self.describe()} "
                "trains in one pod (a job of one replica gets no TF_CONFIG). Use "
                f"{_example_layout(strategy)}, or --strategy=auto. Received: --strategy={strategy}"
            )
        if needed is not None and strategy != needed:
            other = (
                f", or use {_example_layout(strategy)} for {strategy}"
                if strategy in _MULTI_WORKER_STRATEGIES
                else ""
            )
            raise TFJobError(
                f"--strategy={strategy} does not fit this job: a job of {self.describe()} calls "
                f"for {needed!r}. Pass --strategy={needed} or --strategy=auto{other}. "
                f"Received: --strategy={strategy}"
            )

    def cluster_strategy(self) -> str | None:
        """The multi-worker strategy this layout calls for, by tfdist's own rule, if any."""
        # Only the counts matter to the rule, so any distinct addresses do.
        cluster = {
            REPLICA_TYPES[t]: tuple(f"{REPLICA_TYPES[t]}-{i}:{self.port}" for i in range(n))
            for t, n in self.replica_counts().items()
        }
        task = "chief" if self.chief else "worker"
        return ClusterInfo(task_type=task, task_index=0, cluster=cluster).cluster_strategy


def tfjob_manifest(config: TFJobConfig) -> dict[str, Any]:
    """The TFJob manifest for `config`, as plain dicts and lists (render with to_yaml or json)."""
    command = [*TRAIN_COMMAND, *config.train_args]
    specs: dict[str, Any] = {}
    for replica_type, replicas in config.replica_counts().items():
        container: dict[str, Any] = {"name": CONTAINER_NAME, "image": config.image}
        if config.workdir:
            container["workingDir"] = config.workdir
        container["command"] = list(command)
        container["ports"] = [{"name": PORT_NAME, "containerPort": config.port}]
        if config.restart_policy == "ExitCode":
            # Preempted, a lost peer: exit with a code this policy retries (tfdist.exit_codes).
            container["env"] = [
                {"name": RESTARTABLE_EXIT_ENV, "value": str(KUBERNETES_RESTARTABLE_EXIT)}
            ]
        # Under parameter-server training the chief only coordinates and ps only hold
        # variables: GPUs there would sit idle.
        computes = replica_type in ("Worker", "Evaluator") or (
            replica_type == "Chief" and not config.ps
        )
        limits = config.resources.limits(with_gpus=computes)
        if limits:
            container["resources"] = {"limits": limits}
        specs[replica_type] = {
            "replicas": replicas,
            "restartPolicy": config.restart_policy,
            "template": {
                # Kubeflow's TFJob guide: pods do not work with Istio's sidecar injected, which
                # user namespaces of a Kubeflow install enable by default.
                "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
                "spec": {"containers": [container]},
            },
        }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": config.name, "namespace": config.namespace},
        "spec": {
            # Worker and ps servers never exit on their own: delete them when the job ends.
            "runPolicy": {"cleanPodPolicy": "Running"},
            "tfReplicaSpecs": specs,
        },
    }


def operator_tf_config(
    manifest: Mapping[str, Any],
    *,
    task_type: str,
    index: int,
    cluster_domain: str | None = None,
) -> dict[str, Any] | None:
    """The TF_CONFIG the training-operator sets in one pod of a TFJob (see the module notes).

    Args:
      manifest: a TFJob manifest as decoded YAML or JSON (any TFJob, not only tfdist's).
      task_type: the pod's replica type, as in the manifest ("Worker") or lower-case ("worker").
      index: the pod's index within its replica type.
      cluster_domain: the operator's CUSTOM_CLUSTER_DOMAIN, if it was started with one.

    Returns:
      The TF_CONFIG as a dict, or None for a one-replica job, which the operator gives none.

    Raises:
      TFJobError: the manifest is not a TFJob, lacks the replica type, or `index` is out of range.
    """
    name, namespace, specs = _read_manifest(manifest)
    replicas = {replica_type: _replicas(spec) for replica_type, spec in specs.items()}
    by_task = {replica_type.lower(): replica_type for replica_type in specs}
    if task_type.lower() not in by_task:
        raise TFJobError(
            f"the TFJob has no {task_type!r} replicas; it has {', '.join(specs)}. "
            f"Received: task_type={task_type!r}"
        )
    replica_type = by_task[task_type.lower()]
    if not 0 <= index < replicas[replica_type]:
        raise TFJobError(
            f"{replica_type} has {replicas[replica_type]} replica(s), so index must be from 0 "
            f"to {replicas[replica_type] - 1}. Received: index={index}"
        )
    if sum(replicas.values()) == 1:
        return None
    domain = f".{cluster_domain}" if cluster_domain else ""
    cluster = {}
    # The operator marshals a Go map, so the task types come out in sorted order.
    for rtype in sorted(specs, key=str.lower):
        task, port = rtype.lower(), _port(specs[rtype])
        cluster[task] = [
            f"{name}-{task}-{i}.{namespace}.svc{domain}:{port}" for i in range(replicas[rtype])
        ]
    return {
        "cluster": cluster,
        "task": {"type": replica_type.lower(), "index": index},
        "environment": "cloud",
    }


def operator_tf_configs(
    manifest: Mapping[str, Any], *, cluster_domain: str | None = None
) -> dict[str, dict[str, Any] | None]:
    """Pod name ("<job>-<type>-<index>") -> that pod's TF_CONFIG, for every pod of a TFJob."""
    name, _, specs = _read_manifest(manifest)
    return {
        f"{name}-{replica_type.lower()}-{i}": operator_tf_config(
            manifest, task_type=replica_type, index=i, cluster_domain=cluster_domain
        )
        for replica_type, spec in specs.items()
        for i in range(_replicas(spec))
    }


def to_yaml(value: Any) -> str:
    """Block-style YAML for dicts (string keys), lists, strings, ints, bools and None.

    Deterministic (keys keep their order) and safe: a string is written plain only when no
    YAML reader could take it for anything else (a number, a bool, null, a date); otherwise
    it is double-quoted with escapes. Ends with a newline.
    """
    return "\n".join(_yaml_lines(value, 0)) + "\n"


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, Mapping) and value:
        lines = []
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"to_yaml() takes string keys only. Received: key={key!r}")
            head = f"{pad}{_yaml_scalar(key)}:"
            if _is_block(item):
                # A list under a key sits at the key's indent, as kubectl writes it.
                lines.append(head)
                lines.extend(_yaml_lines(item, indent if isinstance(item, list) else indent + 2))
            else:
                lines.append(f"{head} {_yaml_scalar(item)}")
        return lines
    if isinstance(value, list | tuple) and value:
        lines = []
        for item in value:
            if _is_block(item):
                nested = _yaml_lines(item, indent + 2)
                nested[0] = f"{pad}- {nested[0][indent + 2 :]}"
                lines.extend(nested)
            else:
                lines.append(f"{pad}- {_yaml_scalar(item)}")
        return lines
    return [pad + _yaml_scalar(value)]


def _is_block(value: Any) -> bool:
    return isinstance(value, Mapping | list | tuple) and len(value) > 0


# Plain scalars that YAML 1.1 or 1.2 readers resolve to something other than a string.
_YAML_RESERVED = {"true", "false", "yes", "no", "on", "off", "y", "n", "null", "~", ""}
# Letters first, then only characters with no meaning in a plain scalar: no ':', '#', ' '.
_YAML_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*")


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, Mapping):
        return "{}"
    if isinstance(value, list | tuple):
        return "[]"
    if not isinstance(value, str):
        raise TypeError(
            f"to_yaml() writes dicts, lists, str, int, bool and None. Received: {value!r}"
        )
    if _YAML_PLAIN.fullmatch(value) and value.lower() not in _YAML_RESERVED:
        return value
    return '"' + "".join(_yaml_escape(c) for c in value) + '"'


_YAML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _yaml_escape(char: str) -> str:
    if char in _YAML_ESCAPES:
        return _YAML_ESCAPES[char]
    code = ord(char)
    # YAML's printable set, less the characters YAML 1.1 reads as line breaks (NEL, LS, PS)
    # and the byte-order mark; anything else (controls, DEL, C1, surrogates) is escaped.
    if 0x20 <= code <= 0x7E or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029)):
        return char
    if (0xE000 <= code <= 0xFFFD and code != 0xFEFF) or 0x10000 <= code <= 0x10FFFF:
        return char
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The last value given to an absl flag in `args` (--flag=v, --flag v, -flag=v), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == "--":
            break  # absl stops reading flags here
        for prefix in (f"--{flag}", f"-{flag}"):
            if arg.startswith(prefix + "="):
                value = arg[len(prefix) + 1 :]
            elif arg == prefix and i + 1 < len(args):
                value = args[i + 1]
    return value


def _example_layout(strategy: str) -> str:
    if strategy == "parameter_server":
        return "chief=1, workers=2, ps=1"
    return "workers=2"


def _read_manifest(manifest: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    if not isinstance(manifest, Mapping) or manifest.get("kind") != KIND:
        kind = manifest.get("kind") if isinstance(manifest, Mapping) else type(manifest).__name__
        raise TFJobError(f"expected a TFJob manifest (kind: {KIND}). Received: kind={kind!r}")
    metadata = manifest.get("metadata") or {}
    specs = (manifest.get("spec") or {}).get("tfReplicaSpecs")
    if not isinstance(specs, Mapping) or not specs:
        raise TFJobError("the TFJob has no spec.tfReplicaSpecs; list its replica types there.")
    if (manifest.get("spec") or {}).get("enableDynamicWorker"):
        raise TFJobError(
            "enableDynamicWorker jobs get a sparse TF_CONFIG, which operator_tf_config does "
            "not model; remove enableDynamicWorker to check this job."
        )
    if "name" not in metadata:
        raise TFJobError("the TFJob has no metadata.name; the pods' host names start with it.")
    return metadata["name"], metadata.get("namespace") or "default", specs


def _replicas(spec: Mapping[str, Any]) -> int:
    replicas = spec.get("replicas")
    return 1 if replicas is None else int(replicas)  # the operator's default is 1


def _port(spec: Mapping[str, Any]) -> int:
    containers = (spec.get("template") or {}).get("spec", {}).get("containers") or []
    for container in containers:
        if container.get("name") == CONTAINER_NAME:
            for port in container.get("ports") or []:
                if port.get("name") == PORT_NAME:
                    return int(port["containerPort"])
    return DEFAULT_PORT
