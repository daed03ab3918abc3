"""JobSet manifests (jobset.x-k8s.io/v1alpha2) for tfdist jobs.

JobSet is the Kubernetes API for a group of Jobs that form one workload; Kubeflow Trainer
builds on it, and GKE runs multi-host TPU training with it. `jobset_manifest` writes one
replicated job per task type (chief, worker, ps, evaluator), each a single Indexed Job whose
pods are that type's tasks, so task i of type t is reachable as
``<name>-<t>-0-<i>.<subdomain>``. Each container's environment carries what its pod needs to
compute TF_CONFIG (`tfdist.k8s.jobset_env`); `tfdist.cluster.cluster_from_environment`, which
`build_strategy("auto")` and `serve_if_needed` use, does so when TF_CONFIG is not set.

What JobSet does with the manifest, as read from its controller and webhook
(kubernetes-sigs/jobset: pkg/controllers/jobset_controller.go, pkg/webhooks/jobset_webhook.go,
api/jobset/v1alpha2/jobset_types.go):

- With ``network.enableDNSHostnames`` it sets every pod's subdomain and creates a headless
  Service named after the subdomain, selecting the JobSet's pods, owned by the JobSet (so it
  goes when the JobSet is deleted) and publishing addresses before pods are ready. tfdist
  therefore writes no Service of its own: one written beside the JobSet would be created
  before it, could not be owned by it, and would outlive it.
- Pods carry the labels and annotations jobset-name, replicatedjob-name and job-index
  (prefix ``jobset.sigs.k8s.io/``); the containers read the annotations through downward-API
  fieldRefs, and the NetworkPolicy (`tfdist.k8s.network_policy`) selects the pods by the
  jobset-name label.
- The webhook refuses a JobSet whose longest pod name (``<name>-<type>-0-<i>`` plus a 5
  character suffix) passes 63 characters, and a subdomain that is not a DNS-1035 label.
- When the success policy is met, or the JobSet fails, the controller deletes the Jobs still
  running: the worker and ps servers of parameter-server training, which never exit.

Failures: a failed pod fails its Job (backoffLimit 0, restartPolicy Never) and JobSet then
restarts the whole JobSet, every task together, at most `max_restarts` times; with
``--model_dir`` on shared storage the job resumes from its last checkpoint. As with the TFJob
writer's ExitCode policy, only failures a restart can cure are retried: a pod that
Kubernetes disrupted (preemption, node drain), that SIGKILL or SIGTERM ended (exit 137 or
143: the OOM killer, an eviction), or that tfdist ended with 143 after saving its state. Any
other exit code is the program's own failure (a bug, a usage error): the pod failure policy
fails its Job, and the JobSet's failure policy fails the JobSet at once.
"""

from __future__ import annotations

from typing import Any

from tfdist.exit_codes import KUBERNETES_RESTARTABLE_EXIT, RESTARTABLE_EXIT_ENV
from tfdist.k8s.job import CONTAINER_NAME, ManifestError, TrainingJob, is_dns_1035_label
from tfdist.k8s.jobset_env import (
    COMPLETION_INDEX_ENV,
    JOB_INDEX_ENV,
    NAME_ENV,
    REPLICATED_JOB_ENV,
    container_env,
    host_name,
    jobset_tf_config,
)

API_VERSION = "jobset.x-k8s.io/v1alpha2"
KIND = "JobSet"
PORT_NAME = "tfdist"
# JobSet labels every pod of a JobSet with its name (and the replicated job, job index, ...).
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
DEFAULT_MAX_RESTARTS = 3
# Exit codes a restart may cure: killed by SIGKILL (the OOM killer, a grace period run out)
# or SIGTERM, which is also what tfdist exits with after saving its state
# (TFDIST_RESTARTABLE_EXIT_CODE, tfdist.exit_codes).
RESTARTABLE_EXIT_CODES = (137, KUBERNETES_RESTARTABLE_EXIT)
PROGRAM_ERROR_RULE = "ProgramError"
# A pod's name is its Job's, the index, and 5 random characters; JobSet's webhook counts them.
_POD_NAME_SUFFIX = "-abcde"


