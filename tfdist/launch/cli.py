"""Run a TensorFlow cluster as local processes, one per task, each with its own TF_CONFIG.

Every task runs COMMAND; its TF_CONFIG names its role and lists every task's address (free
ports on --host). Output lines are prefixed with their task, e.g. "[worker:1] ". The run ends
when the program finishes, when a task fails (the others are then stopped; with --max_restarts
the job then starts again), at --timeout, or on Ctrl-C. A COMMAND that starts with `python`
or `python3` runs under the launcher's own interpreter, as torchrun does, so the tasks see the
same virtualenv. The launcher does not import TensorFlow, so it starts instantly.

examples:
  # MultiWorkerMirroredStrategy on two workers
  tfdist-launch --workers 2 -- python train.py
  # parameter-server training: the chief coordinates, the workers and ps serve
  tfdist-launch --chief --workers 2 --ps 1 -- python train.py
  # restart the whole job up to 3 times if a task fails, is killed or is preempted
  # (a parameter-server worker that dies is survived without a restart)
  tfdist-launch --workers 2 --max_restarts 3 -- python train.py
  # print each task's TF_CONFIG and command line instead of starting anything
  tfdist-launch --chief --workers 2 --ps 1 --dry_run -- python train.py
  # two hosts, 4 workers each: the same command on both, each with its own --node_rank,
  # and the job's token (any secret the hosts share; node 0 makes one if given none)
  export TFDIST_RDZV_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(18))")
  tfdist-launch --nnodes 2 --node_rank 0 --master_addr host0:29500 --workers 4 -- python train.py
  tfdist-launch --nnodes 2 --node_rank 1 --master_addr host0:29500 --workers 4 -- python train.py

several hosts (--nnodes N --node_rank R --master_addr HOST[:PORT]):
  Run tfdist-launch once on every host, as torchrun. --workers counts the workers of each
  host; --chief and --evaluator run on node 0. Node 0 listens on --master_addr (port 29500
  by default) until every node has offered its tasks' addresses, then all start together
  with one TF_CONFIG cluster, node 0's tasks first. Each host's tasks listen on --host,
  by default the address this host reaches the master from. Only nodes that hold the job's
  token (--rdzv_token, or TFDIST_RDZV_TOKEN) can join: every offer and answer is signed
  with it, and anything else sent to --master_addr is ignored. Node 0 started without one
  makes one and prints it for the other nodes' command lines. Parameter-server layouts
  (--ps) and --max_restarts are for one host for now: across hosts, let the scheduler
  restart the launchers.

roles:
  Without --ps every task runs COMMAND to completion. With --ps only the chief (and the
  evaluator) run the training program; COMMAND should make workers and ps start a
  tf.distribute.Server and wait, and the launcher stops them once the chief exits 0.

failures in parameter-server training (--ps M):
  A worker that dies does not end the job (--on_worker_failure continue, the default with
  --ps): the chief's ClusterCoordinator re-runs the steps the worker was running on the
  other workers, and the launcher logs the loss and carries on; only when every worker is
  gone does the job fail. --on_worker_failure restart also starts the dead worker again
  with its TF_CONFIG (--worker_restarts times at most, 3 by default), as Kubernetes restarts
  a pod; the coordinator then gives it work again. --on_worker_failure stop ends the job
  instead, as a failure of any task does without --ps (synchronous training cannot lose a
  worker). A dead ps or chief ends the job: the variables live on the ps and the chief
  coordinates. A worker missing when the job starts is left out after a grace period (the
  chief starts with --min_workers of them, tfdist.peers.wait_for_servers). After a ps
  dies the chief gets --grace seconds to report where training stopped and which checkpoint
  a restart resumes from; --max_restarts N then restarts the job from that checkpoint.

restarts (--max_restarts N):
  When a task fails (a non-zero exit, or death by a signal) the launcher stops every task, as
  without restarts, then starts the whole job again, at most N times, with the same command
  and TF_CONFIG (a port another program took meanwhile is replaced, and the log says so).
  Every task sees the attempt in TFDIST_RESTART_COUNT: 0 at first, 1 after the first restart,
  and so on, so the program can resume from its checkpoint. A task that exits 42 was
  preempted with its state saved (42 is what TensorFlow's PreemptionCheckpointHandler exits
  with by default off GCE; see tfdist/exit_codes.py): it is restarted like a failure, and
  logged as "preempted (state saved)". Two exits are never restarted, as a restart would
  meet them again: 2 (a usage error in the command) and 74 (a storage fault: a full disk,
  a read-only or vanished model_dir, a file-size limit, a model_dir another job holds; run
  the same command again once it is fixed, and it resumes from the last checkpoint).
  --timeout covers all attempts together. A signal to the launcher (Ctrl-C, SIGTERM) never
  restarts anything.

exit status:
  0        every program task exited 0
  N        the first task to fail exited with N (128+S if signal S killed it) and no
           restarts were left; 42 means it was preempted with its state saved
  1        a worker or ps server exited by itself while the program ran, or every worker
           of a parameter-server job died
  2        bad usage (the launcher's, or a task's)
  74       a task met a storage fault (its error line names the path and the cause)
  124      --timeout passed
  126/127  COMMAND cannot be run / was not found
  128+S    the launcher received signal S (130 for Ctrl-C, 143 for SIGTERM)
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Iterator, Sequence

from tfdist.exit_codes import EXIT_PREEMPTED, RESTART_COUNT_ENV
from tfdist.launch import network
from tfdist.launch.plan import Task, UsageError, cluster_of, plan_cluster, tf_config_for
from tfdist.launch.preload import PRELOAD_ENV
from tfdist.launch.rendezvous import (
    DEFAULT_PORT,
    TOKEN_ENV,
    Master,
    Offer,
    join,
    local_address_towards,
    my_tasks,
    new_token,
    parse_master,
)
from tfdist.launch.straggler import StragglerError, parse_pause, parse_slow
from tfdist.launch.supervisor import (
    EXAMPLE,
    EXIT_USAGE,
    WORKER_FAILURE_CHOICES,
    WORKER_RESTARTS,
    Launcher,
)
from tfdist.layout import Layout, LayoutError, command_strategy, launch_flags, validate_layout


def _dry_run_lines(
    command: Sequence[str], tasks: Sequence[Task], cluster: dict[str, list[str]] | None = None
) -> Iterator[str]:
    yield f"# {len(tasks)} task{'s' if len(tasks) != 1 else ''}; run each line in a shell of its own"
    cluster = cluster or cluster_of(tasks)
    for task in tasks:
        yield f"# {task.name} ({task.address})"
        yield f"TF_CONFIG={shlex.quote(tf_config_for(cluster, task))} {shlex.join(command)}"


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tfdist-launch",
        usage="%(prog)s [--workers N] [--chief] [--ps M] [--evaluator] [options] -- COMMAND ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # an abbreviation could silently take a flag meant for COMMAND
    )
    for flags in (_task_flags, _host_flags, _failure_flags, _run_flags):
        flags(parser.add_argument)
    return parser


def _task_flags(add) -> None:
    """The job's tasks."""
    add("--workers", type=int, default=1, metavar="N", help="number of worker tasks (default: 1)")
    add("--chief", action="store_true", help="add a chief task; required with --ps")
    add(
        "--ps",
        type=int,
        default=0,
        metavar="M",
        help="number of parameter-server tasks (default: 0)",
    )
    add("--evaluator", action="store_true", help="add an evaluator task (side-car evaluation)")


