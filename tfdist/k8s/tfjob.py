"""Kubeflow TFJob manifests (kubeflow.org/v1) for tfdist jobs.

Kubeflow removed its TFJob operator (training-operator v1) from its main line in 2025, but
clusters that still run it take these manifests: the operator starts one pod per replica and
writes each pod's TF_CONFIG itself (`tfdist.k8s.tfjob_operator` models what it writes, so
the roles can be checked before anything is submitted).

Example:

    >>> from tfdist.layout import Layout
    >>> job = TrainingJob(name="digits", image="example.com/tfdist:1",
    ...                   command=("python", "my_train.py"), layout=Layout(workers=2))
    >>> tfjob_manifest(job)["spec"]["tfReplicaSpecs"]["Worker"]["replicas"]
    2

What the operator asks of a manifest (see tfjob_operator.py for what it gives the pods):

- The training container must be named "tensorflow"; its containerPort named "tfjob-port"
  is the port in TF_CONFIG (default 2222).
- A job of exactly one replica in all gets no TF_CONFIG ("local training"), so a
  multi-worker strategy cannot run in it; an evaluator counts as a replica.
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

from typing import Any

from tfdist.exit_codes import KUBERNETES_RESTARTABLE_EXIT, RESTARTABLE_EXIT_ENV
from tfdist.k8s.job import ManifestError, TrainingJob, k8s_flags
from tfdist.layout import MULTI_WORKER_STRATEGIES, example_layout

API_VERSION = "kubeflow.org/v1"
KIND = "TFJob"
PORT_NAME = "tfjob-port"  # the operator puts the port of this name in TF_CONFIG
# The training-operator labels each pod with its job's name (kubeflow/training-operator:
# JobController.GenLabels). Other Kubeflow jobs (PyTorchJob, ...) use the same label, so one
# of the same name in the same namespace would be selected too.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
# Task type -> TFJob replica type, in the order pods are listed.
REPLICA_TYPES = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}
# ExitCode: a signal-killed pod (preemption) is recreated, a failing program fails the job.
RESTART_POLICIES = ("ExitCode", "OnFailure", "Never")
DEFAULT_RESTART_POLICY = "ExitCode"


def tfjob_manifest(
    job: TrainingJob, *, restart_policy: str = DEFAULT_RESTART_POLICY
) -> dict[str, Any]:
    """The TFJob manifest for `job`, as plain dicts and lists (render with yaml or json).

    Args:
      job: the training job.
      restart_policy: one of RESTART_POLICIES, for every replica type.

    Returns:
      The manifest. Apply `tfdist.k8s.network_policy(manifest)` beside it to admit only its
      own pods.

    Raises:
      ManifestError: an unknown restart policy, a name that would make a pod name too long,
        or a multi-worker ``--strategy`` in a one-replica job, which the operator gives no
        TF_CONFIG.
    """
    _check(job, restart_policy)
    env = []
    if restart_policy == "ExitCode":
        # Preempted, a lost peer: exit with a code this policy retries (tfdist.exit_codes).
        env = [{"name": RESTARTABLE_EXIT_ENV, "value": str(KUBERNETES_RESTARTABLE_EXIT)}]
    specs: dict[str, Any] = {}
    for task_type, replicas in job.layout.counts().items():
        specs[REPLICA_TYPES[task_type]] = {
            "replicas": replicas,
            "restartPolicy": restart_policy,
            "template": {
                # Kubeflow's TFJob guide: pods do not work with Istio's sidecar injected, which
                # user namespaces of a Kubeflow install enable by default.
                "metadata": {"annotations": {"sidecar.istio.io/inject": "false"}},
                "spec": job.pod_spec(port_name=PORT_NAME, env=env, task_type=task_type),
            },
        }
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": {
            # Worker and ps servers never exit on their own: delete them when the job ends.
            "runPolicy": {"cleanPodPolicy": "Running"},
            "tfReplicaSpecs": specs,
        },
    }


def _check(job: TrainingJob, restart_policy: str) -> None:
    if restart_policy not in RESTART_POLICIES:
        raise ManifestError(
            f"unknown restart policy; valid ones are {', '.join(RESTART_POLICIES)}. "
            f"Received: restart_policy={restart_policy!r}"
        )
    longest = max((f"{job.name}-{t}-{n - 1}" for t, n in job.layout.counts().items()), key=len)
    job.check_name_fits(longest, what="pod and Service name")
    strategy = job.strategy_flag
    if sum(job.layout.counts().values()) == 1 and strategy in MULTI_WORKER_STRATEGIES:
        raise ManifestError(
            f"--strategy={strategy} needs a TF_CONFIG, but the TFJob operator gives a job of "
            f"one replica ({job.layout.describe()}) none, so the pod would fail: use "
            f"`{k8s_flags(example_layout(strategy))}`, or --strategy=auto. "
            f"Received: --strategy={strategy}"
        )
