"""The ``hetero`` strategy's MoE part (``ExpertPlacer``): where each HeteroMoE layer's experts live, and their speed.

1. ``place_model_experts`` (at setup, before DDP wraps the model and the
   optimizer is built): every HeteroMoE layer of the module gets its placement —
   ``"planned"``: a given Plan's expert map, else the planner's placement for
   this cluster (``planning.experts``: counts by device speed, capped by memory
   when the workload describes the MoE layers); ``"uniform"``: the same count
   per rank; or explicit per-layer placements.  Expert parameters are then kept
   out of DDP (``moe.prepare_for_ddp``).
2. ``plan_expert_map`` writes the placement being run into the Plan
   (``{workload layer: {device: ids}}``), so the table, plan.json and the
   picture show it.
3. ``emulate_experts`` (emulated clusters): each layer pads its local experts
   to the device's expert time, and the batch padding leaves the layers' time
   out of the dense part it pads.
4. ``gather_expert_state``: a checkpoint's model state holds every expert
   (gathered to rank 0); ``check_resumable`` refuses resuming a run with
   HeteroMoE layers (each rank's optimizer state covers its own experts only).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence, Union

import torch.distributed as dist
from torch import nn

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger
from het_strategy.core.plan import Plan
from het_strategy.core.workload import WorkloadSpec, load_workload
from het_strategy.emulation.padding import BatchPadding
from het_strategy.emulation.speeds import emulated_expert_seconds_per_token, emulated_factor
from het_strategy.moe import ExpertPlacement, HeteroMoE, check_placement, moe_layers, placement_from_counts, \
    placements_from_plan, prepare_for_ddp, uniform_placement
from het_strategy.moe.padding import ExpertPadding, MoEClock
from het_strategy.planning.experts import MoEPlacement

__all__ = ["ExpertRun", "ExpertPlacer", "PlacementOption", "place_model_experts", "gather_expert_state",
           "check_resumable"]

PlacementOption = Union[MoEPlacement, str, Sequence[Any]]
"""A ``MoEPlacement`` (or its string), or one placement per HeteroMoE layer (one expert-id list per rank)."""


@dataclass
class ExpertRun:
    """The HeteroMoE layers of a run and where their experts live."""

    layers: list[HeteroMoE]
    placements: list[ExpertPlacement]
    source: str
    """How the placement was chosen (for the log and the summary)."""
    clock: MoEClock = field(default_factory=MoEClock)

    def plan_expert_map(self, plan: Plan, cluster: ClusterSpec, workload: WorkloadSpec) -> None:
        """Record the placement being run in ``plan.experts`` (when the workload describes the MoE layers)."""
        moe_ids = [i for i, layer in enumerate(workload.layers) if layer.moe is not None]
        if len(moe_ids) != len(self.layers):
            return
        names = [d.name for d in cluster.devices]
        plan.experts = {i: {names[r]: list(ids) for r, ids in enumerate(p.ranks)}
                        for i, p in zip(moe_ids, self.placements)}

    def emulate_experts(self, cluster: ClusterSpec, workload: WorkloadSpec, dtype: str, rank: int,
                        padding: BatchPadding) -> None:
        """Pad each layer's local experts to this rank's emulated device; the batch padding excludes the layers."""
        device = cluster.devices[rank].name
        per_token = emulated_expert_seconds_per_token(cluster, device, workload, dtype)
        if len(per_token) != len(self.layers):
            per_token = [_estimated_seconds_per_token(layer, cluster, device, dtype) for layer in self.layers]
        for layer, seconds in zip(self.layers, per_token):
            layer.padding = _StepPadding(seconds, cluster, device, padding)
            layer.clock = self.clock
        padding.excluded = self.clock

    def summary(self) -> dict[str, Any]:
        """For het-train's summary (this rank's figures; rank 0 reports them)."""
        clock = self.clock
        return {"expert_placement": self.source, "experts_per_rank": [p.counts for p in self.placements],
                "moe_s_per_batch": clock.total_s / clock.batches if clock.batches else None}


class _StepPadding(ExpertPadding):
    """ExpertPadding whose slowdown factor follows the batch padding's current step."""

    def __init__(self, seconds: float, cluster: ClusterSpec, device: str, batch: BatchPadding) -> None:
        super().__init__(seconds)
        self._cluster, self._device, self._batch = cluster, device, batch

    def target_s(self, tokens: int, backward: bool = False) -> float:
        self.factor = emulated_factor(self._cluster, self._device, self._batch.step)
        return super().target_s(tokens, backward)


def _estimated_seconds_per_token(layer: HeteroMoE, cluster: ClusterSpec, device: str, dtype: str) -> float:
    """Forward seconds per routed token of one expert when the workload does not describe it: 2 x its parameters."""
    return 2.0 * layer.params_per_expert / cluster.device(device).flops_per_second(dtype)


