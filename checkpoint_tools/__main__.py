"""`python -m checkpoint_tools ...` is the same as the `fsdpx-ckpt` console script."""

import sys

from checkpoint_tools.cli import main

sys.exit(main())
