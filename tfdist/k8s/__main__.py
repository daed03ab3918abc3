"""`python -m tfdist.k8s ...` is `tfdist-k8s ...`."""

import sys

from tfdist.k8s.cli import main

sys.exit(main())