def place_model_experts(module: nn.Module, option: Any, cluster: ClusterSpec, workload: WorkloadSpec | None,
                        dtype: str, plan_source: Any, world: int) -> ExpertRun | None:
    """Place the experts of every HeteroMoE layer of ``module`` (see the module docstring); None without any."""
    layers = moe_layers(module)
    if not layers:
        return None
    sizes = [layer.num_experts for layer in layers]
    if isinstance(option, str) and option == MoEPlacement.uniform:
        placements = [uniform_placement(n, world, "moe_placement") for n in sizes]
        source = "uniform"
    elif isinstance(option, str) and option == MoEPlacement.planned:
        placements, source = _planned(sizes, cluster, workload, dtype, plan_source)
    elif isinstance(option, (list, tuple)) and len(option) == len(layers):
        placements = [check_placement(p, n, world, f"moe_placement[{i}]") for i, (p, n) in
                      enumerate(zip(option, sizes))]
        source = "given"
    else:
        raise field_error("moe_placement", option, f"be one of {', '.join(MoEPlacement)} or a list of "
                          f"{len(layers)} placement(s), one per HeteroMoE layer (one expert-id list per rank)")
    for layer, placement in zip(layers, placements):
        layer.place(placement)
    prepare_for_ddp(module, world)
    return ExpertRun(layers, placements, source)


def _planned(sizes: list[int], cluster: ClusterSpec, workload: WorkloadSpec | None, dtype: str,
             plan_source: Any) -> tuple[list[ExpertPlacement], str]:
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.planning.dp_split import equal_split_plan
    from het_strategy.planning.experts import expert_counts_by_speed, place_experts

    devices = [d.name for d in cluster.devices]
    given: Plan | None = plan_source  # checked and loaded at construction (strategy.arguments)
    if given is not None and given.experts:
        return placements_from_plan(given.experts, devices, sizes), "the given plan's expert map"
    described = [layer.moe for layer in workload.layers if layer.moe is not None] if workload else []
    if described and [m.num_experts for m in described] == sizes:
        cm = CostModel(cluster, workload, TrainSettings(global_batch_size=len(devices), dtype=dtype,
                                                        micro_batch_sizes=(1,)))
        mapping = place_experts(cm, equal_split_plan(cm))
        if len(mapping) == len(sizes):
            return placements_from_plan(mapping, devices, sizes), "planned (device speed and memory)"
    elif described:
        raise field_error("workload", workload.name if workload else None,
                          f"describe the model's HeteroMoE layers (experts {sizes}); it describes "
                          f"{[m.num_experts for m in described]}")
    rates = [d.flops_per_second(dtype) for d in cluster.devices]
    out = []
    for i, n in enumerate(sizes):
        counts = expert_counts_by_speed(rates, n)
        if counts is None:
            raise field_error(f"HeteroMoE[{i}].num_experts", n, f"be >= the number of ranks ({len(rates)}) so "
                              "every rank holds an expert")
        out.append(placement_from_counts(counts, n, f"HeteroMoE[{i}]"))
    return out, "planned (device speed)"


def gather_expert_state(module: nn.Module, state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """``state`` (rank 0's model state dict) with every rank's experts added (a collective)."""
    prefixes = tuple(f"{name}.experts." for name, m in module.named_modules() if isinstance(m, HeteroMoE))
    mine = {k: v.detach().cpu() for k, v in module.state_dict().items() if k.startswith(prefixes)}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        for part in gathered:
            state.update(part)
    return state


class ExpertPlacer:
    """Places the experts of a module's HeteroMoE layers once per strategy, and keeps them in checkpoints.

    Args:
        option: ``"planned"``, ``"uniform"`` or one placement per layer (``place_model_experts``).
        workload_source: the model's costs as given (its MoE layers guide the planned placement), or None.
        plan_source: the given Plan (its expert map is used as is), or None.
        verbose: log the experts per rank on rank 0.
    """

    def __init__(self, option: PlacementOption = "planned", workload_source: Any = None,
                 plan_source: Plan | None = None, verbose: bool = True) -> None:
        self.option, self.workload_source, self.plan_source, self.verbose = option, workload_source, plan_source, \
            verbose
        self.run: ExpertRun | None = None
        """The layers and their placements (None before ``place`` and for a model without HeteroMoE layers)."""

    def place(self, module: nn.Module, cluster: ClusterSpec, dtype: str, rank: int, world: int) -> ExpertRun | None:
        """Place the experts (at setup, before DDP wraps the model and the optimizer is built).

        Once per strategy: a later ``trainer.validate``/``test`` keeps the experts where they are.
        """
        if self.run is not None:
            return self.run
        workload = load_workload(self.workload_source, dtype) if self.workload_source is not None else None
        self.run = place_model_experts(module, self.option, cluster, workload, dtype, self.plan_source, world)
        if self.run is not None and rank == 0 and self.verbose:
            counts = "; ".join(f"layer {i}: {p.counts}" for i, p in enumerate(self.run.placements))
            logger.info("HeteroMoE experts per rank (%s): %s", self.run.source, counts)
        return self.run

    def planned(self, plan: Plan, cluster: ClusterSpec, workload: WorkloadSpec, dtype: str, rank: int,
                padding: BatchPadding | None) -> None:
        """A training plan exists: record the placement in it, and pad the experts on an emulated cluster."""
        if self.run is None:
            return
        self.run.plan_expert_map(plan, cluster, workload)
        if padding is not None:
            self.run.emulate_experts(cluster, workload, dtype, rank, padding)

    def full_state(self, module: nn.Module, state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
        """``state`` (rank 0's model state dict) with every rank's experts (a collective when there are experts)."""
        return state if self.run is None else gather_expert_state(module, state, rank, world)


def check_resumable(module: nn.Module) -> None:
    """Refuse resuming a module with HeteroMoE layers (each rank's optimizer state covers its own experts)."""
    if moe_layers(module):
        raise ConfigError("resuming a run with HeteroMoE layers is not supported: each "
                          "rank's optimizer state covers only its own experts (the checkpoint's model weights "
                          "hold every expert: load them with strict=False to evaluate or start afresh)")
