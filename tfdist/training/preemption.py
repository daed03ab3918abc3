"""Preemption: SIGTERM means "save and stop", not "die mid-step".

Cluster schedulers announce a preemption with SIGTERM and kill the process a grace period
later (Kubernetes: 30 s by default). The trainer turns SIGTERM into a request that it honours
at the next step boundary: it saves a checkpoint and raises `Preempted`, and the training
binary exits with `tfdist.exit_codes.PREEMPTED` so a launcher knows to restart the job, which
then resumes from that checkpoint — the idea of TensorFlow's PreemptionCheckpointHandler.

In a multi-worker job the workers must save at the same step (saving is collective), so
they agree through a small all-reduce whether any of them was signalled: a vote, at a call's
end about every `VOTE_SECONDS` and at every epoch's end. A vote costs a collective (2-5 ms
across 2 processes on this machine: as much as a step of a small model), so it is not taken
at every call; a grace period is tens of seconds. Each vote also sets the next: the chief's
steps of the last `VOTE_SECONDS`, agreed in the same all-reduce, so every worker votes at
the same step.

In a program that routed its stop signals (tfdist.signals), SIGINT (Ctrl-C) is honoured the
same way, exiting 130 instead of asking for a restart.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from tfdist import signals
from tfdist.errors import TfdistError
from tfdist.exit_codes import EXIT_PREEMPTED

log = logging.getLogger(__name__)

# Lockstep workers vote on a stop about this often (seconds); see the module docstring.
VOTE_SECONDS = 1.0


class Preempted(TfdistError):
    """Training stopped on SIGTERM (or SIGINT) after saving a checkpoint; re-running resumes.

    Attributes:
      signum: the signal that asked for the stop (SIGTERM unless a routed SIGINT).
    """

    def __init__(
        self,
        step: int,
        checkpoint: str | None,
        signum: int = signal.SIGTERM,
        *,
        saved_as: str = "checkpoint",
    ):
        self.step, self.checkpoint, self.signum = step, checkpoint, signum
        # A preemption whose state is saved: 42, "restart me" (tfdist.exit_codes). With nothing
        # saved, 143 as a shell reports a death by SIGTERM: a restart still helps, but 42 would
        # claim a saved state. A person's Ctrl-C stops the job: 130, and no restart.
        interrupted = signum == signal.SIGINT
        self.label = "interrupted" if interrupted else "preempted"
        self.exit_code = EXIT_PREEMPTED if checkpoint and not interrupted else 128 + signum
        self.restartable = not interrupted
        if checkpoint:
            where = (
                f"{saved_as} saved in {checkpoint}. Run the same command again to resume from it."
            )
        else:
            where = (
                "nothing saved (no model_dir, no BackupAndRestore callback), so a re-run "
                "starts over."
            )
        super().__init__(f"{signal.Signals(signum).name} at step {step}; {where}")


class PreemptionWatcher:
    """Records SIGTERM while training runs; `agreed()` says whether any worker received it.

    A second signal ends the process at once, for a process that cannot reach a step
    boundary. In a program that routed its stop signals (tfdist.signals) the watcher takes
    SIGTERM and SIGINT from the router; otherwise it sets a SIGTERM handler, which only works
    in the main thread (elsewhere the watcher stays inert).

    Args:
      tally: sums a list of ints over the lockstep workers (a job's `tally`).
      is_chief: whether this worker's clock sets when the workers vote next.
      saves: whether a stop saves anything (the line a signal prints says so).
    """

    def __init__(
        self,
        tally: Callable[[list[int]], list[int]],
        *,
        is_chief: bool = True,
        saves: bool = True,
    ):
        self._tally, self._is_chief = tally, is_chief
        # Whether the stop saves anything (a checkpoint callback or BackupAndRestore): the
        # line a signal prints says so only then.
        self.saves = saves
        self.signum: int | None = None
        # Until a step has run there is nothing to save: a signal then ends the process.
        self.stepped = False
        # After the last step's epoch end (its checkpoint written) no step boundary comes: a
        # signal ends the process at once (a survivor blocked in a collective with a peer
        # that died after the last save would otherwise wait out the launcher's grace).
        self.finished = False
        self._previous = None
        self._routed = None
        # The steps into the fit where the workers vote next, and (steps, time) of the last.
        self._next_vote = 0
        self._last_vote: tuple[int, float] | None = None

    @property
    def signalled(self) -> bool:
        return self.signum is not None

    def __enter__(self) -> PreemptionWatcher:
        router = signals.router()
        if router is not None:
            self._routed = router.handling(self._on_signal)
            self._routed.__enter__()
        elif threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(
                signal.SIGTERM, lambda signum, _: self._on_signal(signum)
            )
        return self

    def __exit__(self, *exc) -> None:
        if self._routed is not None:
            self._routed.__exit__(*exc)
            self._routed = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self.signalled:  # asked twice: stop waiting for a step boundary
            self._stop_now(
                signum, "a second time, before the step boundary the first was waiting for"
            )
            return
        if self.finished:
            self._stop_now(signum, "after the last training step and its epoch's end")
            return
        if not self.stepped and signals.router() is not None:
            signals.router().stop(signum, "before the first training step")
        self.signum = signum
        if self.saves:
            log.warning("%s received: saving a checkpoint at the next step boundary", name)
        else:
            log.warning(
                "%s received: stopping at the next step boundary (nothing to save: no "
                "model_dir, no BackupAndRestore callback)",
                name,
            )

    def _stop_now(self, signum: int, why: str) -> None:
        router = signals.router()
        if router is None:  # the signal's own end, as the process would have had it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
            return
        router.stop(signum, why)

    def agreed(self, ran: int, *, now: bool = False) -> bool:
        """Whether every worker stops at a call's end, `ran` steps into the fit. Every worker
        asks at the same steps and gets the same answer; they vote (a collective) where the
        last vote said, or `now` (an epoch's end; where there is one worker, every call)."""
        if not now and ran < self._next_vote:
            return False
        clock = time.perf_counter()
        proposal = 0
        if self._is_chief:
            proposal = 1  # the first vote: the next call's end measures a call
            if self._last_vote is not None and ran > self._last_vote[0]:
                rate = (ran - self._last_vote[0]) / max(clock - self._last_vote[1], 1e-9)
                proposal = max(1, round(VOTE_SECONDS * rate))
        stop, every = self._tally([int(self.signalled), proposal])
        self._last_vote, self._next_vote = (ran, clock), ran + max(1, every)
        return stop > 0
