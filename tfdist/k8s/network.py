"""The NetworkPolicy (networking.k8s.io/v1) that admits only a job's own pods to its tasks.

TensorFlow's gRPC servers accept any connection that reaches their port, and anything that
connects can run operations in them. `network_policy` closes the ports to everything but the
job itself: it selects the job's pods by the label their controller puts on every pod of the
job (JobSet's jobset-name, the training-operator's job-name), and admits ingress to them only
from those same pods and only on the ports their containers declare (tfdist's: ``--port``;
Kubernetes jobs need no rendezvous port). Everything else coming in is dropped once the policy
exists, where the cluster's network plugin enforces NetworkPolicy (most do; kubenet does not).

Egress stays open: the tasks reach each other on the admitted ports, and a job also needs
DNS, its storage (``gs://``, ``s3://``) and whatever else the program fetches, which no
policy written here could know.

    >>> from tfdist.k8s.job import TrainingJob
    >>> from tfdist.k8s.jobset import jobset_manifest
    >>> job = TrainingJob(name="digits", image="example.com/tfdist:1",
    ...                   command=("python", "my_train.py"))
    >>> network_policy(jobset_manifest(job))["spec"]["podSelector"]
    {'matchLabels': {'jobset.sigs.k8s.io/jobset-name': 'digits'}}
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from tfdist.k8s import jobset, tfjob
from tfdist.k8s.job import ManifestError

API_VERSION = "networking.k8s.io/v1"
KIND = "NetworkPolicy"
# Kind of job -> the label its controller puts on every pod, valued with the job's name.
POD_NAME_LABELS = {jobset.KIND: jobset.JOBSET_NAME_LABEL, tfjob.KIND: tfjob.JOB_NAME_LABEL}


def network_policy(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The NetworkPolicy admitting only `manifest`'s own pods to their ports.

    Args:
      manifest: a JobSet or TFJob manifest as written by `jobset_manifest` or
        `tfjob_manifest` (or decoded from YAML or JSON).

    Returns:
      The policy, named and namespaced as the job.

    Raises:
      ManifestError: `manifest` is neither a JobSet nor a TFJob, or declares no port.
    """
    kind = manifest.get("kind") if isinstance(manifest, Mapping) else None
    if kind not in POD_NAME_LABELS:
        raise ManifestError(
            f"expected a {' or '.join(POD_NAME_LABELS)} manifest. Received: kind={kind!r}"
        )
    metadata = manifest["metadata"]
    ports = sorted(
        {
            (port.get("protocol", "TCP"), port["containerPort"])
            for container in _containers(manifest)
            for port in container.get("ports", [])
        },
        key=lambda protocol_port: protocol_port[1],
    )
    if not ports:
        raise ManifestError(
            f"the {kind} {metadata['name']!r} declares no containerPort, so there is nothing "
            "for its tasks to reach each other on: give its container the port its servers use."
        )
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": metadata["name"],
            "namespace": metadata.get("namespace", "default"),
        },
        "spec": {
            "podSelector": _job_pods(kind, metadata["name"]),
            # Ingress only: egress stays open (DNS, storage; see the module notes).
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": _job_pods(kind, metadata["name"])}],
                    "ports": [{"protocol": protocol, "port": port} for protocol, port in ports],
                }
            ],
        },
    }


def _job_pods(kind: str, name: str) -> dict[str, Any]:
    # A new dict each time: a shared one would come out of PyYAML as an &id anchor.
    return {"matchLabels": {POD_NAME_LABELS[kind]: name}}


def _containers(manifest: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    spec = manifest.get("spec", {})
    if manifest["kind"] == jobset.KIND:
        templates = [rjob["template"]["spec"]["template"] for rjob in spec["replicatedJobs"]]
    else:
        templates = [replica["template"] for replica in spec["tfReplicaSpecs"].values()]
    for template in templates:
        yield from template["spec"]["containers"]


__all__ = ["API_VERSION", "KIND", "POD_NAME_LABELS", "network_policy"]
