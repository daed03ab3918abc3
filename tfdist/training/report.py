"""A run's record: epoch log lines, history.jsonl, TensorBoard scalars and summary.json.

`RunRecord` is the public callback that writes them, on the chief only (every worker runs
it: the runner says which process is the chief). A run is every session that trained in one
model_dir — the first, each resume after a preemption, each re-run — and its record covers
them all: a re-run never loses what an earlier one recorded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist.storage import agree_on_fault, cause_of, fault, strict_json, write_atomically
from tfdist.strategies import strategy_kind
from tfdist.training import model_dir_lock

log = logging.getLogger(__name__)

LOG_SUBDIR = "logs"
SUMMARY_FILE = "summary.json"
# One line per epoch trained, by every session of the run (resumes and re-runs alike): what
# summary.json's history and totals are made from, kept even when a session is killed.
HISTORY_FILE = "history.jsonl"
# Fields of a history.jsonl line that describe its session rather than the epoch.
_SESSION_FIELDS = ("session", "resumed_from_step", "steps_trained", "train_seconds")


@dataclasses.dataclass(frozen=True)
class RunHistory:
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
        # With the steps before the first recorded session's start: a session that stopped
        # before its first epoch's end left a checkpoint, but no line.
        first = self.sessions[0]["resumed_from_step"] if self.sessions else 0
        return first + sum(s["steps_trained"] for s in self.sessions)

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


def read_run_history(lines: list[dict]) -> RunHistory:
    """The run's history and sessions from history.jsonl's lines (oldest first).

    A session that started from step 0 begins a new run (a model_dir reused after its
    checkpoints were removed): what came before is not this run's. A session that resumed
    at step S replaces the epochs earlier sessions recorded after S.

    A session's steps_trained are those its epochs' lines count, the steps it trained again
    after a crash included, and at least those from its resume point to the next session's:
    a session stopped inside an epoch trained up to the checkpoint the next one resumed
    from, though no line records that epoch.
    """
    by_epoch: dict[int, dict] = {}
    sessions: dict[str, dict] = {}
    timings: dict[str, list[tuple[int, float]]] = {}
    ends: dict[str, int] = {}  # each session's last recorded step
    for line in lines:
        if line["session"] not in sessions:  # a session's first epoch: where it started
            start = line["resumed_from_step"]
            if start == 0:  # trained from scratch: a new run in this model_dir
                by_epoch.clear()
                sessions.clear()
                timings.clear()
                ends.clear()
            # Epochs an earlier session ended after this one's start were trained again.
            by_epoch = {e: h for e, h in by_epoch.items() if h["step"] <= start}
        session = sessions.setdefault(
            line["session"],
            {"started": line["session"], "resumed_from_step": line["resumed_from_step"],
             "epochs": [], "steps_trained": 0, "train_seconds": 0.0},
        )  # fmt: skip
        by_epoch[line["epoch"]] = {k: v for k, v in line.items() if k not in _SESSION_FIELDS}
        session["epochs"].append(line["epoch"])
        session["steps_trained"] += line["steps_trained"]
        session["train_seconds"] += line["train_seconds"]
        timings.setdefault(line["session"], []).append(
            (line["steps_trained"], line["train_seconds"])
        )
        ends[line["session"]] = line["step"]
    ordered = list(sessions.values())
    for i, session in enumerate(ordered):
        following = ordered[i + 1] if i + 1 < len(ordered) else None
        end = following["resumed_from_step"] if following else ends[session["started"]]
        session["steps_trained"] = max(session["steps_trained"], end - session["resumed_from_step"])
    return RunHistory(
        history=tuple(by_epoch[e] for e in sorted(by_epoch)),
        sessions=tuple(sessions.values()),
        epoch_timings=tuple(tuple(t) for t in timings.values()),
    )


_STALENESS_FIELDS = ("staleness_mean", "staleness_max", "applied_updates")


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
    # What the options that change the exchange measured (tfdist.StepHook.summary): the
    # bytes this worker sent under local SGD or gossip, the replicas' distance at the last
    # average, a staleness bound's timeouts, the momentum applied; empty without them.
    exchange: dict = dataclasses.field(default_factory=dict)
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


class RunRecord(keras.callbacks.Callback):
    """Writes a `tfdist.fit` run's record in `model_dir`, on the chief; see the module.

    Per epoch: a log line (`epoch 2/5  step 56  train_loss 0.31  ...  eval_accuracy 0.94`),
    a line of model_dir/history.jsonl and TensorBoard scalars in model_dir/logs. At the end:
    model_dir/summary.json (a TrainResult over every session of the run) and the model,
    exported to model_dir/export/model.keras. Metrics are named as the logs name them, with
    `train_` before training metrics and `eval_` for validation ones (Keras's `val_`).

    Example:

        record = tfdist.RunRecord("/tmp/run", global_batch_size=256)
        tfdist.fit(model, dataset_fn, epochs=5, steps_per_epoch=100,
                   callbacks=[tfdist.StepCheckpoint("/tmp/run"), record])
        record.result.examples_per_second

    Args:
      model_dir: the run's directory; None logs the epoch lines and writes nothing.
      global_batch_size: examples per step over every replica (for examples per second).
      eval_loss: the validation metric reported as eval_loss: Keras's loss by default
        (evaluation padded to static shapes reports a weighted cross-entropy instead).
      export: whether to export the trained model at the end.

    Attributes:
      result: the TrainResult of the run, once a session's training has ended.
    """

    reads_batch_logs = False  # it counts batches: no metrics need reading for it

    def __init__(
        self,
        model_dir: str | None,
        *,
        global_batch_size: int,
        eval_loss: str = "loss",
        export: bool = True,
    ):
        super().__init__()
        self.model_dir, self.global_batch_size = model_dir, global_batch_size
        self.eval_loss, self.export = eval_loss, export
        self.result: TrainResult | None = None
        self._runner = None
        self._writer = None
        self._lines: list[dict] = []
        self._holds_lock = False

    def set_runner(self, runner) -> None:
        """Called by tfdist.fit before training: the runner says who writes, and what it did."""
        self._runner = runner

    @property
    def _chief(self) -> bool:
        return self._runner is None or self._runner.job.is_chief

    @property
    def trained(self) -> bool:
        """Whether this session trained an epoch."""
        return bool(self._lines)

    # --- the callback -----------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._begin = time.perf_counter()
        self._session = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._lines, self.result = [], None
        self._resumed_from_step: int | None = None
        self._step = 0
        if self.model_dir and self._runner is not None and not self._holds_lock:
            model_dir_lock.agree_to_hold(self.model_dir, self._runner.job)
            self._holds_lock = True
        if self.model_dir and self._chief and self._writer is None:
            self._writer = tf.summary.create_file_writer(os.path.join(self.model_dir, LOG_SUBDIR))

    def on_epoch_begin(self, epoch, logs=None):
        steps = self.params.get("steps")
        self._epoch_start = epoch * steps if steps else self._step
        self._first_batch, self._end = None, 0.0
        self._start = time.perf_counter()

    def on_train_batch_begin(self, batch, logs=None):
        if self._first_batch is None:
            self._first_batch = batch
            if self._resumed_from_step is None:  # the session's first step
                self._resumed_from_step = self._epoch_start + batch

    def on_train_batch_end(self, batch, logs=None):
        self._step = self._epoch_start + batch + 1

    def steps_until_due(self) -> None:
        """Counts steps at any granularity: a call of several steps may run past it."""
        return None

    def on_test_begin(self, logs=None):
        self._end = self._end or time.perf_counter()  # evaluation is not training time

    def on_epoch_end(self, epoch, logs=None):
        end = self._end or time.perf_counter()
        steps = (
            0 if self._first_batch is None else self._step - self._epoch_start - self._first_batch
        )
        speed = steps * self.global_batch_size / max(end - self._start, 1e-9)
        metrics = self._metrics(logs or {}, examples_per_second=speed)
        self._end_epoch(epoch, metrics, steps=steps, seconds=end - self._start)

    def on_train_end(self, logs=None):
        if self.trained:
            self.finish()

    def release(self) -> None:
        """Lets go of model_dir's lock (when fit ends, however it ends)."""
        if self._holds_lock:
            self._holds_lock = False
            model_dir_lock.let_go(self.model_dir)

    # --- what is recorded -------------------------------------------------------------------------

    def _metrics(self, logs: dict, *, examples_per_second: float) -> dict[str, float]:
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        validation = {k[len("val_") :]: v for k, v in logs.items() if k.startswith("val_")}
        if self.eval_loss != "loss":  # its twin on training data, and Keras's loss, go
            train.pop(self.eval_loss, None)
        metrics = {f"train_{k}": v for k, v in train.items() if v is not None}
        metrics["learning_rate"] = float(
            keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)
        )
        metrics["examples_per_second"] = examples_per_second
        if validation:
            metrics.update(self.eval_metrics(validation))
        return metrics

    def eval_metrics(self, logs: dict[str, float]) -> dict[str, float]:
        """`eval_` metrics from evaluation logs (tfdist.evaluate's, or fit's without `val_`)."""
        loss = logs.get(self.eval_loss)
        named = {f"eval_{k}": v for k, v in logs.items() if k not in ("loss", self.eval_loss)}
        return {"eval_loss": loss, **named} if loss is not None else named

    def _end_epoch(self, epoch: int, metrics: dict, *, steps: int, seconds: float) -> None:
        line = {"epoch": epoch + 1, "step": self._step, **metrics, "session": self._session,
                "resumed_from_step": self._resumed_from_step or 0, "steps_trained": steps,
                "train_seconds": seconds}  # fmt: skip
        self._lines.append(line)
        if self._chief:
            parts = [f"epoch {epoch + 1}/{self.params['epochs']}", f"step {self._step}"]
            parts += [f"{name} {value:.4g}" for name, value in metrics.items()]
            log.info("%s", "  ".join(parts))
        if not self.model_dir:
            return
        path = os.path.join(self.model_dir, HISTORY_FILE)

        def record():  # the chief's: history.jsonl, then TensorBoard's scalars
            earlier = _read_text(path)
            if earlier and not earlier.endswith("\n"):
                earlier += "\n"
            write_atomically(path, earlier + strict_json(line, what=HISTORY_FILE) + "\n")
            if self._writer is not None:
                with self._writer.as_default(step=self._step):
                    for name, value in metrics.items():
                        tf.summary.scalar(name, value)
                self._writer.flush()

        # Every task calls this: a storage fault on the chief stops them all.
        self._write_on_chief("run's history", path, record)

    def _write_on_chief(self, what: str, path: str, write: Callable[[], None]) -> None:
        """The chief calls `write`; a storage fault there ends every task with one line (each
        task calls this at the same point)."""
        local = None
        if self._chief:
            try:
                write()
            except (tf.errors.OpError, OSError) as error:
                if (cause := cause_of(error)) is None:
                    raise
                local = fault(cause, what=what, path=path, resume=_RESUME)
        tally = self._runner.job.tally if self._runner is not None else list

        def peer_fault(cause):
            return fault(cause, what=what, path=path, resume=_RESUME, where="on the chief")

        agree_on_fault(tally, local, peer_fault)

    def history(self) -> RunHistory:
        """Every session's epochs: model_dir/history.jsonl on the chief, else this session's."""
        if not (self.model_dir and self._chief):
            return read_run_history(self._lines)
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
        return read_run_history(lines)

    def finish(
        self, eval_logs: dict[str, float] | None = None, *, step: int | None = None
    ) -> TrainResult:
        """Makes `result` and, on the chief with a model_dir, writes summary.json and exports
        the model. Called when training ends; call it again with `eval_logs` (from
        tfdist.evaluate) to report an evaluation made since (a session with nothing left to
        train evaluates where the run stands).

        Args:
          eval_logs: an evaluation made since training ended.
          step: where the run stands when this session trained nothing (the step of the
            checkpoint it restored); default: the last recorded epoch's step. They differ
            when a run was stopped after its last checkpoint but before its last epoch's
            record was written.
        """
        record = self.history()
        history = record.history
        last = history[-1] if history else {}
        evaluated = (
            self.eval_metrics(eval_logs)
            if eval_logs is not None
            else {k: v for k, v in last.items() if k.startswith("eval_")}
        )
        strategy = self._runner.job.strategy if self._runner else tf.distribute.get_strategy()
        replicas = strategy.num_replicas_in_sync
        figures = dict(self._runner.report().figures) if self._runner else {}
        staleness = {key: figures.pop(key) for key in _STALENESS_FIELDS if key in figures}
        resumed = self._resumed_from_step
        if resumed is None:  # nothing trained now: the run stands where it was restored
            resumed = max(step or 0, last.get("step", 0))
        self.result = TrainResult(
            strategy=strategy_kind(strategy),
            replicas=replicas,
            global_batch_size=self.global_batch_size,
            per_replica_batch_size=self.global_batch_size // replicas,
            steps=(steps := max(resumed, self._step)),
            epochs=self.params["epochs"],
            resumed_from_step=resumed,
            train_loss=last.get("train_loss"),
            train_accuracy=last.get("train_accuracy"),
            eval_loss=evaluated.get("eval_loss"),
            eval_accuracy=evaluated.get("eval_accuracy"),
            examples_per_second=record.examples_per_second(self.global_batch_size),
            wall_seconds=time.perf_counter() - self._begin,
            **staleness,
            exchange=figures,
            history=history,
            # Every step to the last was trained at least once: also those of a session
            # killed after its last checkpoint but before its epoch's line, which the
            # session resuming there (with nothing left to train) records no line for.
            steps_trained=max(record.steps_trained, steps),
            train_seconds=record.train_seconds,
            resume_points=tuple(record.resume_points),
            sessions=record.sessions,
        )
        if self.model_dir:
            path = os.path.join(self.model_dir, SUMMARY_FILE)
            self._write_on_chief(
                "run's summary", path, lambda: write_atomically(path, self.result.to_json())
            )
            if self.export:
                export_dir = os.path.join(self.model_dir, "export")
                self._write_on_chief("exported model", export_dir, lambda: self._export(export_dir))
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        return self.result

    def _export(self, export_dir: str) -> None:
        tf.io.gfile.makedirs(export_dir)
        self.model.save(os.path.join(export_dir, "model.keras"))
        log.info("Wrote %s and exported the model to %s", SUMMARY_FILE, export_dir)


# A record that could not be written loses no training: the checkpoints hold it.
_RESUME = "from the last checkpoint, and records the rest"


def _read_text(path: str) -> str:
    if not tf.io.gfile.exists(path):
        return ""
    with tf.io.gfile.GFile(path) as f:
        return f.read()
