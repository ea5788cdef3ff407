"""What starts ranks. A strategy names its launcher (`launcher/`: python, torchrun, horovodrun, DeepSpeed's),
which builds the argv that starts a cell's ranks on a node; a run chooses its placement (`placement/`: this
host, a hostfile's hosts, Slurm, Kubernetes manifests), which turns those argvs into commands here, chooses the
rendezvous port where it is served and cleans up where the ranks ran. `plan.py` puts the two together for one
launch, `cell.py` runs it and reads its outcome, `processes.py` starts, waits for and kills its processes, and
`dry_run.py` prints the plan instead of running it. A Kubernetes pod's node script (`k8s_manifest.py`) records its
launch's row with `record_launch.py`; `k8s_check.py` checks the manifests offline."""
