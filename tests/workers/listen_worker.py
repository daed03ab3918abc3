"""A task that starts its TensorFlow server (multi_worker_mirrored), all-reduces once, writes
the TCP ports listening in its own network namespace to OUT/listen_<index>.json, and stays
up until OUT/done exists, so that a test can look at the same ports from outside."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def listening_ports() -> dict[int, str]:
    """Port -> local address of every listening TCP socket this namespace holds."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, state = fields[1], fields[3]
            if state == "0A":  # LISTEN
                host, port = address.rsplit(":", 1)
                found[int(port, 16)] = host
    return found


def main(out: str) -> None:
    import tensorflow as tf

    import tfdist

    strategy = tfdist.build_strategy("multi_worker_mirrored")
    total = strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)
    config = json.loads(os.environ["TF_CONFIG"])
    index = config["task"]["index"]
    record = {
        "total": float(total),
        "address": config["cluster"]["worker"][index],
        "ports": listening_ports(),
    }
    done = Path(out, f"listen_{index}.json")
    Path(f"{done}.tmp").write_text(json.dumps(record))
    os.replace(f"{done}.tmp", done)  # whole when its name appears
    deadline = time.monotonic() + 120
    while not Path(out, "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
