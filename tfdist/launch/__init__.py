"""tfdist-launch: a TensorFlow cluster as local processes, one per task, each with its TF_CONFIG.

The command-line tool is `tfdist-launch` (installed with the package; `python -m tfdist.launch`
runs the same). In Python:

    from tfdist.launch import Launcher, plan_cluster
    _, tasks = plan_cluster(workers=2)
    exit_code = Launcher(["python", "train.py"], tasks=tasks, max_restarts=3).run()
"""

from tfdist.launch.cli import main
from tfdist.launch.plan import (
    Task,
    UsageError,
    cluster_of,
    plan_cluster,
    reclaim_ports,
    serving_tasks,
    tf_config_for,
)
from tfdist.launch.supervisor import EXIT_TIMEOUT, EXIT_USAGE, Launcher

__all__ = [
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "Launcher",
    "Task",
    "UsageError",
    "cluster_of",
    "main",
    "plan_cluster",
    "reclaim_ports",
    "serving_tasks",
    "tf_config_for",
]
