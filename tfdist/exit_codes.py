"""The contract between a launcher that restarts a job and the tasks it restarts.

A task that was told to stop (SIGTERM: a preemption, a node drain) saves its state and exits
with `EXIT_PREEMPTED`; the launcher (`tfdist-launch --max_restarts N`) then restarts
the whole job, and tells every task which attempt it is through the `RESTART_COUNT_ENV`
environment variable, so that a training binary can log "resuming after restart N".

This module imports nothing heavy: the launcher reads it without importing TensorFlow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import NoReturn

from tfdist.errors import TfdistError

# "Preempted: my state is saved, restart me." 42 is what TensorFlow's own
# tf.distribute.experimental.PreemptionCheckpointHandler exits with after its preemption
# checkpoint when no TerminationConfig(exit_fn=...) is given and the host is not a GCE VM
# (BorgTerminationConfig's `sys.exit(42)`, the default "for other platforms" in TF 2.21's
# failure_handling.py; TPUStrategy's default exit also uses 42). So a program that relies on
# TensorFlow's handler is recognised as preempted without any configuration.
# On GCE, TensorFlow exits with 143 instead (failure_handling_util._RESTARTABLE_EXIT_CODE),
# which is also what a shell reports for a process *killed* by SIGTERM (128 + 15), state saved
# or not; a code below 128 can never be mistaken for a death by signal.
EXIT_PREEMPTED = 42

# "The command was wrong": a flag error, an invalid or contradictory option, a layout that
# cannot work. What argparse and POSIX utilities exit with. A restart cannot cure it, so the
# launcher never restarts a task that exits with it.
EXIT_USAGE = 2

# "The storage this job writes to cannot take its files": a full disk or quota, a read-only
# or vanished model_dir, a file-size limit, or a model_dir another job holds. A restart meets
# the same fault until someone fixes it, so the launcher does not restart a task that exits
# with it; the same command run again after the fix resumes from the last good checkpoint.
# 74 is sysexits.h's EX_IOERR; Kubernetes' ExitCode policy fails the job on it (1-127).
EXIT_STORAGE = 74

# The codes a restart cannot cure: the launcher stops there.
NOT_RESTARTABLE = (EXIT_USAGE, EXIT_STORAGE)

# Kubeflow's TFJob restartPolicy "ExitCode" recreates a pod that exits 128-255 and fails the
# whole job on 1-127. A failure a restart cures (a preemption with state saved, a lost peer,
# an unreachable parameter server) must then exit 128 or more: the environment variable below
# names that code, and tfdist-k8s sets it to 143, TensorFlow's own restartable code.
RESTARTABLE_EXIT_ENV = "TFDIST_RESTARTABLE_EXIT_CODE"
KUBERNETES_RESTARTABLE_EXIT = 143

# How many times the launcher has restarted the job: "0" on the first attempt, as
# torchrun's TORCHELASTIC_RESTART_COUNT.
RESTART_COUNT_ENV = "TFDIST_RESTART_COUNT"

# Set (to anything) to see the traceback of a TfdistError that ends a script.
TRACEBACK_ENV = "TFDIST_TRACEBACK"


class RestartCountError(TfdistError, ValueError):
    """A launcher's environment variable (restart count, exit code) holds a bad value."""


def restart_count(environ: Mapping[str, str] | None = None) -> int:
    """Returns how many times the launcher has restarted this job.

    Example:
        if (restarts := restart_count()) > 0:
            logging.info("resuming after restart %d", restarts)

    Args:
      environ: the environment to read; `os.environ` by default.

    Returns:
      The value of `TFDIST_RESTART_COUNT`: 0 on the first attempt, and when no launcher set it.

    Raises:
      RestartCountError: if the variable is set but is not a whole number 0 or more.
    """
    value = (os.environ if environ is None else environ).get(RESTART_COUNT_ENV, "0")
    if not value.strip().isdecimal():
        raise RestartCountError(
            f"{RESTART_COUNT_ENV} must be a whole number 0 or more, as tfdist-launch sets it; "
            f"unset it to run as a first attempt. Received: {RESTART_COUNT_ENV}={value!r} "
            "from the environment"
        )
    return int(value)


def restartable_exit_code(code: int, environ: Mapping[str, str] | None = None) -> int:
    """The exit code for a failure that a restart cures: `code`, unless the launcher asks
    for another one through `TFDIST_RESTARTABLE_EXIT_CODE` (Kubernetes' ExitCode policy).

    Args:
      code: the code used when the variable is not set (EXIT_PREEMPTED for a preemption).
      environ: the environment to read; `os.environ` by default.

    Raises:
      RestartCountError: if the variable is set but is not a code from 1 to 255.
    """
    value = (os.environ if environ is None else environ).get(RESTARTABLE_EXIT_ENV)
    if value is None:
        return code
    if not value.strip().isdecimal() or not 1 <= int(value) <= 255:
        raise RestartCountError(
            f"{RESTARTABLE_EXIT_ENV} must be an exit code from 1 to 255 (Kubernetes' ExitCode "
            f"restart policy retries 128-255). Received: {RESTARTABLE_EXIT_ENV}={value!r} from "
            "the environment"
        )
    return int(value)


def exit_code_for(error: BaseException) -> int:
    """The exit code a process that ends on `error` (a TfdistError) reports.

    A mistake in the command or the script (the default) is EXIT_USAGE, which launchers never
    restart; an error class may say otherwise with an `exit_code` attribute, and a failure a
    restart cures (`restartable = True`: a lost peer, a preemption with its state saved) uses
    the code the launcher asked for through TFDIST_RESTARTABLE_EXIT_CODE.
    """
    code = getattr(error, "exit_code", EXIT_USAGE)
    return restartable_exit_code(code) if getattr(error, "restartable", False) else code


def end_process(error: BaseException) -> NoReturn:
    """Prints `error`'s one line (`error: ...`, or the label its class gives) and exits with
    `exit_code_for(error)`: what the binaries do, and what a script's uncaught TfdistError
    gets through `install_error_hook`.

    An error whose class says `peers_gone` (a lost task) ends the process at once, past
    Python's and TensorFlow's shutdown: TensorFlow's waits for the peers it lost, which held
    the task well past the launcher's grace period after its SIGTERM."""
    label = getattr(error, "label", "error")
    print(f"{label}: {error}", file=sys.stderr, flush=True)
    code = exit_code_for(error)
    if getattr(error, "peers_gone", False):
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def install_error_hook() -> None:
    """Makes an uncaught TfdistError end the process with one line and its exit code.

    Done once when tfdist is imported, so that a user's own script gets what the binaries
    do: a mistake tfdist explains (an uncompiled model, a bad TF_CONFIG) prints its message
    without a traceback on every worker and exits 2, which launchers do not restart; a lost
    peer exits with the restartable code. Any other exception goes to the hook that was
    there before. Set TFDIST_TRACEBACK=1 to see tracebacks anyway.
    """
    previous = sys.excepthook
    if getattr(previous, "_tfdist", False):
        return

    def hook(kind, error, traceback):
        if isinstance(error, TfdistError) and not os.environ.get(TRACEBACK_ENV):
            end_process(error)
        previous(kind, error, traceback)

    hook._tfdist = True
    sys.excepthook = hook
