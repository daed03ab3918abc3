"""`python -m tfdist.launch ...` is `tfdist-launch ...`."""

import sys

from tfdist.launch.cli import main

sys.exit(main())