def _host_flags(add) -> None:
    """Where the tasks listen, and the hosts of a job of several."""
    add(
        "--host",
        default=None,
        help="address the tasks listen on, e.g. ::1 (default: 127.0.0.1; with --nnodes, the "
        "address this host reaches --master_addr from)",
    )
    add("--nnodes", type=int, default=1, metavar="N", help="hosts in the job (default: 1)")
    add("--node_rank", type=int, default=0, metavar="R", help="this host's rank, 0 to N-1")
    add(
        "--master_addr",
        default=None,
        metavar="HOST[:PORT]",
        help=f"with --nnodes: where node 0 gathers the nodes (port {DEFAULT_PORT} by default)",
    )
    add(
        "--rdzv_token",
        default=None,
        metavar="TOKEN",
        help=f"with --nnodes: the job's shared secret; only nodes started with it can join "
        f"(default: ${TOKEN_ENV}; node 0 makes one if neither is set)",
    )
    add(
        "--rdzv_timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with --nnodes: how long a node waits for the others to join (default: 600)",
    )


def _failure_flags(add) -> None:
    """How long the job may run, and what a failed or stopped task does to it."""
    add(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="stop every task and exit 124 after this long, all restarts included (default: 3600)",
    )
    add(
        "--grace",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help=(
            "time a stopped task gets between SIGTERM and SIGKILL (default: 10); after a "
            "task's failure, a task still running halfway gets a second SIGTERM (stop now)"
        ),
    )
    add(
        "--max_restarts",
        type=int,
        default=0,
        metavar="N",
        help=f"when a task fails, is killed or is preempted (exits {EXIT_PREEMPTED}), stop every "
        "task and start the whole job again, up to N times; the tasks find the attempt in "
        f"{RESTART_COUNT_ENV} (default: 0)",
    )
    add(
        "--on_worker_failure",
        choices=WORKER_FAILURE_CHOICES,
        default=None,
        help="with --ps: 'continue' (the default) keeps parameter-server training going when a "
        "worker dies, its steps rescheduled on the others; 'restart' also starts the worker "
        "again in place, up to --worker_restarts times, and the chief gives it work again; "
        "'stop' ends the job. Without --ps a failed task always ends the job (default: "
        "continue with --ps, else stop)",
    )
    add(
        "--worker_restarts",
        type=int,
        default=WORKER_RESTARTS,
        metavar="N",
        help="with --on_worker_failure restart: how many times one worker is restarted in "
        f"place (default: {WORKER_RESTARTS})",
    )


