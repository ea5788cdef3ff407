"""`python -m harness` runs the command line (see harness.cli)."""

import gc
import sys

# Importing torch and the registries makes some 170,000 objects that live as long as the process; the collector
# walked them again and again as they were made, and at every collection after: a third of a dry run's CPU here.
# Collection is off while they are made, and they are then frozen out of its reach (gc.freeze).
gc.disable()
from harness.cli import main  # noqa: E402

gc.freeze()
gc.enable()

sys.exit(main())
