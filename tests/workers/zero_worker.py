"""A user's script with sharded optimizer state, run by every worker of a launched job.

  python -m tools.launch --workers 3 -- python -m tests.workers.zero_worker OUT matrix
  python -m tools.launch --workers 4 -- python -m tests.workers.zero_worker OUT resume EPOCHS
  python -m tools.launch --workers 2 -- python -m tests.workers.zero_worker OUT resume EPOCHS matrix
  python -m tools.launch --workers 2 -- python -m tests.workers.zero_worker OUT gemma
  python -m tools.launch --workers 2 -- python -m tests.workers.zero_worker OUT alone

`matrix`: each worker trains the RUNS of tests/zero_cases.py's models unsharded and sharded
(zero1, zero2, zero3; zero2 with accumulation on a two-output model; keras.io's GAN, whose
train_step applies two optimizers of its own, under zero2), and writes the weights (and the
GAN's slot bytes per worker) to OUT/matrix_<N workers>/<task>/.
`resume EPOCHS`: Adam unsharded, with zero2 and with zero3 to EPOCHS, each resuming from its own
StepCheckpoint under OUT (see `resume`). `gemma`: keras-hub's Gemma causal LM under zero3.
`alone`: a whole read made by one worker only (see `alone`).
All run under one multi_worker_mirrored strategy;
tests/test_zero.py compares what they wrote.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tests import zero_cases  # noqa: E402

# (optimizer, stage): each stage against its optimizer unsharded. Across processes what is
# new is the exchange (zero1's all-reduce and slice, zero2's reduce-scatter, zero3's gathers,
# a clipping norm over every process's slices, LAMB's whole-variable partition); each
# optimizer's update under each stage is checked over local devices in tests/test_zero.py.
RUNS = [
    ("adam", None), ("adam", "zero1"), ("adam", "zero2"), ("adam", "zero3"),
    ("sgd_momentum", None), ("sgd_momentum", "zero3"),
    ("adamw_clipnorm", None), ("adamw_clipnorm", "zero2"),
    ("lamb", None), ("lamb", "zero2"),
]  # fmt: skip


def matrix(out: str, strategy) -> None:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    workers = strategy.num_replicas_in_sync
    here = os.path.join(out, f"matrix_{workers}", f"{task['type']}_{task['index']}")
    os.makedirs(here, exist_ok=True)
    x, y = zero_cases.data()
    batch = zero_cases.GLOBAL_BATCH
    for optimizer, shard in RUNS:
        # zero3's Adam is built where no device holds it whole; its SGD under the strategy's
        # scope (moved to the host when fit begins).
        host = optimizer == "adam" and shard == "zero3"
        with tfdist.host_scope(strategy) if host else strategy.scope():
            model = zero_cases.mlp(optimizer)
        tfdist.fit(model, x, y, batch_size=batch, shuffle=False, verbose=0, shard_optimizer=shard)
        name = f"{optimizer}_{shard or 'plain'}"
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
    # A functional model with two outputs: zero2 with 2 micro-batches a step, against plain.
    targets = zero_cases.two_output_targets(x, y)
    for name, keywords in (
        ("two_outputs_plain", {}),
        ("two_outputs_zero2_accumulate2", {"shard_optimizer": "zero2", "accumulate_steps": 2}),
    ):
        with strategy.scope():
            model = zero_cases.two_outputs()
        history = tfdist.fit(
            model, x, targets, batch_size=batch, epochs=2, shuffle=False, verbose=0, **keywords
        )
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{name}.json"), "w") as f:
            json.dump(history.history, f)
    gan(here, strategy)


def gan(here: str, strategy) -> None:
    """keras.io's GAN (a train_step that applies d_optimizer and g_optimizer itself), plain
    and under zero2: the weights, and the bytes of each own optimizer's slots this worker
    holds against their whole."""
    from tests import custom_step_models
    from tfdist.parallel import ShardedUpdate

    for name, hooks in (("gan_plain", []), ("gan_zero2", [ShardedUpdate(stage=2)])):
        with strategy.scope():
            model, data = custom_step_models.gan()
        data = data.unbatch().batch(zero_cases.GLOBAL_BATCH)  # a multiple of 2, 3 and 4
        tfdist.fit(model, data, verbose=0, step_hooks=hooks)
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
    held = {}
    for attribute in ("d_optimizer", "g_optimizer"):
        (sibling,) = hooks[0].chain_for(getattr(model, attribute))
        held[attribute] = {
            "held": sum(replica.slot_bytes() for replica in sibling.replicas),
            "whole": 2 * sum(int(np.prod(v.shape)) * 4 for v in sibling.variables),  # m, v
            "model_optimizer_variables": len(getattr(model, attribute).variables),
        }
    with open(os.path.join(here, "gan_zero2_slots.json"), "w") as f:
        json.dump(held, f)


def resume(out: str, strategy, epochs: int) -> None:
    """Trains Adam unsharded, with zero2 and with zero3 to `epochs`, each resuming from its own
    StepCheckpoint directory under OUT (written by an earlier launch, with any number of
    workers), and writes the weights to OUT/epoch<E>/<task>/."""
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    here = os.path.join(out, f"epoch{epochs}", f"{task['type']}_{task['index']}")
    os.makedirs(here, exist_ok=True)
    x, y = zero_cases.data()
    for shard in (None, "zero2", "zero3"):
        with strategy.scope():
            model = zero_cases.mlp("adam")
        checkpoint = tfdist.StepCheckpoint(os.path.join(out, f"checkpoints_{shard or 'plain'}"))
        tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=epochs, shuffle=False,
            verbose=0, shard_optimizer=shard, callbacks=[checkpoint],
        )  # fmt: skip
        np.savez(os.path.join(here, f"{shard or 'plain'}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{shard or 'plain'}.json"), "w") as f:
            json.dump({"iterations": int(model.optimizer.iterations.numpy())}, f)


def gemma(out: str, strategy) -> None:
    """keras-hub's Gemma causal LM under zero3, built in host_scope, 2 epochs; writes the
    weights to OUT/gemma_<N workers>/<task>.npz."""
    from tools import keras_hub_models

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    here = os.path.join(out, f"gemma_{strategy.num_replicas_in_sync}")
    os.makedirs(here, exist_ok=True)
    with tfdist.host_scope(strategy):
        model = keras_hub_models.gemma_causal_lm()
    tfdist.fit(model, keras_hub_models.token_data(), epochs=2, verbose=0, shard_optimizer="zero3")
    np.savez(os.path.join(here, f"{task['type']}_{task['index']}.npz"), *model.get_weights())


def alone(out: str, strategy) -> None:
    """zero3, then only worker 0 reads the weights whole (a collective the others never
    make, as a chief-only save would): it writes the error it gets to OUT/alone.txt."""
    import time

    from tfdist.parallel import stand_in

    stand_in.WHOLE_READ_TIMEOUT_SECONDS = 5.0
    x, y = zero_cases.data()
    with tfdist.host_scope(strategy):
        model = zero_cases.mlp("adam")
    tfdist.fit(model, x, y, batch_size=zero_cases.GLOBAL_BATCH, verbose=0, shard_optimizer="zero3")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    written = os.path.join(out, "alone.txt")
    if task["index"] != 0:
        # Alive, and not reading, until worker 0's read has given up (45 s at most): the
        # read waits for this worker, then gives up on its own.
        deadline = time.monotonic() + 45
        while not os.path.exists(written) and time.monotonic() < deadline:
            time.sleep(0.2)
        return
    started = time.monotonic()
    try:
        model.get_weights()
        message = "no error"
    except stand_in.ReadTogetherError as error:
        message = str(error)
    with open(written + ".tmp", "w") as f:
        json.dump({"message": message, "seconds": time.monotonic() - started}, f)
    os.replace(written + ".tmp", written)


def main(out: str, jobs: list[str]) -> None:
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    if jobs == ["alone"]:
        alone(out, strategy)
        return
    if jobs[:1] == ["resume"]:
        resume(out, strategy, int(jobs[1]))
        jobs = jobs[2:]
    if jobs[:1] == ["gemma"]:
        gemma(out, strategy)
        jobs = jobs[1:]
    if jobs == ["matrix"]:
        matrix(out, strategy)
    elif jobs:
        sys.exit(f"expected [resume EPOCHS] [gemma] [matrix]. Received: {' '.join(jobs)}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
