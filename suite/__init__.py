"""The asv regression suite: benchmarks over a small CPU matrix run through the harness (see benchmarks/)."""
