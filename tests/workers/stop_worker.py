"""A user's own tfdist.fit script that routes its stop signals, as the README shows; a task
of it is stopped mid-epoch 2, for tests/test_fit_multiworker.py:

  tfdist-launch --workers 2 --max_restarts 1 -- python -m tests.workers.stop_worker sigterm OUT
  tfdist-launch --workers 2 --grace 120 --max_restarts 1 -- \
      python -m tests.workers.stop_worker sigkill OUT
  tfdist-launch --workers 2 --grace 120 --max_restarts 1 -- \
      python -m tests.workers.stop_worker sigkill_zero3 OUT          # or sigkill_pipeline

sigterm: worker:1 receives SIGTERM once, at epoch 2 batch 3; every worker backs up at the same
  step (BackupAndRestore), exits with the restartable code, and the restarted job resumes
  there and finishes. Its steps take a fifth of a second (`SlowSteps`): the workers vote on a
  stop about once a second (tfdist.training.preemption), so the vote comes mid-epoch.
sigkill: worker:1 is SIGKILLed at epoch 2 batch 3; worker:0 is left waiting for it. A
  BackupAndRestore every step: the restarted job resumes at that step and finishes.
sigkill_zero3, sigkill_pipeline: the same kill, with the model's weights sharded over the two
  processes (zero3, built in tfdist.host_scope) or cut into a stage on each (a pipeline of
  2 stages); a tfdist.StepCheckpoint every 2 steps, so the restarted job resumes at step 10
  of 16 and trains the rest.
"""

from __future__ import annotations

import tfdist

if __name__ == "__main__":
    tfdist.route_stop_signals()  # before TensorFlow starts a thread

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import fit_models  # noqa: E402

SIGNALS = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
MODES = [*SIGNALS, "sigkill_zero3", "sigkill_pipeline"]
AT = (1, 2)  # (epoch, batch), both from 0


class SignalOnce(keras.callbacks.Callback):
    """Sends `signum` to this process at AT the first time the job runs (a marker file)."""

    def __init__(self, marker: str, signum: int):
        super().__init__()
        self.marker, self.signum, self.epoch = marker, signum, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == AT and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), self.signum)


class SlowSteps(keras.callbacks.Callback):
    """Steps of a model whose step takes `seconds` (a large one's), on the first run."""

    def __init__(self, marker: str, seconds: float):
        super().__init__()
        self.marker, self.seconds = marker, seconds

    def on_train_batch_end(self, batch, logs=None):
        if not os.path.exists(self.marker):
            time.sleep(self.seconds)


def main(mode: str, out: str) -> None:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{task['type']}_{task['index']}"
    shared = os.path.join(out, "shared")
    os.makedirs(shared, exist_ok=True)
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    layout = mode.partition("_")[2]
    keywords = {}
    with tfdist.host_scope(strategy) if layout else strategy.scope():
        model, data = fit_models.cnn()
    if layout:
        callbacks = [tfdist.StepCheckpoint(os.path.join(shared, "run"), every_n_steps=2)]
    else:
        # sigkill: a backup every step, so the restart resumes mid-epoch where the crash was.
        every = 1 if mode == "sigkill" else "epoch"
        callbacks = [
            keras.callbacks.BackupAndRestore(os.path.join(shared, "backup"), save_freq=every)
        ]
    if layout == "zero3":
        keywords["shard_optimizer"] = "zero3"
    elif layout == "pipeline":  # the convolution on worker:0, Flatten and Dense on worker:1
        keywords["pipeline"] = tfdist.parallel.Pipeline(cut_before=[model.layers[1].name])
    marker = os.path.join(shared, "signalled")
    if mode == "sigterm":
        callbacks.append(SlowSteps(marker, 0.2))
    if name == "worker_1":
        callbacks.append(SignalOnce(marker, SIGNALS[mode[:7]]))
    tfdist.fit(model, data, epochs=fit_models.EPOCHS, verbose=0, callbacks=callbacks, **keywords)
    os.makedirs(os.path.join(out, name), exist_ok=True)
    np.savez(os.path.join(out, name, "cnn.npz"), *model.get_weights())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("tfdist").setLevel(logging.INFO)
    if len(sys.argv) != 3 or sys.argv[1] not in MODES:
        sys.exit(f"usage: stop_worker {{{','.join(MODES)}}} OUT")
    main(sys.argv[1], sys.argv[2])
