"""What the chief shows and writes: progress bar, epoch log lines, TensorBoard, summary.json.

Every method is a no-op on other tasks, so training code calls them unconditionally and the
single `is_chief` predicate decides who writes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

import keras
import tensorflow as tf

from tfdist.storage import strict_json, write_atomically

log = logging.getLogger(__name__)

LOG_SUBDIR = "logs"
SUMMARY_FILE = "summary.json"
# One line per epoch trained, by every session of the run (resumes and re-runs alike): what
# summary.json's history and totals are made from, kept even when a session is killed.
HISTORY_FILE = "history.jsonl"
# Fields of a history.jsonl line that describe its session rather than the epoch.
_SESSION_FIELDS = ("session", "resumed_from_step", "steps_trained", "train_seconds")


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """What every session of a run trained, from model_dir/history.jsonl."""

    # One entry per epoch (the newest session's, where an epoch was trained again after a
    # resume), in epoch order.
    history: tuple[dict, ...]
    # Per session that trained: when it started, the step it resumed from, the epochs it
    # trained and their steps and seconds.
    sessions: tuple[dict, ...]
    # Per session, (steps, seconds) of each epoch it trained.
    epoch_timings: tuple[tuple[tuple[int, float], ...], ...]

    @property
    def resume_points(self) -> list[int]:
        return sorted({s["resumed_from_step"] for s in self.sessions if s["resumed_from_step"]})

    @property
    def steps_trained(self) -> int:
        return sum(s["steps_trained"] for s in self.sessions)

    @property
    def train_seconds(self) -> float:
        return sum(s["train_seconds"] for s in self.sessions)

    def examples_per_second(self, global_batch_size: int) -> float | None:
        """Over every session's epochs, each session's first left out where it has others
        (its time includes tracing)."""
        steps = seconds = 0.0
        for epochs in self.epoch_timings:
            for n, t in epochs[1:] or epochs:
                steps, seconds = steps + n, seconds + t
        return steps * global_batch_size / seconds if seconds > 0 else None


def read_run_record(lines: list[dict]) -> RunRecord:
    """The run's history and sessions from history.jsonl's lines (oldest first).

    A session that started from step 0 begins a new run (a model_dir reused after its
    checkpoints were removed): what came before is not this run's. A session that resumed
    at step S replaces the epochs earlier sessions recorded after S.
    """
    by_epoch: dict[int, dict] = {}
    sessions: dict[str, dict] = {}
    timings: dict[str, list[tuple[int, float]]] = {}
    for line in lines:
        if line["session"] not in sessions:  # a session's first epoch: where it started
            start = line["resumed_from_step"]
            if start == 0:  # trained from scratch: a new run in this model_dir
                by_epoch.clear()
                sessions.clear()
                timings.clear()
            # Epochs an earlier session ended after this one's start were trained again.
            by_epoch = {e: h for e, h in by_epoch.items() if h["step"] <= start}
        epoch = {k: v for k, v in line.items() if k not in _SESSION_FIELDS}
        by_epoch[line["epoch"]] = epoch
        session = sessions.setdefault(
            line["session"],
            {"started": line["session"], "resumed_from_step": line["resumed_from_step"],
             "epochs": [], "steps_trained": 0, "train_seconds": 0.0},
        )  # fmt: skip
        session["epochs"].append(line["epoch"])
        session["steps_trained"] += line["steps_trained"]
        session["train_seconds"] += line["train_seconds"]
        timings.setdefault(line["session"], []).append(
            (line["steps_trained"], line["train_seconds"])
        )
    return RunRecord(
        history=tuple(by_epoch[e] for e in sorted(by_epoch)),
        sessions=tuple(sessions.values()),
        epoch_timings=tuple(tuple(t) for t in timings.values()),
    )


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """The outcome of a training run, as the chief writes it to summary.json.

    A run is every session that trained in one model_dir: the first, and each resume or
    re-run. The history and the totals cover them all (a re-run with nothing left to train
    keeps what was recorded); the configuration, resumed_from_step and wall_seconds are this
    session's. Metrics that are not finite are null.
    """

    strategy: str
    replicas: int
    global_batch_size: int
    per_replica_batch_size: int
    steps: int
    epochs: int
    resumed_from_step: int
    train_loss: float | None
    train_accuracy: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    examples_per_second: float | None
    wall_seconds: float
    # Parameter-server training only (None for synchronous strategies, whose updates are
    # never stale): staleness over this run's updates, and the updates that reached the
    # parameters since the first step; more than `steps` means a dead worker's re-run
    # closures applied some steps twice.
    staleness_mean: float | None = None
    staleness_max: int | None = None
    applied_updates: int | None = None
    # One dict per epoch of the run, across resumes: the epoch's metrics as logged
    # (train_loss, train_accuracy, eval_* when evaluated, ...) with its "epoch" number (from
    # 1) and the "step" it ended on; e.g. a learning curve.
    history: tuple[dict[str, float], ...] = ()
    # Totals over every session of the run, and the steps sessions resumed from.
    steps_trained: int = 0
    train_seconds: float = 0.0
    resume_points: tuple[int, ...] = ()
    sessions: tuple[dict, ...] = ()

    def to_json(self) -> str:
        return strict_json(dataclasses.asdict(self), what=SUMMARY_FILE, indent=2)


class Reporter:
    """Progress, logs and summaries of one task (silent unless it is the chief)."""

    def __init__(self, *, is_chief: bool, model_dir: str | None, steps_per_epoch: int, epochs: int):
        self.active = is_chief
        self.model_dir = model_dir if is_chief else None
        self.steps_per_epoch = steps_per_epoch
        self.epochs = epochs
        self._writer = None
        self.session = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.resumed_from_step = 0
        self._lines: list[dict] = []  # this session's history.jsonl lines (every task)
        if self.model_dir:
            self._writer = tf.summary.create_file_writer(os.path.join(self.model_dir, LOG_SUBDIR))

    def end_epoch(
        self, epoch: int, step: int, metrics: dict[str, float], *, steps: int, seconds: float
    ) -> None:
        """Logs an epoch and records it in history.jsonl (`steps` trained in `seconds`)."""
        line = {"epoch": epoch + 1, "step": step, **metrics, "session": self.session,
                "resumed_from_step": self.resumed_from_step, "steps_trained": steps,
                "train_seconds": seconds}  # fmt: skip
        self._lines.append(line)
        if not self.active:
            return
        if self.model_dir:
            path = os.path.join(self.model_dir, HISTORY_FILE)
            earlier = _read_text(path)
            if earlier and not earlier.endswith("\n"):
                earlier += "\n"
            write_atomically(path, earlier + strict_json(line, what=HISTORY_FILE) + "\n")
        parts = [f"epoch {epoch + 1}/{self.epochs}", f"step {step}"]
        parts += [f"{name} {value:.4g}" for name, value in metrics.items()]
        log.info("%s", "  ".join(parts))
        if self._writer is not None:
            with self._writer.as_default(step=step):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
            self._writer.flush()

    @property
    def trained(self) -> bool:
        """Whether this session trained an epoch."""
        return bool(self._lines)

    def run_record(self) -> RunRecord:
        """Every session's epochs: model_dir/history.jsonl on the chief, else this session's."""
        if not self.model_dir:
            return read_run_record(self._lines)
        path = os.path.join(self.model_dir, HISTORY_FILE)
        lines = []
        for number, text in enumerate(_read_text(path).splitlines(), 1):
            try:
                line = json.loads(text)
            except ValueError:
                line = None
            if not isinstance(line, dict) or not {"epoch", *_SESSION_FIELDS} <= line.keys():
                log.warning(
                    "%s line %d is not an epoch's record; left out: %.80s", path, number, text
                )
                continue
            lines.append(line)
        return read_run_record(lines)

    def finish(self, result: TrainResult, model: keras.Model) -> None:
        """Writes summary.json and exports the model (chief with a model_dir only)."""
        if not self.model_dir:
            return
        write_atomically(os.path.join(self.model_dir, SUMMARY_FILE), result.to_json())
        export_dir = os.path.join(self.model_dir, "export")
        tf.io.gfile.makedirs(export_dir)
        model.save(os.path.join(export_dir, "model.keras"))
        log.info("Wrote %s and exported the model to %s", SUMMARY_FILE, export_dir)


def _read_text(path: str) -> str:
    if not tf.io.gfile.exists(path):
        return ""
    with tf.io.gfile.GFile(path) as f:
        return f.read()
