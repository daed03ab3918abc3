"""The TF_CONFIG of a task that Slurm's `srun` started: one task per process, on many hosts.

    #SBATCH --nodes=2 --ntasks-per-node=2
    srun python -m experiments.train --strategy=multi_worker_mirrored --model_dir=/shared/run

`srun` starts every task of the step with SLURM_PROCID (its rank), SLURM_NTASKS, the step's
hosts (SLURM_STEP_NODELIST, in Slurm's compressed form "node[01-02]") and how many tasks each
host runs (SLURM_STEP_TASKS_PER_NODE, e.g. "2(x2)"). With the default block distribution,
ranks fill each host in turn, so rank r runs on the host whose range holds r, as local task
SLURM_LOCALID. Each task listens on TFDIST_SLURM_PORT (default 8888, TensorFlow's
SlurmClusterResolver's base) plus its local id. Every task is a worker (multi_worker_mirrored);
TFDIST_SLURM_PS=M makes the first rank the chief and the next M ranks parameter servers, for
parameter-server training.

This module imports nothing heavy (the launcher and the TF_CONFIG checker read it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from tfdist.errors import TfdistError

PORT_ENV = "TFDIST_SLURM_PORT"
PS_ENV = "TFDIST_SLURM_PS"
DEFAULT_PORT = 8888  # TensorFlow's SlurmClusterResolver's port_base

# What srun sets in every task of a step (sbatch alone sets the job's, not a step's).
_REQUIRED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


class SlurmEnvError(TfdistError, ValueError):
    """Slurm's variables describe no cluster tfdist can run."""


def slurm_tf_config(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The TF_CONFIG (as a dict) of this srun task, or None when Slurm started no step of
    several tasks here (outside Slurm, under sbatch alone, or a step of one task).

    Raises:
      SlurmEnvError: the variables are inconsistent (the message names the variable).
    """
    if not all(name in environ for name in _REQUIRED):
        return None
    rank, ntasks, local = (_whole(environ, name) for name in _REQUIRED)
    if ntasks < 2:
        return None
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not per_node:
        raise SlurmEnvError(
            "SLURM_PROCID is set but SLURM_STEP_NODELIST or SLURM_STEP_TASKS_PER_NODE is "
            "not: start the tasks with srun (which sets them), or set TF_CONFIG yourself."
        )
    hosts = expand_hostlist(nodelist)
    counts = expand_tasks_per_node(per_node)
    if len(counts) != len(hosts) or sum(counts) != ntasks:
        raise SlurmEnvError(
            f"SLURM_STEP_TASKS_PER_NODE={per_node!r} gives {sum(counts)} tasks on "
            f"{len(counts)} hosts, but the step has SLURM_NTASKS={ntasks} tasks on "
            f"{len(hosts)} hosts ({nodelist}). Received: the environment of rank {rank}"
        )
    port = _whole(environ, PORT_ENV, default=DEFAULT_PORT)
    addresses = [f"{host}:{port + i}" for host, count in zip(hosts, counts, strict=True)
                 for i in range(count)]  # fmt: skip
    if not 0 <= rank < ntasks or not addresses[rank].endswith(f":{port + local}"):
        raise SlurmEnvError(
            f"Rank {rank} (local id {local}) does not fall where the block distribution puts "
            f"it on {nodelist} with {per_node} tasks per host. tfdist needs srun's default "
            "--distribution=block; set TF_CONFIG yourself for another one."
        )
    ps = _whole(environ, PS_ENV, default=0)
    if ps == 0:
        return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
    if ps > ntasks - 2:
        raise SlurmEnvError(
            f"{PS_ENV}={ps} leaves no worker: parameter-server training needs a chief, 1+ "
            f"workers and the ps among the {ntasks} tasks. Received: {PS_ENV}={ps}"
        )
    roles = [("chief", 0)] + [("ps", i) for i in range(ps)]
    roles += [("worker", i) for i in range(ntasks - 1 - ps)]
    cluster: dict[str, list[str]] = {}
    for (task_type, _), address in zip(roles, addresses, strict=True):
        cluster.setdefault(task_type, []).append(address)
    task_type, index = roles[rank]
    return {"cluster": cluster, "task": {"type": task_type, "index": index}}


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: "gpu[01-03,7],cpu1" -> gpu01 gpu02 gpu03 gpu7 cpu1.

    Ranges keep their zero padding, as Slurm's own `scontrol show hostnames` does.
    """
    hosts = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,\[]*", text):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if match is None:
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not low.isdigit() or (high and not high.isdigit()):
                raise SlurmEnvError(f"Cannot read the Slurm host list {text!r} at {part!r}.")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{len(low)}d}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node, expanded: "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise SlurmEnvError(f"Cannot read Slurm's tasks per node {text!r} at {part!r}.")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _whole(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None and default is not None:
        return default
    if value is None or not value.strip().isdecimal():
        raise SlurmEnvError(
            f"{name} must be a whole number 0 or more, as srun sets it. Received: {name}={value!r}"
        )
    return int(value)
