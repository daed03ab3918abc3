"""`python -m tools.tfjob ...` is `tfdist-k8s tfjob ...`, kept so existing commands still work.

This tool used to take only experiments.train's flags after `--` and put
`python -m experiments.train` in front of them; it still does when what follows `--` starts
with a flag (or is missing), while a whole command after `--` is passed on as it is. The
library itself runs only the command it is given:

  python -m tools.tfjob --name digits --image IMAGE --workers 2 -- --config=digits_cnn
  tfdist-k8s tfjob --name digits --image IMAGE --workers 2 \\
      -- python -m experiments.train --config=digits_cnn       # the same manifest
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tfdist.k8s import cli

TRAIN_COMMAND = ("python", "-m", "experiments.train")


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `tfdist-k8s tfjob` with experiments.train as the default command.

    Args:
      argv: the arguments after the program name; `sys.argv[1:]` by default.

    Returns:
      tfdist-k8s's exit code: 0, or 2 for bad usage.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    options, command = argv[:split], argv[split + 1 :]
    if not command or command[0].startswith("-"):
        command = [*TRAIN_COMMAND, *command]
    return cli.main(["tfjob", *options, "--", *command])


if __name__ == "__main__":
    sys.exit(main())
