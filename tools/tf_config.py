"""Check a TF_CONFIG: print this task's role, or the one clear error and exit non-zero.

Run it in a pod (or any process a launcher started) to see what tfdist will make of its
environment before a training job waits on a wrong cluster:

  python -m tools.tf_config                       # reads TF_CONFIG (or a JobSet pod's variables)
  python -m tools.tf_config --tf_config '{"cluster": ..., "task": ...}'

Exit codes: 0 valid (or unset: a single-host job), 2 invalid.
"""

from __future__ import annotations

import argparse
import sys

from tfdist.cluster import cluster_from_environment, parse_tf_config
from tfdist.errors import TfdistError
from tfdist.roles import is_server_role

EXIT_INVALID = 2


def role_of(info) -> str:
    """What this task does in the job, in words."""
    if info.is_evaluator:
        return "evaluates checkpoints; does not join training"
    if is_server_role(info):
        return "serves: runs a tf.distribute.Server that the chief's coordinator drives"
    if info.is_chief:
        return "trains, and as chief writes checkpoints, summaries and the exported model"
    return "trains"


def summary(info) -> str:
    """A few aligned lines describing a parsed TF_CONFIG."""
    strategy = "one_device" if info.is_evaluator else info.cluster_strategy
    rows = [
        ("task", f"{info.task_name} at {info.address or '(not listed in the cluster)'}"),
        ("chief", "yes" if info.is_chief else "no"),
        ("role", role_of(info)),
        ("cluster", info.task_counts() + (" (sparse: dynamic workers)" if info.sparse else "")),
        ("'auto' builds", strategy or "whatever this host's hardware calls for (one worker)"),
        ("rpc layer", info.rpc_layer),
    ]
    if info.environment:
        rows.append(("environment", info.environment))
    return "\n".join(f"  {name:<15}{value}" for name, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.tf_config",
        description="Validate a TF_CONFIG and print this task's role in the cluster.",
    )
    parser.add_argument(
        "--tf_config",
        help="a TF_CONFIG JSON string to check instead of the TF_CONFIG environment variable",
    )
    args = parser.parse_args(argv)
    source = "the --tf_config flag" if args.tf_config is not None else None
    try:
        if args.tf_config is not None:
            info = parse_tf_config(args.tf_config, source=source)
        else:
            info = cluster_from_environment()
            source = info.source if info is not None else None
    except TfdistError as e:  # TFConfigError, or a JobSet environment that is malformed
        print(f"error: {e}", file=sys.stderr)
        return EXIT_INVALID
    if info is None:
        print("No cluster in the environment (no TF_CONFIG, no JobSet): a single-host job.")
        return 0
    print(f"TF_CONFIG from {source} is valid:")
    print(summary(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
