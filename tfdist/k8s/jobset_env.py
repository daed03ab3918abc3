"""TF_CONFIG inside a JobSet pod, derived from what JobSet and tfdist-k8s put in its environment.

JobSet, unlike Kubeflow's TFJob operator, writes no TF_CONFIG: it tells each pod where it
stands through labels and annotations, and the Job controller adds JOB_COMPLETION_INDEX.
`tfdist-k8s jobset` hands those facts to the container as environment variables (downward-API
field references to JobSet's annotations) beside static ones of its own, and
`jobset_tf_config` turns them back into the TF_CONFIG that Kubeflow's operator would have
written. `tfdist.cluster.cluster_from_environment` calls it when TF_CONFIG is not set.

The contract, one variable per fact (annotations are JobSet's, jobset.sigs.k8s.io/...):

  TFDIST_JOBSET_NAME            the JobSet's name          from the annotation .../jobset-name
  TFDIST_JOBSET_REPLICATED_JOB  this pod's task type       from .../replicatedjob-name
  TFDIST_JOBSET_JOB_INDEX       its Job within it (0)      from .../job-index
  JOB_COMPLETION_INDEX          the task index             set by Kubernetes (Indexed Job)
  TFDIST_JOBSET_SUBDOMAIN       the pods' DNS subdomain    static, written in the manifest
  TFDIST_JOBSET_PORT            every task's gRPC port     static
  TFDIST_JOBSET_TASKS           the layout, e.g. "chief=1,worker=2,ps=1"    static

tfdist-k8s names each replicated job after its task type and runs it as one Indexed Job
(replicas 1, parallelism = completions = the number of tasks), so task i of type t is the
pod with host name ``<jobset>-<t>-0-<i>`` in the subdomain: JobSet's
``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>``. Nothing here imports
TensorFlow or touches os.environ.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tfdist.errors import TfdistError
from tfdist.layout import TASK_TYPES, Layout

NAME_ENV = "TFDIST_JOBSET_NAME"
REPLICATED_JOB_ENV = "TFDIST_JOBSET_REPLICATED_JOB"
JOB_INDEX_ENV = "TFDIST_JOBSET_JOB_INDEX"
COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
SUBDOMAIN_ENV = "TFDIST_JOBSET_SUBDOMAIN"
PORT_ENV = "TFDIST_JOBSET_PORT"
TASKS_ENV = "TFDIST_JOBSET_TASKS"

# Annotations JobSet's controller puts on every pod it creates (api/jobset/v1alpha2).
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
# Variable -> the pod annotation a downward-API fieldRef copies into it.
FIELD_REFS = {
    NAME_ENV: JOBSET_NAME_KEY,
    REPLICATED_JOB_ENV: REPLICATED_JOB_KEY,
    JOB_INDEX_ENV: JOB_INDEX_KEY,
}
# Every variable the derivation reads; those named TFDIST_JOBSET_* say "this is a tfdist JobSet".
REQUIRED_ENV = (
    NAME_ENV,
    REPLICATED_JOB_ENV,
    JOB_INDEX_ENV,
    COMPLETION_INDEX_ENV,
    SUBDOMAIN_ENV,
    PORT_ENV,
    TASKS_ENV,
)
_MARKERS = tuple(name for name in REQUIRED_ENV if name.startswith("TFDIST_JOBSET_"))
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class JobSetEnvError(TfdistError, ValueError):
    """A JobSet pod's environment that describes no cluster; the message says what and the fix."""


def tasks_value(layout: Layout) -> str:
    """The TFDIST_JOBSET_TASKS value for `layout`, e.g. 'chief=1,worker=2,ps=1'."""
    return ",".join(f"{task_type}={n}" for task_type, n in layout.counts().items())


def host_name(jobset: str, task_type: str, index: int, subdomain: str) -> str:
    """The DNS name of task `index` of `task_type`: its pod's host name in the subdomain."""
    return f"{jobset}-{task_type}-0-{index}.{subdomain}"


def container_env(*, layout: Layout, subdomain: str, port: int) -> list[dict[str, Any]]:
    """The env entries tfdist-k8s gives every JobSet container (JOB_COMPLETION_INDEX excluded:
    Kubernetes sets it in every pod of an Indexed Job)."""
    env: list[dict[str, Any]] = [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{key}']"}}}
        for name, key in FIELD_REFS.items()
    ]
    env += [
        {"name": SUBDOMAIN_ENV, "value": subdomain},
        {"name": PORT_ENV, "value": str(port)},
        {"name": TASKS_ENV, "value": tasks_value(layout)},
    ]
    return env


