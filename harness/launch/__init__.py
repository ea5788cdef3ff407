"""What starts ranks: the launchers (python, torchrun, horovodrun, DeepSpeed's) and the placements
(this host, a hostfile's hosts, Slurm) that turn a cell into processes and clean up after them."""
