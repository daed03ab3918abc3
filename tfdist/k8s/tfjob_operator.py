"""The TF_CONFIG Kubeflow's TFJob operator writes into each pod of a TFJob.

`operator_tf_config` computes it from any TFJob manifest, not only tfdist's, so the roles
tfdist will pick can be checked before anything is submitted:

    >>> from tfdist.k8s.job import TrainingJob
    >>> from tfdist.k8s.tfjob import tfjob_manifest
    >>> from tfdist.layout import Layout
    >>> manifest = tfjob_manifest(TrainingJob(name="digits", image="example.com/tfdist:1",
    ...     command=("python", "my_train.py"), layout=Layout(workers=2)))
    >>> operator_tf_config(manifest, task_type="worker", index=1)["cluster"]
    {'worker': ['digits-worker-0.default.svc:2222', 'digits-worker-1.default.svc:2222']}

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
  as the chief. Manifests written by tfdist use "Chief".
- A job of exactly one replica in all gets no TF_CONFIG ("local training"), so it trains as a
  single host. An evaluator counts: one worker plus an evaluator is a two-pod cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tfdist.k8s.job import CONTAINER_NAME, DEFAULT_PORT, ManifestError
from tfdist.k8s.tfjob import KIND, PORT_NAME


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
      ManifestError: the manifest is not a TFJob, lacks the replica type, or `index` is out
        of range.
    """
    name, namespace, specs = _read_manifest(manifest)
    replicas = {replica_type: _replicas(spec) for replica_type, spec in specs.items()}
    by_task = {replica_type.lower(): replica_type for replica_type in specs}
    if task_type.lower() not in by_task:
        raise ManifestError(
            f"the TFJob has no {task_type!r} replicas; it has {', '.join(specs)}. "
            f"Received: task_type={task_type!r}"
        )
    replica_type = by_task[task_type.lower()]
    if not 0 <= index < replicas[replica_type]:
        raise ManifestError(
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


def _read_manifest(manifest: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    if not isinstance(manifest, Mapping) or manifest.get("kind") != KIND:
        kind = manifest.get("kind") if isinstance(manifest, Mapping) else type(manifest).__name__
        raise ManifestError(f"expected a TFJob manifest (kind: {KIND}). Received: kind={kind!r}")
    metadata = manifest.get("metadata") or {}
    spec = manifest.get("spec") or {}
    specs = spec.get("tfReplicaSpecs")
    if not isinstance(specs, Mapping) or not specs:
        raise ManifestError("the TFJob has no spec.tfReplicaSpecs; list its replica types there.")
    if spec.get("enableDynamicWorker"):
        raise ManifestError(
            "enableDynamicWorker jobs get a sparse TF_CONFIG, which operator_tf_config does "
            "not model; remove enableDynamicWorker to check this job."
        )
    if "name" not in metadata:
        raise ManifestError("the TFJob has no metadata.name; the pods' host names start with it.")
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