def jobset_tf_config(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The TF_CONFIG a JobSet pod written by tfdist-k8s stands for, from its environment.

    Args:
      environ: the pod's environment, e.g. os.environ.

    Returns:
      TF_CONFIG as a dict (every task of the layout listed, the evaluator included, and this
      pod's task), or None when no TFDIST_JOBSET_* variable is set: not a tfdist JobSet pod.

    Raises:
      JobSetEnvError: some of the variables are set but not all, or one holds a value no
        manifest of tfdist-k8s would give it.
    """
    if not any(name in environ for name in _MARKERS):
        return None
    missing = [name for name in REQUIRED_ENV if not environ.get(name, "").strip()]
    if missing:
        present = ", ".join(f"{n}={environ[n]!r}" for n in REQUIRED_ENV if n in environ)
        raise JobSetEnvError(
            f"Incomplete JobSet environment: {', '.join(missing)} not set (or empty), so this "
            "pod cannot tell its place in the job. `tfdist-k8s jobset` sets all of "
            f"{', '.join(REQUIRED_ENV)} in every pod (JOB_COMPLETION_INDEX comes from an "
            "Indexed Job): apply the manifest it writes, set TF_CONFIG instead, or unset the "
            f"TFDIST_JOBSET_* variables to train on this host alone. Received: {present}"
        )
    values = {name: environ[name].strip() for name in REQUIRED_ENV}
    counts = _tasks(values[TASKS_ENV])
    task_type = values[REPLICATED_JOB_ENV]
    if task_type not in counts:
        raise _fail(
            REPLICATED_JOB_ENV,
            values,
            f"the replicated job is not one of the job's task types "
            f"({', '.join(counts)}); tfdist-k8s names each replicated job after its task type",
        )
    if values[JOB_INDEX_ENV] != "0":
        raise _fail(
            JOB_INDEX_ENV,
            values,
            "tfdist-k8s runs each task type as one Indexed Job (replicas: 1), whose pods are "
            "the tasks; a replicated job with more replicas is not a layout tfdist derives",
        )
    index = _whole(COMPLETION_INDEX_ENV, values)
    if index >= counts[task_type]:
        raise _fail(
            COMPLETION_INDEX_ENV,
            values,
            f"the job has {counts[task_type]} {task_type} task(s), so the index must be "
            f"below {counts[task_type]}; set the Job's completions to {TASKS_ENV}'s count",
        )
    port = _whole(PORT_ENV, values)
    if not 1 <= port <= 65535:
        raise _fail(PORT_ENV, values, "a port is a number from 1 to 65535")
    for name in (NAME_ENV, SUBDOMAIN_ENV):
        if not _DNS_LABEL.fullmatch(values[name]):
            raise _fail(name, values, "expected a DNS label (lower-case letters, digits, '-')")
    jobset, subdomain = values[NAME_ENV], values[SUBDOMAIN_ENV]
    cluster = {
        t: [f"{host_name(jobset, t, i, subdomain)}:{port}" for i in range(n)]
        for t, n in counts.items()
    }
    return {"cluster": cluster, "task": {"type": task_type, "index": index}}


def _tasks(value: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in value.split(","):
        task_type, sep, count = item.strip().partition("=")
        if (
            not sep
            or task_type not in TASK_TYPES
            or task_type in counts
            or not count.isdecimal()
            or int(count) < 1
        ):
            raise JobSetEnvError(
                f"Invalid {TASKS_ENV}: expected each task type once with its count, from "
                f"{', '.join(TASK_TYPES)}, e.g. 'chief=1,worker=2,ps=1'. "
                f"Received: {TASKS_ENV}={value!r}"
            )
        counts[task_type] = int(count)
    return {t: counts[t] for t in TASK_TYPES if t in counts}


def _whole(name: str, values: Mapping[str, str]) -> int:
    if not values[name].isdecimal():
        raise _fail(name, values, "expected a whole number")
    return int(values[name])


def _fail(name: str, values: Mapping[str, str], why: str) -> JobSetEnvError:
    return JobSetEnvError(
        f"Invalid JobSet environment: {name}={values[name]!r} does not fit: {why}. Apply the "
        f"manifest `tfdist-k8s jobset` writes unchanged, or set TF_CONFIG instead. "
        f"Received: {', '.join(f'{n}={v!r}' for n, v in values.items())}"
    )
