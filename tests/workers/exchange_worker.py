"""A user's script with local SGD and gossip, run by every worker of a launched job.

  python -m tools.launch --workers 4 -- python -m tests.workers.exchange_worker OUT

Two epochs of SGD with momentum for each of CASES: plain and average_every=1 (both
synchronous SGD, for tests/test_local_sgd.py to compare with Keras's fit), average_every=3
and both gossip topologies (to compare with the same over 4 local devices). Each case
writes the weights to OUT/<task>/<case>.npz and the hook's summary to <case>.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import tfdist  # noqa: E402
from tests import zero_cases  # noqa: E402
from tfdist.parallel import Gossip, LocalSGD  # noqa: E402

EPOCHS = 2
CASES = {
    "plain": None,
    "average_every_1": lambda: LocalSGD(1),
    "average_every_3": lambda: LocalSGD(3),
    "gossip_ring": lambda: Gossip("ring"),
    "gossip_exponential": lambda: Gossip("exponential"),
}


def main(out: str) -> None:
    strategy = tfdist.build_strategy("multi_worker_mirrored")
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    here = os.path.join(out, f"{task['type']}_{task['index']}")
    os.makedirs(here, exist_ok=True)
    x, y = zero_cases.data()
    for name, make in CASES.items():
        hook = make() if make else None
        with strategy.scope():
            model = zero_cases.mlp("sgd_momentum")
        tfdist.fit(
            model, x, y, batch_size=zero_cases.GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
            verbose=0, step_hooks=[hook] if hook else (),
        )  # fmt: skip
        np.savez(os.path.join(here, f"{name}.npz"), *model.get_weights())
        with open(os.path.join(here, f"{name}.json"), "w") as f:
            json.dump(hook.summary() if hook else {}, f)


if __name__ == "__main__":
    main(sys.argv[1])
