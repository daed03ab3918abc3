"""tfdist-k8s: write the Kubernetes manifests that run a training command on every pod of a job.

  tfdist-k8s jobset ...   a JobSet (jobset.x-k8s.io/v1alpha2): new clusters, GKE, Kubeflow
                          Trainer's base; needs the JobSet controller installed
  tfdist-k8s tfjob ...    a Kubeflow TFJob (kubeflow.org/v1): clusters that still run the
                          v1 training-operator

Every pod runs the command given after `--`; with the program's default --strategy=auto
each pod takes its role from the cluster the engine describes. The manifests go to stdout
(pipe them to `kubectl apply -f -`) or to --out. Nothing here talks to a cluster.

Beside the job goes a NetworkPolicy that admits only the job's own pods to its port, and
every pod runs as a non-root user on a read-only root filesystem: see 'safe by default' in
`tfdist-k8s jobset --help`.

examples:
  # synchronous training on 2 worker pods (MultiWorkerMirroredStrategy)
  tfdist-k8s jobset --name digits --image IMAGE --workers 2 \\
      -- python -m experiments.train --config=digits_cnn --model_dir=gs://bucket/digits
  # parameter-server training: the chief coordinates, workers and ps serve; the
  # PersistentVolumeClaim "runs" (ReadWriteMany) is mounted at --model_dir in every pod
  tfdist-k8s tfjob --name digits-ps --image IMAGE --chief 1 --workers 2 --ps 1 \\
      --cpu 2 --memory 4Gi --model_dir_claim runs \\
      -- python my_train.py --model_dir=/mnt/runs/digits-ps
  # what each pod will see, without writing the manifest
  tfdist-k8s jobset --name digits --image IMAGE --workers 2 --show_tf_config -- python my_train.py

roles (what --strategy=auto builds in each pod):
  workers only, 2 or more     multi_worker_mirrored in every worker (worker 0 is the chief)
  chief + workers             multi_worker_mirrored; the chief trains too and writes
  chief + workers + ps        parameter_server on the chief; workers and ps serve
  evaluator                   one_device: it evaluates beside training, never joins it
  a single worker             one_device

exit status: 0 written, 2 bad usage (one "tfdist-k8s: error: ..." line on stderr).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from tfdist.errors import TfdistError
from tfdist.exit_codes import EXIT_USAGE
from tfdist.k8s.job import (
    DEFAULT_PORT,
    DEFAULT_RUN_AS_USER,
    EXAMPLE_COMMAND,
    Resources,
    TrainingJob,
)
from tfdist.k8s.jobset import DEFAULT_MAX_RESTARTS, jobset_manifest, jobset_tf_configs
from tfdist.k8s.network import network_policy
from tfdist.k8s.tfjob import DEFAULT_RESTART_POLICY, RESTART_POLICIES, tfjob_manifest
from tfdist.k8s.tfjob_operator import operator_tf_configs
from tfdist.layout import Layout

PROG = "tfdist-k8s"

_TFJOB_HELP = """\
Write a Kubeflow TFJob: the training-operator starts one pod per replica and writes each
pod's TF_CONFIG. A job of one replica gets none (it trains on one host).

restart policy (--restart_policy, applied to every replica type):
  ExitCode   (default) the operator recreates a pod killed by a signal (exit 128-255:
             preemption, node drain, OOM kill) and fails the job on exit 1-127 (a bug or a
             usage error, which would only fail again). With --model_dir on storage every pod
             shares, a recreated job resumes from its last checkpoint. The pods get
             TFDIST_RESTARTABLE_EXIT_CODE=143, so a task that saved its state after SIGTERM,
             or lost a peer, exits 143 and is recreated too.
  OnFailure  the kubelet restarts any failed container in place, whatever the cause.
  Never      nothing is restarted; the first failure fails the job.
"""

_JOBSET_HELP = """\
Write a JobSet: one replicated job per task type (chief, worker, ps, evaluator), each an
Indexed Job with one pod per task. JobSet makes a headless Service (named after
--subdomain) so task i of type T is reachable as NAME-T-0-i.SUBDOMAIN; each container gets
those facts in TFDIST_JOBSET_* variables and tfdist derives TF_CONFIG from them
(tfdist.cluster_from_environment), so the program needs no TF_CONFIG of its own.

The JobSet succeeds when the chief's job does (worker 0's without a chief); the pods still
running then (parameter-server workers and ps) are deleted.

