"""An emulated cluster on one machine, to measure what a network between nodes does to each strategy and
to check projections against: nodes as network namespaces behind a switch, links shaped by tc.

    python -m harness run --matrix full --workload gpt-tiny --world-sizes 1,2,4 --emulate-link 100mbit
    python -m harness comm --world-size 2 --emulate-link 100mbit

`network` builds and tears down the namespaces and links; `sshd` gives each node an sshd for launchers that
reach hosts by ssh (horovodrun). The placement that runs cells on the nodes is
harness.launch.placement.emulated.
"""