def jobset_manifest(
    job: TrainingJob, *, max_restarts: int = DEFAULT_MAX_RESTARTS, subdomain: str | None = None
) -> dict[str, Any]:
    """The JobSet manifest for `job`, as plain dicts and lists (render with yaml or json).

    Args:
      job: the training job.
      max_restarts: how many times JobSet may restart the whole job after a failure a
        restart can cure, before it fails the JobSet.
      subdomain: the pods' DNS subdomain and the name of the headless Service JobSet makes;
        the job's name by default.

    Returns:
      The manifest: a JobSet whose success follows the chief (worker 0's Job without one).
      Apply `tfdist.k8s.network_policy(manifest)` beside it to admit only its own pods.

    Raises:
      ManifestError: a name that would make a pod name or the subdomain too long, or a
        bad `max_restarts` or `subdomain`.
    """
    subdomain = _check(job, max_restarts=max_restarts, subdomain=subdomain)
    env = [
        *container_env(layout=job.layout, subdomain=subdomain, port=job.port),
        {"name": RESTARTABLE_EXIT_ENV, "value": str(KUBERNETES_RESTARTABLE_EXIT)},
    ]
    replicated_jobs = [
        _replicated_job(job, task_type, tasks, env)
        for task_type, tasks in job.layout.counts().items()
    ]
    # The job's outcome is the chief's, as TensorFlow's: worker 0 is chief when there is none.
    outcome = "chief" if job.layout.chief else "worker"
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": job.name, "namespace": job.namespace},
        "spec": {
            # With DNS host names on, JobSet makes and owns the headless Service named after
            # the subdomain; tfdist writes none (see the module notes for why).
            "network": {
                "enableDNSHostnames": True,
                "subdomain": subdomain,
                # Tasks look each other up while starting, before any of them is ready.
                "publishNotReadyAddresses": True,
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [outcome]},
            "failurePolicy": {
                "maxRestarts": max_restarts,
                # Failures no rule matches restart the JobSet (JobSet's default action).
                "rules": [
                    {
                        "name": PROGRAM_ERROR_RULE,
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    }
                ],
            },
            "replicatedJobs": replicated_jobs,
        },
    }


def jobset_tf_configs(job: TrainingJob, *, subdomain: str | None = None) -> dict[str, Any]:
    """Host name -> the TF_CONFIG that pod derives, for every pod of `job`'s JobSet.

    Each pod's environment is built as JobSet and Kubernetes fill it in (the annotations'
    values, the completion index) and read back with `jobset_tf_config`.
    """
    subdomain = _check(job, max_restarts=DEFAULT_MAX_RESTARTS, subdomain=subdomain)
    static = {
        entry["name"]: entry["value"]
        for entry in container_env(layout=job.layout, subdomain=subdomain, port=job.port)
        if "value" in entry
    }
    configs = {}
    for task_type, tasks in job.layout.counts().items():
        for index in range(tasks):
            environ = {
                **static,
                NAME_ENV: job.name,
                REPLICATED_JOB_ENV: task_type,
                JOB_INDEX_ENV: "0",
                COMPLETION_INDEX_ENV: str(index),
            }
            configs[host_name(job.name, task_type, index, subdomain)] = jobset_tf_config(environ)
    return configs


def _replicated_job(
    job: TrainingJob, task_type: str, tasks: int, env: list[dict[str, Any]]
) -> dict[str, Any]:
    pod_spec = job.pod_spec(port_name=PORT_NAME, env=env, task_type=task_type)
    return {
        "name": task_type,
        "replicas": 1,
        "template": {
            "spec": {
                "completionMode": "Indexed",  # pods get JOB_COMPLETION_INDEX and stable names
                "parallelism": tasks,
                "completions": tasks,
                # One failed pod fails the Job, and JobSet's failure policy takes over: a
                # TensorFlow cluster restarts as a whole.
                "backoffLimit": 0,
                "podFailurePolicy": {
                    "rules": [
                        # Kubernetes took the pod away: never the program's fault.
                        {"action": "Count", "onPodConditions": [{"type": "DisruptionTarget"}]},
                        {
                            "action": "FailJob",
                            "onExitCodes": {
                                "containerName": CONTAINER_NAME,
                                "operator": "NotIn",
                                "values": list(RESTARTABLE_EXIT_CODES),
                            },
                        },
                    ]
                },
                "template": {
                    # A pod failure policy needs pods that Kubernetes never restarts in place.
                    "spec": {"restartPolicy": "Never", **pod_spec},
                },
            }
        },
    }


def _check(job: TrainingJob, *, max_restarts: int, subdomain: str | None) -> str:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ManifestError(
            "max_restarts must be a whole number, 0 or more. "
            f"Received: max_restarts={max_restarts!r}"
        )
    longest = max(
        (f"{job.name}-{t}-0-{n - 1}" for t, n in job.layout.counts().items()),
        key=len,
    )
    job.check_name_fits(longest + _POD_NAME_SUFFIX, what="pod name (with its random suffix)")
    if subdomain is None:
        return job.name
    if not is_dns_1035_label(subdomain):
        raise ManifestError(
            "subdomain must be a DNS-1035 label of at most 63 characters: lower-case letters, "
            f"digits and '-', starting with a letter. Received: subdomain={subdomain!r}"
        )
    return subdomain


__all__ = [
    "API_VERSION",
    "DEFAULT_MAX_RESTARTS",
    "JOBSET_NAME_LABEL",
    "KIND",
    "RESTARTABLE_EXIT_CODES",
    "jobset_manifest",
    "jobset_tf_configs",
]
