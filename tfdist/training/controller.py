"""The loop of `tfdist.fit`: epochs, callbacks, resuming, preemption and agreement.

It is Keras's fit loop (TensorFlowTrainer.fit) written against an Engine (engine.py) and its
Job (job.py): it never asks which strategy it runs under. What differs between strategies
is the engine's (its steps) and the job's (iterators, the chief, lockstep workers, votes,
failures).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import keras
import tensorflow as tf

from tfdist import compat, signals
from tfdist.training import auto_steps_per_execution, fit_callbacks
from tfdist.training.engine import Engine
from tfdist.training.fit_data import FitData
from tfdist.training.preemption import Preempted, PreemptionWatcher
from tfdist.training.step_times import PHASES, describe

log = logging.getLogger(__name__)


class Controller:
    """One `tfdist.fit` call's loop over epochs; see the module docstring.

    Args:
      model: the compiled, built model.
      runner: its engine (built).
      data: the training data.
      validation: the validation data, or None.
      steps: steps per epoch (None: one pass over the data, its length found by the first).
      user_steps: the steps_per_epoch the user gave (None: an epoch is a pass).
      callbacks: the user's callbacks.
      options: fit's other arguments (epochs, initial_epoch, verbose, validation_steps,
        validation_freq).
    """

    def __init__(
        self,
        *,
        model: keras.Model,
        runner: Engine,
        data: FitData,
        validation: FitData | None,
        steps: int | None,
        user_steps: int | None,
        callbacks: list[keras.callbacks.Callback],
        options: dict,
    ):
        self.model, self.runner, self.data, self.validation = model, runner, data, validation
        self.job = job = runner.job
        self.steps, self.user_steps = steps, user_steps
        self.callbacks = callbacks
        self.epochs = options["epochs"]
        self.initial_epoch = options["initial_epoch"]
        self.verbose = options["verbose"]
        # verbose=0 is quiet, as Keras's fit is: a call's own lines (the step-time breakdown,
        # the length 'auto' chose) go to debug; warnings, errors and a resume stay.
        self.say = log.debug if self.verbose == 0 else log.info
        self.validation_steps = options["validation_steps"]
        self.validation_freq = options["validation_freq"]
        # Steps a call: fit's steps_per_execution, else the model's (compile's); 'auto'
        # measures the first calls, then chooses (tfdist.training.auto_steps_per_execution).
        per_call = options.get("steps_per_execution")
        self.auto = None
        if per_call == auto_steps_per_execution.AUTO:
            per_call = 1
            needing = auto_steps_per_execution.every_step_needed(callbacks)
            if not job.waits_for_steps:
                self.say(
                    "steps_per_execution='auto': one step a closure, as a closure's time is "
                    "hidden by its asynchronous dispatch; give a number to run more"
                )
            elif needing and job.is_chief:
                self.say(
                    "steps_per_execution='auto': one step a call, as %s hook every batch",
                    ", ".join(needing),
                )
            elif not needing:
                self.auto = auto_steps_per_execution.AutoStepsPerExecution(
                    job.tally, job.is_chief, self.say
                )
        self.per_call = max(1, int(per_call or model.steps_per_execution))
        self.iterator = None
        self.pass_position = 0
        self.ran = 0  # steps run in this call of fit
        # Steps run without asking for the end of the data when its length is known:
        # streaming data never ends, and a known number of batches per epoch bounds each pass
        # (asking costs a collective per step across workers).
        self.bounded = (
            job.streams
            or data.infinite
            or (
                user_steps is None
                and data.num_batches is not None
                and (data.form == "dataset" or job.lockstep_workers == 1)
            )
        )
        self._summary_writers: dict[str, tf.summary.SummaryWriter] = {}

    # --- the whole call ---------------------------------------------------------------------------

    def fit(self) -> keras.callbacks.History:
        runner, job, model = self.runner, self.job, self.model
        job.check_callbacks(self.callbacks)
        is_chief = job.is_chief
        progress_bar = self.verbose != 0 and is_chief
        # Reading logs over every worker is a collective, so the workers do it all or none:
        # a callback only some workers were given counts for all. A progress bar alone reads
        # its own process's replicas, which costs no collective.
        wanted = any(fit_callbacks.reads_batch_logs(c) for c in self.callbacks)
        self.global_logs = job.agree(wanted)
        # verbose=2's bar prints each epoch's end only: it needs no batch's logs.
        bar_reads_batches = progress_bar and self.verbose != 2
        self.batch_logs = "global" if self.global_logs else ("local" if bar_reads_batches else None)
        for callback in self.callbacks:  # tfdist's callbacks ask the runner (who writes, ...)
            if callable(getattr(callback, "set_runner", None)):
                callback.set_runner(runner)
        with (
            signals.doing(
                f"training in tfdist.fit (epochs {self.initial_epoch + 1}-{self.epochs})"
            ),
            fit_callbacks.writes_redirected(self.callbacks, is_chief=is_chief) as redirect,
            PreemptionWatcher(
                job.tally, is_chief=is_chief, saves=self._saves_on_stop()
            ) as self.watcher,
            fit_callbacks.released(self.callbacks),
        ):
            self.redirect = redirect
            callback_list = fit_callbacks.callback_list(
                self.callbacks, add_history=True, add_progbar=progress_bar, verbose=self.verbose,
                epochs=self.epochs, steps=self.steps, model=model,
            )  # fmt: skip
            self.callback_list = callback_list
            model.stop_training = False
            callback_list.on_train_begin()
            redirect.after_restore()
            start_epoch, start_step = self._resume_point()
            steps = self.steps
            job.begin(
                total_steps=self.epochs * steps if steps else None,
                checkpoint_status=self._checkpoint_status(),
            )
            runner.begin(
                start_epoch * steps + start_step
                if steps
                else int(model.optimizer.iterations.numpy())
            )
            training_logs = None
            try:
                for epoch in range(start_epoch, self.epochs):
                    epoch_logs = self._epoch(epoch, start_step if epoch == start_epoch else 0)
                    if self.validation is not None and compat.should_evaluate(
                        model, epoch, self.validation_freq
                    ):
                        callback_list.on_test_begin()
                        val_logs = runner.evaluate(self.validation, self.validation_steps)
                        callback_list.on_test_end(val_logs)
                        epoch_logs.update({f"val_{k}": v for k, v in val_logs.items()})
                    callback_list.on_epoch_end(epoch, epoch_logs)
                    # The last epoch's end has saved what it saves: no step boundary comes.
                    self.watcher.finished = epoch == self.epochs - 1
                    self._report_step_times(epoch)  # under the progress bar's closing line
                    training_logs = epoch_logs
                    if self._agreed_stop():
                        break
            finally:
                self._close_writers()
            if isinstance(model.optimizer, keras.optimizers.Optimizer) and self.epochs > 0:
                model.optimizer.finalize_variable_values(model.trainable_weights)
            callback_list.on_train_end(logs=training_logs)
        return model.history

    # --- one epoch --------------------------------------------------------------------------------

    def _iterator_for(self, epoch: int, skip: int):
        if self.job.streams:
            return self.job.iterator(self.data)
        if self.user_steps is None:  # each epoch is one pass over the data (Keras's rule)
            return self.job.iterator(self.data, skip=skip)
        # With steps_per_epoch the data is one stream across epochs, as in Keras: a pass
        # that runs out ends its epoch early, and the next epoch starts a new pass.
        if self.iterator is None:
            position = (epoch - self.initial_epoch) * self.user_steps + skip
            if self.data.num_batches:
                position %= self.data.num_batches
            self.pass_position = position
            self.iterator = self.job.iterator(self.data, skip=position)
        return self.iterator

    def _epoch(self, epoch: int, start_step: int) -> dict[str, float]:
        runner, callbacks = self.runner, self.callback_list
        runner.reset()
        callbacks.on_epoch_begin(epoch)
        iterator = self._iterator_for(epoch, start_step)
        step = start_step
        last_call = None  # (its steps, when it started): 'auto' times a call to the next
        while self.steps is None or step < self.steps:
            n = self._steps_this_call(step)
            started = time.perf_counter()
            if last_call is not None:
                self.auto.observe(last_call[0], started - last_call[1])
                last_call = None
            callbacks.on_train_batch_begin(step)
            done, logs = runner.train(iterator, n, bounded=self.bounded, logs=self.batch_logs)
            if done:
                step += done
                self.ran += done
                self.watcher.stepped = True
                callbacks.on_train_batch_end(step - 1, logs)
                # Lockstep workers vote at every epoch's end, and between as the last vote
                # said (a vote is a collective; one worker asks itself at every call).
                now = self.job.lockstep_workers == 1 or (
                    self.steps is not None and step >= self.steps
                )
                if self.watcher.agreed(self.ran, now=now):
                    self._preempted(epoch, step)
                if self.auto is not None:
                    last_call = (done, started)
            if done < n:  # the data ran out
                if self.user_steps is not None:
                    self.iterator = None
                    log.warning(
                        "The training data ran out in epoch %d after %d of %d steps: the "
                        "epoch ends there and the next one starts a new pass (as in Keras). "
                        "Give the data steps_per_epoch x epochs batches, e.g. with .repeat().",
                        epoch + 1, step, self.steps,
                    )  # fmt: skip
                break
            if self.global_logs and self._agreed_stop():
                break
        if self.steps is None:
            self.steps = step  # a first whole pass tells the length of an epoch
        if self.iterator is not None:
            self.pass_position += step - start_step
            if self.data.num_batches and self.pass_position >= self.data.num_batches:
                self.iterator = None
        runner.settle()
        return runner.logs()

    def _steps_this_call(self, step: int) -> int:
        """How many steps the next call runs: steps_per_execution, cut at the epoch's end
        and at the next step a callback must see end (a checkpoint's `every_n_steps`), so
        that what runs at a step boundary runs at the step it names."""
        n = self.per_call if self.auto is None else self.auto.length()
        n = n if self.steps is None else min(n, self.steps - step)
        for callback in self.callbacks:
            due = getattr(callback, "steps_until_due", None)
            if n > 1 and callable(due) and (left := due()) is not None:
                n = max(1, min(n, left))
        return n

    def _agreed_stop(self) -> bool:
        # Callbacks decide on the same reduced logs everywhere; the agreement also covers a
        # decision only one worker took, which would otherwise leave the others waiting.
        stop = self.job.agree(bool(self.model.stop_training))
        self.model.stop_training = stop
        return stop

    # --- preemption -------------------------------------------------------------------------------

    def _saves_on_stop(self) -> bool:
        """Whether a stop signal would save anything (what `_preempted` saves through)."""
        return any(
            callable(getattr(c, "backup_now", None))
            or isinstance(c, keras.callbacks.BackupAndRestore)
            for c in self.callbacks
        )

    def _preempted(self, epoch: int, step: int) -> None:
        """A stop signal reached a worker: every worker saves at this step, then stops."""
        self.runner.settle()  # every scheduled step landed; the replicas one model
        global_step = epoch * (self.steps or step) + step
        saved, saved_as = None, "checkpoint"
        with signals.deferred():  # a second signal must not leave half a backup behind
            for callback in self.callbacks:
                if callable(getattr(callback, "backup_now", None)):
                    saved = callback.backup_now(epoch=epoch, step=global_step) or saved
                elif isinstance(callback, keras.callbacks.BackupAndRestore):
                    compat.backup_now(callback, epoch=epoch)
                    saved = self.redirect.original(callback, "backup_dir")
                    saved_as = "backup"
        signum = self.watcher.signum or signal.SIGTERM  # a peer's signal stops us too
        raise Preempted(global_step, saved, signum, saved_as=saved_as)

    # --- resuming ---------------------------------------------------------------------------------

    def _resume_point(self) -> tuple[int, int]:
        """(epoch, steps into it) where training starts: after a restored backup if any.

        A callback with a `restored_step` attribute (tfdist's own checkpoints) gives the global
        step it restored; one with `restored_epoch` (tfdist.ray's) the number of epochs its
        checkpoint had completed. Keras's BackupAndRestore restores the weights and optimizer
        and the epoch the backup was taken in; the optimizer's iteration count then says how
        far into that epoch it was.
        """
        model, steps = self.model, self.steps
        restored = compat.take_restored_epoch(model)
        for callback in self.callbacks:
            step = getattr(callback, "restored_step", None)
            if step and steps:
                return divmod(int(step), steps)
            epoch = getattr(callback, "restored_epoch", None)
            if epoch:
                return int(epoch), 0
        if restored is None or not fit_callbacks.backups(self.callbacks):
            return self.initial_epoch, 0
        epoch = int(restored)
        if steps is None:
            return epoch, 0
        into = int(model.optimizer.iterations.numpy()) - epoch * steps
        if 0 < into < steps:
            log.info("Resuming from the backup at epoch %d, step %d of %d", epoch + 1, into, steps)
            return epoch, into
        if into == steps:  # the backup was taken after the epoch's last step, before its end
            return epoch + 1, 0
        return epoch, 0

    def _checkpoint_status(self):
        """A function giving (step, directory) of the newest checkpoint or backup, if any.

        A callback that saves checkpoints of its own may offer `checkpoint_status()`; the
        message when a peer or a parameter server dies then says where a restart resumes.
        """
        for callback in self.callbacks:
            if callable(getattr(callback, "checkpoint_status", None)):
                return callback.checkpoint_status
        for callback in fit_callbacks.backups(self.callbacks):
            directory = self.redirect.original(callback, "backup_dir")
            return lambda directory=directory: (None, directory)
        return None

    # --- the step-time breakdown ------------------------------------------------------------------

    def _report_step_times(self, epoch: int) -> None:
        if not self.job.is_chief:  # only the chief reports (the other workers ask nothing)
            return
        times = self.runner.report().step_times
        if times is None:
            return
        self.say("Epoch %d: %s", epoch + 1, describe(times))
        for callback in self.callbacks:
            if isinstance(callback, keras.callbacks.TensorBoard):
                # A run of its own beside Keras's "train" and "validation" runs.
                writer = self._writer(os.path.join(os.fspath(callback.log_dir), "step_time"))
                with writer.as_default():
                    for phase in PHASES:
                        tf.summary.scalar(f"step_time/{phase}_ms", times[phase], step=epoch)
                writer.flush()

    def _writer(self, directory: str) -> tf.summary.SummaryWriter:
        if directory not in self._summary_writers:
            self._summary_writers[directory] = tf.summary.create_file_writer(directory)
        return self._summary_writers[directory]

    def _close_writers(self) -> None:
        for writer in self._summary_writers.values():
            writer.close()
        self._summary_writers.clear()
