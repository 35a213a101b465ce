"""`python -m monitor` is `fsdpx-monitor`."""

import sys

from monitor.cli import main

sys.exit(main())