restarts (--max_restarts N): a pod that Kubernetes disrupts (preemption, node drain), that
SIGKILL or SIGTERM ends (exit 137 or 143: the OOM killer, an eviction), or that tfdist ends
with 143 after saving its state (TFDIST_RESTARTABLE_EXIT_CODE) makes JobSet restart every
pod together, at most N times; with --model_dir on shared storage the job resumes from its
last checkpoint. Any other exit code is the program's own failure (a bug, a usage error)
and fails the JobSet at once.
"""


_SAFETY_HELP = """
safe by default:
  network    a NetworkPolicy beside the job admits only the job's own pods to --port, which
             TensorFlow's servers otherwise open to anything that reaches them. Egress stays
             open (DNS, gs://, package mirrors). It takes effect where the cluster's network
             plugin enforces NetworkPolicy.
  pods       every container runs as --run_as_user (1000; never root) with no capabilities,
             no privilege escalation, the runtime's default seccomp profile and a read-only
             root filesystem; an emptyDir is mounted at /tmp and HOME=/tmp, which is all
             TensorFlow and Python write to. The program's results go to --model_dir.
  model_dir  a --model_dir that is a path in the pod is lost when the pod goes, so it is
             refused unless --model_dir_claim NAME mounts a PersistentVolumeClaim there
             (ReadWriteMany: every pod mounts it); a bucket (gs://, s3://) needs nothing.
  resources  --cpu, --memory and --gpus set each pod's requests and its limits alike.
"""


class _UsageError(Exception):
    """A command line argparse or this tool refuses; its message is one line."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is raised, so `main` prints it as one line and returns 2."""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{message}; see --help")


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line and writes the manifests (or each pod's TF_CONFIG).

    Args:
      argv: the arguments after the program name; `sys.argv[1:]` by default.

    Returns:
      The exit code: 0, or 2 for bad usage.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parse(argv)
        job = _job(args)
        manifest = _WRITERS[args.kind](job, args)
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    except (_UsageError, TfdistError) as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.show_tf_config:
        for pod, tf_config in _POD_TF_CONFIGS[args.kind](manifest, job, args).items():
            print(f"{pod}: {json.dumps(tf_config) if tf_config else '(no TF_CONFIG: one pod)'}")
        return 0
    text = render([manifest, network_policy(manifest)], args.format)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    Path(args.out).write_text(text)
    print(
        f"Wrote {args.out}: {manifest['kind']} {job.name} ({job.layout.describe()}) and its "
        f"NetworkPolicy in namespace {job.namespace}; submit them with "
        f"`kubectl apply -f {args.out}`"
    )
    return 0


def render(manifests: Sequence[dict[str, Any]], fmt: str) -> str:
    """The manifests as YAML documents (keys in the order written) or as one JSON List.

    kubectl reads both: the documents of a YAML stream, and a v1 List's items.
    """
    if fmt == "json":
        return (
            json.dumps({"apiVersion": "v1", "kind": "List", "items": list(manifests)}, indent=2)
            + "\n"
        )
    return yaml.safe_dump_all(manifests, sort_keys=False)


def _parse(argv: list[str]) -> argparse.Namespace:
    args, unknown = _build_parser().parse_known_args(argv)
    # argparse.REMAINDER keeps the `--` it met; anything before it was not ours to take.
    command = args.command
    stray = command[: command.index("--")] if "--" in command else command
    example = f"e.g. `{PROG} {args.kind} --name NAME --image IMAGE -- {EXAMPLE_COMMAND}`"
    if unknown:
        raise _UsageError(
            f"unrecognised option(s) {shlex.join(unknown)}: {PROG} {args.kind}'s options are "
            f"listed by --help, and the training command goes after `--`, {example}"
        )
    if stray:
        raise _UsageError(
            f"unexpected argument(s) `{shlex.join(stray)}` before `--`: give the training "
            f"command after `--`, {example}"
        )
    missing = [f"--{flag}" for flag in ("name", "image") if getattr(args, flag) is None]
    if missing:
        raise _UsageError(f"the following arguments are required: {', '.join(missing)}; see --help")
    args.command = command[1:]  # TrainingJob says what is wrong with an empty one
    return args


def _job(args: argparse.Namespace) -> TrainingJob:
    return TrainingJob(
        name=args.name,
        image=args.image,
        command=tuple(args.command),
        layout=Layout(chief=args.chief, workers=args.workers, ps=args.ps, evaluator=args.evaluator),
        namespace=args.namespace,
        port=args.port,
        resources=Resources(cpu=args.cpu, memory=args.memory, gpus=args.gpus),
        workdir=args.workdir,
        run_as_user=args.run_as_user,
        model_dir_claim=args.model_dir_claim,
    )


_WRITERS: dict[str, Callable[[TrainingJob, argparse.Namespace], dict[str, Any]]] = {
    "tfjob": lambda job, args: tfjob_manifest(job, restart_policy=args.restart_policy),
    "jobset": lambda job, args: jobset_manifest(
        job, max_restarts=args.max_restarts, subdomain=args.subdomain
    ),
}
_POD_TF_CONFIGS: dict[str, Callable[[dict[str, Any], TrainingJob, argparse.Namespace], dict]] = {
    "tfjob": lambda manifest, job, args: operator_tf_configs(manifest),
    "jobset": lambda manifest, job, args: jobset_tf_configs(job, subdomain=args.subdomain),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    kinds = parser.add_subparsers(dest="kind", required=True, metavar="{jobset,tfjob}")
    usage = (
        "%(prog)s --name NAME --image IMAGE [--chief 0|1] [--workers N] [--ps M] "
        "[--evaluator 0|1] [options] -- COMMAND ..."
    )
    for kind, summary, help_text, add_own in (
        ("jobset", "write a JobSet (jobset.x-k8s.io/v1alpha2)", _JOBSET_HELP, _add_jobset_options),
        ("tfjob", "write a Kubeflow TFJob (kubeflow.org/v1)", _TFJOB_HELP, _add_tfjob_options),
    ):
        sub = kinds.add_parser(
            kind,
            usage=usage,
            help=summary,
            description=help_text + _SAFETY_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            # An abbreviation could silently take a flag meant for the training command.
            allow_abbrev=False,
        )
        _add_job_options(sub)
        add_own(sub)
        sub.add_argument(
            "command",
            nargs=argparse.REMAINDER,
            metavar="-- COMMAND ...",
            help="the program every pod runs, with its arguments, after `--`",
        )
    return parser


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--name", help="the job's name (required); pod names start with it")
    add("--image", help="container image holding tfdist and the program (required)")
    add(
        "--namespace",
        default="default",
        help="Kubernetes namespace of every object written (default: default)",
    )
    add("--chief", type=int, default=0, metavar="0|1", help="chief tasks (default: 0)")
    add("--workers", type=int, default=1, metavar="N", help="worker tasks (default: 1)")
    add("--ps", type=int, default=0, metavar="M", help="parameter-server tasks (default: 0)")
    add("--evaluator", type=int, default=0, metavar="0|1", help="evaluator tasks (default: 0)")
    add(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"port of every task's gRPC server (default: {DEFAULT_PORT})",
    )
    add("--cpu", help="CPU request and limit per pod, e.g. 4 or 500m (default: none)")
    add("--memory", help="memory request and limit per pod, e.g. 8Gi (default: none)")
    add(
        "--gpus",
        type=int,
        default=0,
        metavar="N",
        help="GPUs (request and limit) per pod that computes: workers, evaluator, and the "
        "chief unless it only coordinates parameter-server training (default: 0)",
    )
    add("--workdir", help="the container's working directory, if not the image's")
    add(
        "--run_as_user",
        type=int,
        default=DEFAULT_RUN_AS_USER,
        metavar="UID",
        help="the user id every container runs as; root (0) is refused, so give the id the "
        f"image's files belong to if not {DEFAULT_RUN_AS_USER} (default: {DEFAULT_RUN_AS_USER})",
    )
    add(
        "--model_dir_claim",
        metavar="NAME",
        help="a PersistentVolumeClaim to mount in every pod at the command's --model_dir "
        "(ReadWriteMany, since every pod mounts it); required when --model_dir is a path in "
        "the pod, not a bucket (default: none)",
    )
    add(
        "--format",
        choices=("yaml", "json"),
        default="yaml",
        help="output: YAML documents, or one JSON List (default: yaml)",
    )
    add("--out", metavar="FILE", help="write the manifests here instead of to stdout")
    add(
        "--show_tf_config",
        action="store_true",
        help="print the TF_CONFIG each pod will have instead of the manifests",
    )


def _add_tfjob_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--restart_policy",
        default=DEFAULT_RESTART_POLICY,
        metavar="|".join(RESTART_POLICIES),
        help=f"see 'restart policy' above (default: {DEFAULT_RESTART_POLICY})",
    )


def _add_jobset_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max_restarts",
        type=int,
        default=DEFAULT_MAX_RESTARTS,
        metavar="N",
        help=f"see 'restarts' above (default: {DEFAULT_MAX_RESTARTS})",
    )
    parser.add_argument(
        "--subdomain",
        help="the pods' DNS subdomain and headless Service's name (default: the job's name)",
    )


if __name__ == "__main__":
    sys.exit(main())
