"""`python -m harness` runs the command line (see harness.cli)."""

import sys

from harness.cli import main

sys.exit(main())
