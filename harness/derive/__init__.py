"""Every derived figure, computed from raw rows when they are read: torch-free and registry-free.

Rows hold measurements (step times, losses, norms, counted collectives, memory readings) and the facts a
strategy recorded about itself (its sharding, its bytes per parameter, the collectives it should issue).
Throughput, efficiencies, exposed communication, wire bytes, MFU, memory predictions, intervals, parity
verdicts and regression judgements are computed here from those rows, so a corrected formula corrects
every row already written, and the console summary, `report`, `compare` and the asv suite agree.

Nothing in this package may import torch, deepspeed, horovod, `harness.strategies` or `workloads`.
"""
