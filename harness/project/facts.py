"""What a strategy itself says about a step at any world size: the collectives it issues and the model
states a rank keeps, read from the strategy registry for harness.project.projection.

    python -c "from harness.project.facts import REGISTRY_FACTS as f; \\
        print(f.expected_per_step('zero3', {}, 16, 1, 10**9, 2 * 10**9, 2 * 10**9))"

A strategy owns these facts (`Strategy.expected_collectives`, `Strategy.model_state_plan`,
`Strategy.checkpoint_contents`); the projection asks for them at the target world size instead of keeping a
table of its own. The registry imports torch, so it is imported here only when a fact is asked for:
importing this module stays torch-free, and harness.project.projection takes any object with these methods
(a test may pass its own).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from harness.derive.checkpoint import CheckpointContents
from harness.derive.memory import ModelSplit, ModelStatePlan, RankParameters
from harness.spec import SpecError


class RegistryFacts:
    """StrategyFacts (harness.project.projection) from harness.strategies.STRATEGIES."""

    def _strategy(self, name: str, options: Mapping[str, Any]):
        from harness.strategies import STRATEGIES

        try:
            strategy = STRATEGIES[name]
        except KeyError:
            raise SpecError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
        strategy.check_options(dict(options))
        return strategy, strategy.resolve_options(dict(options))

    def expected_per_step(self, strategy: str, options: Mapping[str, Any], data_parallel: int, micro_batches: int,
                          parameters: int, gradient_bytes: int, gathered_bytes: int,
                          kept_whole: int = 0) -> dict[str, Any]:
        """The strategy's ExpectedTraffic as a dict ({"collectives": [{collective, size_bytes, calls, ranks}],
        "not_modelled_because"}) for a step of `micro_batches` among `data_parallel` replicas, with all
        gradients reduced in `gradient_bytes` and all parameters gathered in `gathered_bytes`; `kept_whole`
        of the parameters kept whole on every rank where a row measured it (ZeRO-3's persistent ones)."""
        from harness.strategies.base import TrafficBytes

        chosen, resolved = self._strategy(strategy, options)
        traffic = TrafficBytes(parameters=int(parameters), gradients_reduced=int(gradient_bytes),
                               parameters_gathered=int(gathered_bytes), parameters_kept_whole=int(kept_whole))
        return chosen.expected_collectives(data_parallel=data_parallel, micro_batches=micro_batches,
                                           options=resolved, traffic=traffic).to_dict()

    def expected_for_cell(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str,
                          world_size: int, global_batch: int, micro_batch: int,
                          gpus_per_node: int | None = None) -> tuple[dict[str, Any], int, int]:
        """(the strategy's ExpectedTraffic as a dict, its data-parallel size, the parameters a rank holds before
        sharding: `Strategy.planned_parameters_held`) for the cell of `workload` at
        `world_size` and `global_batch`, on GPUs `gpus_per_node` to a node (None: one node): for strategies
        whose traffic runs in named groups of their own sizes (tensor parallelism's "tp", a 2-D mesh's "dp"),
        which the parameter counts of `expected_per_step` cannot describe. The workload's layers are built on
        the meta device (shapes, no memory). A layout the strategy refuses there (`Strategy.layout_refusal`)
        is a SpecError naming the rule."""
        chosen, cell, layers = self._cell(workload=workload, strategy=strategy, options=options, precision=precision,
                                          world_size=world_size, global_batch=global_batch, micro_batch=micro_batch,
                                          gpus_per_node=gpus_per_node)
        return (chosen.expected_traffic(cell, layers).to_dict(), chosen.layout(cell).data_parallel,
                chosen.planned_parameters_held(cell, layers))

    def traffic_for_cell(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str,
                         world_size: int, global_batch: int, micro_batch: int,
                         gpus_per_node: int | None = None) -> tuple[dict[str, Any], int]:
        """`expected_for_cell`'s traffic and data-parallel size alone, without counting what a rank holds: what a
        dry run prices each of its cells by (harness.project.cells)."""
        chosen, cell, layers = self._cell(workload=workload, strategy=strategy, options=options, precision=precision,
                                          world_size=world_size, global_batch=global_batch, micro_batch=micro_batch,
                                          gpus_per_node=gpus_per_node)
        return chosen.expected_traffic(cell, layers).to_dict(), chosen.layout(cell).data_parallel

    def _cell(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str, world_size: int,
              global_batch: int, micro_batch: int, gpus_per_node: int | None) -> tuple[Any, Any, tuple]:
        """(the strategy, the checked cell, the workload's layers on the meta device), or the SpecError of a layout
        the strategy refuses."""
        from harness.spec import DeviceKind, RunSpec
        from harness.strategies import checked

        nodes = max(1, world_size // gpus_per_node) if gpus_per_node else 1
        chosen, _ = self._strategy(strategy, options)
        cell = checked(RunSpec(workload=workload, strategy=strategy, world_size=world_size,
                               global_batch=global_batch, micro_batch=micro_batch, precision=precision,
                               options=dict(options), device=DeviceKind.CUDA,
                               nnodes=nodes if world_size % nodes == 0 else 1))
        refusal = chosen.layout_refusal(cell)
        if refusal:
            raise SpecError(refusal)
        return chosen, cell, _meta_layers(workload)     # shared by every cell: a strategy reads the layers it is given

    def model_split(self, *, workload: str, strategy: str, options: Mapping[str, Any], precision: str,
                    world_size: int, global_batch: int, micro_batch: int) -> tuple[int, int]:
        """(tensor-parallel ranks, pipeline stages) one replica of the cell at `world_size` is cut across, by the
        strategy's own layout (`Strategy.layout`): world_size / data_parallel ranks a replica, its pipeline stages
        and, within each stage, the rest tensor-parallel."""
        from harness.spec import DeviceKind, RunSpec
        from harness.strategies import checked

        chosen, _ = self._strategy(strategy, options)
        layout = chosen.layout(checked(RunSpec(workload=workload, strategy=strategy, world_size=world_size,
                                               global_batch=global_batch, micro_batch=micro_batch, precision=precision,
                                               options=dict(options), device=DeviceKind.CUDA)))
        per_replica = world_size // layout.data_parallel
        return per_replica // layout.pipeline_stages, layout.pipeline_stages

    def bubble_factor(self, strategy: str, options: Mapping[str, Any], micro_batches: int) -> float:
        """A step's time over its ranks' own work by the strategy's schedule (`Strategy.bubble_factor`)."""
        chosen, resolved = self._strategy(strategy, options)
        return float(chosen.bubble_factor(resolved, micro_batches))

    def wire_calls(self, strategy: str, options: Mapping[str, Any], collective: str, counted_calls: float,
                   bytes_per_step: float, backward_s: float) -> float:
        """How many collectives the counted calls of one type per step become on the wire
        (`Strategy.wire_calls`: as many, unless the strategy's library fuses them)."""
        chosen, resolved = self._strategy(strategy, options)
        return float(chosen.wire_calls(collective=collective, counted_calls=counted_calls,
                                       bytes_per_step=bytes_per_step, backward_s=backward_s, options=resolved))

    def point_to_point(self, strategy: str, options: Mapping[str, Any]) -> tuple[str, int]:
        """How the strategy's sends and receives load the network, and over how many hubs (`Strategy.point_to_point`):
        ("chain", 0), a pipeline's hops; ("star", S), a dedicated parameter server's S servers."""
        chosen, resolved = self._strategy(strategy, options)
        pattern, hubs = chosen.point_to_point(resolved)
        return str(pattern), int(hubs)

    def model_state_plan(self, strategy: str, options: Mapping[str, Any], data_parallel: int,
                         recipe: str) -> ModelStatePlan:
        """The strategy's bytes per parameter and sharding among `data_parallel` ranks under `recipe`."""
        from harness.strategies import PrecisionRecipe

        chosen, resolved = self._strategy(strategy, options)
        recipes = [r.value for r in PrecisionRecipe]
        if recipe not in recipes:
            raise SpecError(f"precision recipe {recipe!r} is not one of: {', '.join(recipes)}")
        return chosen.model_state_plan(data_parallel, PrecisionRecipe(recipe), resolved)

    def split(self, strategy: str, options: Mapping[str, Any], replicas: int, tensor_parallel: int) -> ModelSplit:
        """How the strategy lays out `replicas` data-parallel replicas under `options`, `tensor_parallel` being the
        degree of a strategy whose degree is no option of its own (`Strategy.model_split`)."""
        chosen, resolved = self._strategy(strategy, options)
        return chosen.model_split(replicas, tensor_parallel, resolved)

    def expert_parallel_degree(self, strategy: str, options: Mapping[str, Any], world_size: int) -> int:
        """The ranks the strategy shards an MoE model's experts over at `world_size`, 0 where it shards none
        (`Strategy.expert_parallel_degree`)."""
        chosen, resolved = self._strategy(strategy, options)
        return int(chosen.expert_parallel_degree(world_size, resolved))

    def sequence_split_degree(self, strategy: str, options: Mapping[str, Any], world_size: int) -> int:
        """The ranks the strategy splits a sample's sequence over at `world_size`, 1 where it splits none
        (`Strategy.sequence_split_degree`)."""
        chosen, resolved = self._strategy(strategy, options)
        return int(chosen.sequence_split_degree(world_size, resolved))

    def recipe_refusal(self, strategy: str, recipe: str) -> str | None:
        """Why the strategy cannot run `recipe`, or None (`Strategy.recipe_refusal`)."""
        chosen, _ = self._strategy(strategy, {})
        return chosen.recipe_refusal(self._recipe(recipe))

    def described_traffic(self, strategy: str, options: Mapping[str, Any], parameters: int,
                          recipe: str) -> tuple[int, int]:
        """(gradient bytes as reduced, parameter bytes as gathered) of `parameters` known by their count alone
        (`Strategy.described_traffic_bytes`)."""
        chosen, resolved = self._strategy(strategy, options)
        traffic = chosen.described_traffic_bytes(int(parameters), self._recipe(recipe), resolved)
        return traffic.gradients_reduced, traffic.parameters_gathered

    def across_replicas(self, strategy: str, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(the data-parallel strategy run among the strategy's replicas, the options of ours it shares), or None
        (`Strategy.across_replicas`)."""
        chosen, resolved = self._strategy(strategy, options)
        name = chosen.across_replicas(resolved)
        if name is None:
            return None
        other, _ = self._strategy(name, {})
        return name, {key: value for key, value in resolved.items() if key in other.options}

    def tensor_parallel_all_reduces(self, *, micro_batch: int, seq_len: int, hidden: int, layers: int,
                                    micro_batches: int, tp: int, half: bool) -> list[dict[str, Any]]:
        """Megatron's activation all-reduces of one step among `tp` ranks, as the tensor-parallel strategies expect
        them (harness.strategies.tensor_parallel.activation_all_reduces), as dicts."""
        from harness.strategies.tensor_parallel import activation_all_reduces

        return [{"collective": c.collective.value, "size_bytes": c.size_bytes, "calls": c.calls, "ranks": c.ranks}
                for c in activation_all_reduces(micro_batch=micro_batch, seq_len=seq_len, n_embd=hidden,
                                                n_layer=layers, micro_batches=micro_batches, tp=tp, half=half,
                                                group="tp")]

    def working_memory(self, strategy: str, options: Mapping[str, Any], rank: RankParameters,
                       recipe: str) -> dict[str, float]:
        """The bytes the strategy keeps beyond model states and activations on a rank holding `rank`, by name
        (`Strategy.working_memory_bytes`)."""
        chosen, resolved = self._strategy(strategy, options)
        return {name: float(value) for name, value in
                chosen.working_memory_bytes(rank, self._recipe(recipe), resolved).items()}

    def usual_mixed_recipe(self, strategy: str) -> tuple[str, dict[str, Any]]:
        """(the 16-bit recipe the strategy's users run, the options that select it) (`Strategy.usual_mixed_recipe`)."""
        chosen, _ = self._strategy(strategy, {})
        recipe, options = chosen.usual_mixed_recipe()
        return recipe.value, dict(options)

    def _recipe(self, recipe: str):
        from harness.strategies import PrecisionRecipe

        recipes = [r.value for r in PrecisionRecipe]
        if recipe not in recipes:
            raise SpecError(f"precision recipe {recipe!r} is not one of: {', '.join(recipes)}")
        return PrecisionRecipe(recipe)

    def checkpoint_contents(self, strategy: str, options: Mapping[str, Any], recipe: str) -> CheckpointContents:
        """The bytes per parameter one checkpoint of the strategy's job holds under `recipe`
        (`Strategy.checkpoint_contents`)."""
        from harness.strategies import PrecisionRecipe

        chosen, resolved = self._strategy(strategy, options)
        recipes = [r.value for r in PrecisionRecipe]
        if recipe not in recipes:
            raise SpecError(f"precision recipe {recipe!r} is not one of: {', '.join(recipes)}")
        return chosen.checkpoint_contents(PrecisionRecipe(recipe), resolved)


REGISTRY_FACTS = RegistryFacts()


@functools.lru_cache(maxsize=None)
def _meta_layers(workload: str) -> tuple:
    """The workload's layers built on the meta device with their initialisation skipped
    (`Workload.build_layers_on_meta`), once a process, shared by every cell a dry run prices: a strategy only reads
    the layers it plans from (a copy for each cell took a third of a dry run)."""
    from workloads import get_workload

    return tuple(get_workload(workload).build_layers_on_meta())
