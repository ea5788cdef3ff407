"""Projection to clusters that were not measured: the collective cost model, cluster descriptions and the
fit of the model's latency and bandwidth terms to `harness comm` rows.

    python -c "from harness.project.cluster import preset; from harness.project.collectives import \\
        collective_time; print(collective_time('all_reduce', 1e9, 16, preset('dgx-h100-ib')))"

- `cluster`: a link (latency per step, bandwidth one way), a cluster (GPUs per node, the intra-node link
  per GPU, the inter-node link per node), how ranks fill nodes, and loading one from a preset, a TOML file
  or key=value overrides;
- `presets`: the named clusters, every value with its public source;
- `collectives`: the time of one collective per algorithm (alpha-beta model) on one link or on a cluster;
- `fit`: latency and bandwidth per collective fitted to `harness comm` rows, with the residuals kept;
- `projection`: step time, throughput, scaling efficiency, the step beyond compute and memory per rank at
  world sizes not measured, from measured rows or a description, and the projected rows it writes;
- `facts`: each strategy's expected collectives and model-state plan at any world size, from the registry
  (imported only when asked, so importing this package stays torch-free);
- `plan`: every layout of a described transformer on a described cluster, what fits and its projected step
  (`python -m harness plan`); `confidence`: each strategy's errors on the committed validations;
- `run`: what `python -m harness project` runs.

Torch-free, like harness.derive: nothing here imports torch, deepspeed, horovod, `harness.strategies` or
`workloads`. docs/projection.md says what the model assumes, where each formula comes from and its limits.
"""
