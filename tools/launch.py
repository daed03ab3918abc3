"""`python -m tools.launch` from a checkout: the same as the installed `tfdist-launch`.

The launcher lives in the package (tfdist/launch/); `tfdist-launch --help` documents it.
"""

import sys

from tfdist.launch import *  # noqa: F403  (tests and scripts use its names through here)
from tfdist.launch import main

if __name__ == "__main__":
    sys.exit(main())
