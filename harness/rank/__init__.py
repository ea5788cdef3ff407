"""What runs inside a rank: the worker loop, step timing, collective counters, memory census, faults,
the compute-only pass and the profiler pass. Started by the launchers of harness.launch."""