def _run_flags(add) -> None:
    """How the tasks are run: slowed for benchmarks, forked, isolated, or only printed."""
    add(
        "--slow",
        action="append",
        default=[],
        metavar="TASK=FACTOR",
        help="for benchmarks: run TASK FACTOR times slower (stopped for part of every 100 ms), "
        "e.g. --slow worker:1=2",
    )
    add(
        "--pause",
        action="append",
        default=[],
        metavar="TASK=AT+SECONDS",
        help="for benchmarks: stop TASK for SECONDS, AT seconds after it starts, e.g. "
        "--pause worker:1=20+5",
    )
    add(
        "--preload",
        default=os.environ.get(PRELOAD_ENV, ""),
        metavar="MODULES",
        help="import these modules (comma-separated, e.g. tensorflow,keras) once, then fork "
        "each task of a `python -m MODULE`, `python FILE` or `python -c CODE` command from "
        "that process: tasks and restarts start in a fraction of a second instead of "
        f"importing them each (default: ${PRELOAD_ENV}, else none)",
    )
    add(
        "--private_network",
        action="store_true",
        help="one host: run the job in a network namespace of its own, so that no other "
        "process can reach its tasks' servers (TensorFlow's listen on every interface)",
    )
    add(
        "--dry_run",
        action="store_true",
        help="print each task's TF_CONFIG and command line, to run by hand or on other hosts, "
        "and start nothing",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parses the command line, then launches the cluster (or prints it with --dry_run).

    Args:
      argv: the arguments after the program name; `sys.argv[1:]` by default.

    Returns:
      The exit code, as the module docstring (and --help) lists them.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first `--` belongs to the command, even flags the launcher also has.
    split = argv.index("--") if "--" in argv else len(argv)
    command = argv[split + 1 :]
    args, unknown = _build_parser().parse_known_args(argv[:split])
    try:
        if unknown:
            raise UsageError(
                f"unrecognised arguments {shlex.join(unknown)!r}: the launcher's flags are listed "
                f"by --help, and the command goes after `--`, e.g. `{EXAMPLE}`"
            )
        if args.private_network:
            if args.nnodes != 1 or args.master_addr is not None or args.dry_run:
                raise UsageError(
                    "--private_network keeps a one-host job's tasks in a network of their own: "
                    "tasks on several hosts, or started by hand (--dry_run), must reach each "
                    "other. Received: --private_network with "
                    + ("--dry_run" if args.dry_run else f"--nnodes {args.nnodes}")
                )
            network.enter(argv)
        if args.nnodes != 1 or args.master_addr is not None:
            cluster, tasks = _join_nodes(args, command)
        else:
            cluster, (_, tasks) = (
                None,
                plan_cluster(
                    workers=args.workers,
                    chief=args.chief,
                    ps=args.ps,
                    evaluator=args.evaluator,
                    host=args.host or "127.0.0.1",
                    strategy=command_strategy(command),
                ),
            )
        launcher = Launcher(
            command,
            tasks=tasks,
            timeout=args.timeout,
            grace=args.grace,
            max_restarts=args.max_restarts,
            on_worker_failure=args.on_worker_failure,
            worker_restarts=args.worker_restarts,
            cluster=cluster,
            stragglers=[
                *(parse_slow(text) for text in args.slow),
                *(parse_pause(text) for text in args.pause),
            ],
            preload=[name.strip() for name in args.preload.split(",") if name.strip()],
        )
    except (UsageError, StragglerError) as error:
        print(f"tfdist-launch: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        print("\n".join(_dry_run_lines(command, tasks, cluster)), flush=True)
        return 0
    if not args.private_network:
        print(
            "tfdist-launch: note: the tasks' TensorFlow servers listen on every interface of "
            "this host, whatever address TF_CONFIG names (TensorFlow's server takes none), "
            "and admit whoever connects: on a shared or public host run one-host jobs with "
            "--private_network, or firewall the task ports (docs/reference/security.md)",
            file=sys.stderr,
            flush=True,
        )
    return launcher.run()


def _join_nodes(args, command: Sequence[str]) -> tuple[dict[str, list[str]], list[Task]]:
    """This host's tasks in a job of --nnodes hosts, and the whole job's cluster."""
    if args.nnodes < 2 or args.master_addr is None:
        raise UsageError(
            "a job on several hosts needs --nnodes N (2 or more) and --master_addr HOST[:PORT] "
            "on every host, with its own --node_rank. Received: "
            f"--nnodes={args.nnodes}, --master_addr={args.master_addr}"
        )
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(
            f"--node_rank is this host's rank, 0 to {args.nnodes - 1}. Received: "
            f"--node_rank={args.node_rank}"
        )
    if args.ps or args.max_restarts:
        raise UsageError(
            "--ps and --max_restarts run on one host for now; across hosts, start the "
            "parameter-server tasks with their TF_CONFIG (--dry_run prints them) and let the "
            f"scheduler restart the launchers. Received: --ps={args.ps}, "
            f"--max_restarts={args.max_restarts}"
        )
    master = parse_master(args.master_addr)
    first = args.node_rank == 0
    token = args.rdzv_token or os.environ.get(TOKEN_ENV)
    if not token and not first:
        raise UsageError(
            f"node {args.node_rank} needs the job's token to join: pass node 0's "
            f"--rdzv_token TOKEN (or set {TOKEN_ENV}); node 0 prints it when it makes one. "
            f"Received: no --rdzv_token and no {TOKEN_ENV}"
        )
    if not token:
        token = new_token()
        print(
            f"[launch] node 0: this job's token is {token}: start every other node with "
            f"--rdzv_token {token} (or {TOKEN_ENV}={token})",
            flush=True,
        )
    try:  # the whole job's layout, checked as one host's would be
        validate_layout(
            Layout(chief=int(args.chief), workers=args.workers * args.nnodes,
                   evaluator=int(args.evaluator)),
            strategy=command_strategy(command), spell=launch_flags,
        )  # fmt: skip
    except LayoutError as error:
        raise UsageError(str(error)) from None
    _, mine = plan_cluster(
        workers=args.workers,
        chief=args.chief and first,
        evaluator=args.evaluator and first,
        host=args.host or local_address_towards(master),
    )
    flags = {"workers": args.workers, "chief": args.chief, "evaluator": args.evaluator}
    offer = Offer(args.node_rank, args.nnodes, flags, cluster_of(mine))
    gatherer = Master(master, args.nnodes, flags, token) if first else None
    if gatherer is not None:
        gatherer.start()
    try:
        cluster = join(master, offer, token=token, timeout=args.rdzv_timeout)
    finally:
        if gatherer is not None:
            gatherer.close()
    tasks = my_tasks(cluster, offer)
    print(
        f"[launch] node {args.node_rank} of {args.nnodes} joined the job: "
        + ", ".join(
            f"{len(a)} {t}{'s' if len(a) > 1 and t != 'ps' else ''}" for t, a in cluster.items()
        ),  # fmt: skip
        flush=True,
    )
    return cluster, tasks
