"""Exits at once (status 3) if this process plays TASK, else runs COMMAND in its place.

    python -m tests.workers.fail_as worker:1 -- python -m experiments.train ...

A task that dies the moment it starts, for the start-up fault tests and tools.chaos.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> None:
    task, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: python -m tests.workers.fail_as TASK -- COMMAND...")
    me = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    if f"{me.get('type')}:{me.get('index')}" == task:
        print(f"{task}: exiting at start, as asked", flush=True)
        sys.exit(3)
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
