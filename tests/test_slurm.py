"""tfdist.slurm: the TF_CONFIG of a task srun started, from the variables srun sets."""

from __future__ import annotations

import json

import pytest

import tfdist
from tfdist.slurm import SlurmEnvError, expand_hostlist, expand_tasks_per_node

pytestmark = pytest.mark.fast


def srun_env(rank: int, *, nodes="node[01-02]", per_node="2(x2)", ntasks=4, **extra) -> dict:
    """What srun sets in task `rank` of a step of 2 nodes x 2 tasks (block distribution)."""
    counts = expand_tasks_per_node(per_node)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    node = max(i for i, start in enumerate(starts) if start <= rank)
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank - starts[node]),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_STEP_NODELIST": nodes,
        "SLURM_JOB_NODELIST": nodes,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_TASKS_PER_NODE": per_node,
        **extra,
    }


WORKERS = ["node01:8888", "node01:8889", "node02:8888", "node02:8889"]


@pytest.mark.parametrize("rank", range(4))
def test_two_nodes_of_two_tasks_give_four_workers(rank):
    environ = srun_env(rank)
    info = tfdist.cluster_from_environment(environ)
    assert dict(info.cluster) == {"worker": tuple(WORKERS)}
    assert (info.task_type, info.task_index) == ("worker", rank)
    assert info.address == WORKERS[rank]
    assert info.is_chief is (rank == 0)
    assert info.cluster_strategy == "multi_worker_mirrored"
    # Exported, so TensorFlow's own resolver and the user's code see the same cluster.
    assert json.loads(environ["TF_CONFIG"]) == {
        "cluster": {"worker": WORKERS},
        "task": {"type": "worker", "index": rank},
    }
    assert "Slurm" in info.source


def test_parameter_servers_and_the_port_are_chosen_by_variables():
    roles = []
    for rank in range(4):
        environ = srun_env(rank, TFDIST_SLURM_PS="1", TFDIST_SLURM_PORT="2222")
        info = tfdist.cluster_from_environment(environ)
        roles.append(info.task_name)
    assert roles == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert dict(info.cluster) == {
        "chief": ("node01:2222",),
        "ps": ("node01:2223",),
        "worker": ("node02:2222", "node02:2223"),
    }
    assert info.cluster_strategy == "parameter_server"


def test_outside_a_step_of_several_tasks_there_is_no_cluster():
    assert tfdist.cluster_from_environment({}) is None
    assert tfdist.cluster_from_environment(srun_env(0, per_node="1", nodes="n1", ntasks=1)) is None
    # TF_CONFIG, when set, wins over Slurm's variables.
    given = {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}
    environ = {**srun_env(0), "TF_CONFIG": json.dumps(given)}
    assert tfdist.cluster_from_environment(environ).task_name == "worker:1"


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-02]", ["node01", "node02"]),
        ("gpu[08-10,3],cpu1", ["gpu08", "gpu09", "gpu10", "gpu3", "cpu1"]),
        ("a1,b[7]", ["a1", "b7"]),
    ],
)
def test_host_lists_expand_as_scontrol_shows_them(text, hosts):
    assert expand_hostlist(text) == hosts


def test_inconsistent_variables_are_one_clear_error():
    with pytest.raises(
        SlurmEnvError, match=r"gives 3 tasks on 2 hosts, but the step has SLURM_NTASKS=4"
    ):
        tfdist.cluster_from_environment(srun_env(0, per_node="2,1"))
    with pytest.raises(SlurmEnvError, match=r"SLURM_PROCID must be a whole number"):
        tfdist.cluster_from_environment({**srun_env(0), "SLURM_PROCID": "x"})
    with pytest.raises(SlurmEnvError, match="TFDIST_SLURM_PS=3 leaves no worker"):
        tfdist.cluster_from_environment(srun_env(0, TFDIST_SLURM_PS="3"))
