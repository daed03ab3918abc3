"""Checks a multi-process strategy makes of the cluster before building anything."""

from __future__ import annotations

from tfdist.cluster import ClusterInfo
from tfdist.layout import Layout, LayoutError, launch_flags, validate_layout
from tfdist.strategies.options import StrategyError


def require_cluster(
    name: str, cluster: ClusterInfo | None, *, need: str, launch_flags: str
) -> ClusterInfo:
    """The cluster, if `name` can train in it; StrategyError with the launch command if not."""
    if cluster is None:
        raise StrategyError(
            f"The {name!r} strategy needs a cluster ({need}) but TF_CONFIG is not set. Start "
            f"the job with a launcher that sets TF_CONFIG for every process, e.g. "
            f"`tfdist-launch {launch_flags} -- python my_train.py`, or "
            f"use 'mirrored' to train on this host alone."
        )
    if cluster.is_evaluator:
        raise StrategyError(
            f"This task is the evaluator, which does not join {name!r} training; build "
            f"'one_device' (or 'auto') in the evaluator. Received: task={cluster.task_name}"
        )
    return cluster


def check_layout(cluster: ClusterInfo, strategy: str) -> None:
    """Raises StrategyError if the cluster's tasks do not fit `strategy` (layout rules)."""
    try:
        validate_layout(Layout.of_cluster(cluster.cluster), strategy=strategy, spell=_launch_spell)
    except LayoutError as error:
        raise StrategyError(f"The cluster in {cluster.source} does not fit: {error}") from None


def _launch_spell(layout: Layout) -> str:
    return f"tfdist-launch {launch_flags(layout)} -- python my_train.py"
