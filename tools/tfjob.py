"""Write a Kubeflow TFJob manifest that runs experiments.train on Kubernetes.

Kubeflow's training-operator starts one pod per replica and gives each its TF_CONFIG; with
the default --strategy=auto every pod then takes its role from it. The flags after `--` are
experiments.train's: `python -m experiments.train` is put in front of them. The manifest goes
to stdout (pipe it to `kubectl apply -f -`) or to --out. Nothing here talks to a cluster.

examples:
  # synchronous training on 2 worker pods (MultiWorkerMirroredStrategy)
  python -m tools.tfjob --name digits --image example.com/tfdist:1 --workers 2 \\
      -- --config=digits_cnn --model_dir=/mnt/runs/digits
  # parameter-server training: the chief coordinates, workers and ps serve
  python -m tools.tfjob --name digits-ps --image example.com/tfdist:1 --chief 1 --workers 2 \\
      --ps 1 --cpu 2 --memory 4Gi -- --config=digits_cnn --model_dir=/mnt/runs/digits-ps
  # what each pod will see, without writing the manifest
  python -m tools.tfjob --name digits --image example.com/tfdist:1 --workers 2 --show_tf_config

roles (what --strategy=auto builds in each pod):
  workers only, 2 or more     multi_worker_mirrored in every worker (worker 0 is the chief)
  chief + workers             multi_worker_mirrored; the chief trains too and writes
  chief + workers + ps        parameter_server on the chief; workers and ps serve
  evaluator                   one_device (it never joins training). experiments.train has
                              no evaluate-only mode yet: the evaluator pod trains on its own
                              and, not being the chief, writes nothing.
  a single worker             one_device: the operator gives a one-pod job no TF_CONFIG

restart policy (--restart_policy, applied to every replica type):
  ExitCode   (default) the operator recreates a pod killed by a signal (exit 128-255:
             preemption, node drain, OOM kill) and fails the job on exit 1-127 (a bug or a
             usage error, which would only fail again). With --model_dir on storage every pod
             shares, a recreated job resumes from its last checkpoint. The pods get
             TFDIST_RESTARTABLE_EXIT_CODE=143, so a task that saved its state after SIGTERM,
             or lost a peer, exits 143 and is recreated too.
  OnFailure  the kubelet restarts any failed container in place, whatever the cause.
  Never      nothing is restarted; the first failure fails the job.

exit status: 0 written, 2 bad usage (one "tfjob: error: ..." line on stderr).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from tfdist.k8s import (
    DEFAULT_PORT,
    DEFAULT_RESTART_POLICY,
    RESTART_POLICIES,
    Resources,
    TFJobConfig,
    TFJobError,
    operator_tf_configs,
    tfjob_manifest,
    to_yaml,
)

EXIT_USAGE = 2
_EXAMPLE = "python -m tools.tfjob --name digits --image IMAGE --workers 2 -- --config=digits_cnn"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line, like tfdist's own errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"tfjob: error: {message}; see --help\n")


def render(manifest: dict, fmt: str) -> str:
    """The manifest as YAML or as JSON (kubectl accepts either)."""
    if fmt == "json":
        return json.dumps(manifest, indent=2) + "\n"
    return to_yaml(manifest)


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line and writes the manifest (or each pod's TF_CONFIG).

    Args:
      argv: the arguments after the program name; `sys.argv[1:]` by default.

    Returns:
      The exit code: 0, or 2 for bad usage.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` is experiments.train's, even flags this tool also has.
    split = argv.index("--") if "--" in argv else len(argv)
    args, unknown = _build_parser().parse_known_args(argv[:split])
    try:
        if unknown:
            raise TFJobError(
                f"unrecognised arguments {shlex.join(unknown)!r}: this tool's flags are listed "
                f"by --help, and experiments.train's go after `--`, e.g. `{_EXAMPLE}`"
            )
        config = TFJobConfig(
            name=args.name,
            image=args.image,
            namespace=args.namespace,
            chief=args.chief,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            port=args.port,
            resources=Resources(cpu=args.cpu, memory=args.memory, gpus=args.gpus),
            restart_policy=args.restart_policy,
            train_args=tuple(argv[split + 1 :]),
            workdir=args.workdir,
        )
    except TFJobError as error:
        print(f"tfjob: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    manifest = tfjob_manifest(config)
    if args.show_tf_config:
        for pod, tf_config in operator_tf_configs(manifest).items():
            print(f"{pod}: {json.dumps(tf_config) if tf_config else '(no TF_CONFIG: one pod)'}")
        return 0
    text = render(manifest, args.format)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text)
    print(
        f"Wrote {args.out}: TFJob {config.name} ({config.describe()}) in namespace "
        f"{config.namespace}; submit it with `kubectl apply -f {args.out}`"
    )
    return 0


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m tools.tfjob",
        usage="%(prog)s --name NAME --image IMAGE [--chief 0|1] [--workers N] [--ps M] "
        "[--evaluator 0|1] [options] [-- TRAIN_FLAGS ...]",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation could silently take a flag meant for training
    )
    add = parser.add_argument
    add("--name", required=True, help="the TFJob's name; pods are named NAME-TYPE-INDEX")
    add("--image", required=True, help="container image holding tfdist and experiments/")
    add("--namespace", default="default", help="Kubernetes namespace (default: default)")
    add("--chief", type=int, default=0, metavar="0|1", help="chief replicas (default: 0)")
    add("--workers", type=int, default=1, metavar="N", help="worker replicas (default: 1)")
    add("--ps", type=int, default=0, metavar="M", help="parameter-server replicas (default: 0)")
    add("--evaluator", type=int, default=0, metavar="0|1", help="evaluator replicas (default: 0)")
    add(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port of every task's gRPC server (default: {DEFAULT_PORT})",
    )
    add("--cpu", help="CPU limit per pod, e.g. 4 or 500m (default: none)")
    add("--memory", help="memory limit per pod, e.g. 8Gi (default: none)")
    add(
        "--gpus",
        type=int,
        default=0,
        metavar="N",
        help="GPUs per pod that computes: workers, evaluator, and the chief unless it only "
        "coordinates parameter-server training (default: 0)",
    )
    add(
        "--restart_policy",
        default=DEFAULT_RESTART_POLICY,
        metavar="|".join(RESTART_POLICIES),
        help=f"see 'restart policy' above (default: {DEFAULT_RESTART_POLICY})",
    )
    add("--workdir", help="the container's working directory, if not the image's")
    add("--format", choices=("yaml", "json"), default="yaml", help="output (default: yaml)")
    add("--out", metavar="FILE", help="write the manifest here instead of to stdout")
    add(
        "--show_tf_config",
        action="store_true",
        help="print the TF_CONFIG the training-operator will give each pod instead",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
