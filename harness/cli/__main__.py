"""`python -m harness.cli`, as before harness/cli.py became this package: the same as `python -m harness`."""

import runpy

runpy.run_module("harness", run_name="__main__", alter_sys=True)
