"""The mode search: ``search_plan(cluster, workload, settings, mode)``, the fastest plan of the planners ``mode`` names.

Modes (``request.PlanMode``):

- ``dp``: uneven data parallelism, exact integer shares (``dp_split``);
- ``pipeline``: one pipeline through every device, exact layer split, stage
  order chosen among the cluster order and memory-descending order;
- ``hybrid``: pipelines x stages x tensor parallelism x micro-batches (``hybrid``);
- ``fsdp``: fully sharded data parallelism, shares by speed and shards by memory (``fsdp``; ``hetero_fsdp``);
- ``auto``: the fastest plan that fits of dp, pipeline and hybrid, and of fsdp where some device cannot hold a
  whole replica (``fsdp_in_auto``: the cost model prices dp's gradient sync after backward, not overlapped, and
  fsdp's collectives overlapped with compute, so where every replica fits a race between them would reward that
  difference of the model rather than sharding; ``with_fsdp=False`` leaves fsdp out, as the searches for runtimes
  that cannot run it do).

MoE workloads get an expert placement afterwards (``experts``).  This is the
step every other search runs per cluster (``runtimes``, ``joint``,
``objective``); ``planning.plan`` composes them for one ``PlanRequest``.
"""

from __future__ import annotations

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.cost_model import CostModel
from het_strategy.core.memory import GiB
from het_strategy.core.memory import overhead_bytes
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.dp_split import plan_data_parallel
from het_strategy.planning.experts import place_experts
from het_strategy.planning.fsdp import plan_fsdp
from het_strategy.planning.hybrid import plan_hybrid
from het_strategy.planning.idle import replica_memory, structure_idle_reasons
from het_strategy.planning.request import PlanMode
from het_strategy.planning.structure import StructureResult, assemble_plan

__all__ = ["MODES", "PlanningError", "search_plan", "plan_pipeline", "fsdp_in_auto"]

MODES = tuple(str(m) for m in PlanMode if m != PlanMode.low_communication)
"""The mode names of the synchronous planners, ``auto`` first (``low_communication`` is ``planning.plan``'s own
step: ``low_communication.plan_low_communication``)."""


class PlanningError(ConfigError):
    """No plan satisfies the constraints (usually memory); the message says what is missing."""


def plan_pipeline(cm: CostModel) -> StructureResult | None:
    """One pipeline over every device (within ``settings.max_stages``); stage order: cluster order, or most memory
    first."""
    names = [d.name for d in cm.cluster.devices]
    by_memory = sorted(names, key=lambda n: -cm.cluster.device(n).memory_gb)
    best = None
    for order in dict.fromkeys((tuple(names), tuple(by_memory))):
        if len(order) > min(cm.workload.num_layers, cm.settings.max_stages):
            continue
        res = assemble_plan(cm, [tuple((d,) for d in order)], "pipeline")
        if res is not None and (best is None or res.step_time_s < best.step_time_s):
            best = res
    return best


def fsdp_in_auto(cm: CostModel) -> bool:
    """Mode auto runs the fsdp planner: some device cannot hold a whole model replica (``idle.replica_memory``),
    the case sharding by memory is for."""
    return any(need > have for need, have in (replica_memory(cm, d.name) for d in cm.cluster.devices))


def search_plan(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, mode: str = "auto",
                profile: MeasuredProfile | None = None, with_fsdp: bool = True) -> Plan:
    """The fastest plan of the planners ``mode`` names, ``plan.predicted`` filled with the cost model's figures.

    ``auto`` skips a planner that refuses the input (e.g. dp with a batch smaller than the cluster) when another
    finds a plan; ``PlanningError`` says what is missing when none does.
    """
    if mode not in MODES:
        raise field_error("planner.mode", mode, f"be one of {', '.join(MODES)}")
    cm = CostModel(cluster, workload, settings, profile)
    planners = {"dp": plan_data_parallel, "pipeline": plan_pipeline, "hybrid": plan_hybrid, "fsdp": plan_fsdp}
    chosen = planners if mode == "auto" else {mode: planners[mode]}
    if mode == "auto" and not (with_fsdp and fsdp_in_auto(cm)):
        chosen = {name: p for name, p in chosen.items() if name != "fsdp"}
    results = []
    for name, planner in chosen.items():
        try:
            res = planner(cm)
        except ConfigError:
            if mode != "auto":
                raise
            continue  # e.g. dp with a batch smaller than the cluster: other modes may still work
        if res is not None:
            results.append(res)
    if not results:
        raise PlanningError(_nothing_fits_message(cm, mode))
    best = min(results, key=lambda r: r.step_time_s)
    result = best.plan
    if settings.inter_node_compression != "none" and not result.shards \
            and len({cluster.device(d).node for d in result.used_devices}) > 1:
        result.compression = {"inter_node": settings.inter_node_compression}  # what its syncs were priced with
    _explain_idle(cm, result)
    if any(layer.moe for layer in workload.layers) and not result.shards:  # fsdp shards the experts with the rest
        result.experts = place_experts(cm, result)
    result.predicted = cm.score(result).to_dict()
    return result


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.1f} GiB" if num_bytes >= 0.1 * GiB else f"{num_bytes / 2**20:.1f} MiB"


def _explain_idle(cm: CostModel, result: Plan) -> None:
    """Give every idle device a reason (the dp planner gives its own; plans with pipelines: ``idle``)."""
    used = set(result.used_devices)
    reasons = {n: r for n, r in result.idle_reasons.items() if n not in used}
    if any(d.name not in used and d.name not in reasons for d in cm.cluster.devices):
        reasons = {**structure_idle_reasons(cm, result), **reasons}
    result.idle_reasons = {d.name: reasons[d.name] for d in cm.cluster.devices if d.name in reasons}


def _nothing_fits_message(cm: CostModel, mode: str) -> str:
    """Say what is missing: the memory the smallest feasible layout needs vs the largest device."""
    if mode == "dp":
        return _dp_does_not_fit_message(cm)
    largest = max(cm.cluster.devices, key=lambda d: d.memory_gb)
    m = min(cm.settings.micro_batch_sizes)
    L = cm.workload.num_layers
    stages = min(cm.cluster.num_devices, L, cm.settings.max_stages)
    # memory of the heaviest stage when layers are spread evenly over as many stages as allowed
    bounds = [round(i * L / stages) for i in range(stages + 1)]
    need = max((cm.stage_memory_bytes(a, b, 1, m, stages - s, cm.cluster.num_devices)
                + overhead_bytes(largest, 1), s) for s, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a)
    return (f"no {mode} plan fits in memory: the model needs {_size(need[0])} on stage {need[1]} even "
            f"when split over {stages} stages at micro-batch {m}; the largest device ({largest.name}, "
            f"{largest.type}) has {largest.memory_gb:g} GiB; try ZeRO-3 (settings.zero_stage=3), activation "
            f"checkpointing (settings.activation_checkpointing=true), offload, or more stages "
            f"(settings.max_stages) / devices")


def _dp_does_not_fit_message(cm: CostModel) -> str:
    """No device holds a whole replica: say which (need vs have) and what to change."""
    m = min(cm.settings.micro_batch_sizes)
    need, _ = replica_memory(cm, cm.cluster.devices[0].name)
    by_type: dict[tuple[str, float], int] = {}
    for d in cm.cluster.devices:
        key = (d.type, cm.memory_capacity_bytes(d))
        by_type[key] = by_type.get(key, 0) + 1
    have = "; ".join(f"{n}x {t} ({_size(cap)} each)" for (t, cap), n in by_type.items())
    return (f"no dp plan fits in memory: data parallelism puts a whole replica of model `{cm.workload.name}` "
            f"on every rank, which needs {_size(need)} at micro-batch {m} (weights, gradients, optimizer state, "
            f"activations, the framework's overhead, settings.memory_reserve_gb); no device holds it: {have}; use a smaller model or "
            f"micro-batch (settings.micro_batch_sizes), ZeRO (settings.zero_stage=1..3), activation checkpointing "
            f"(settings.activation_checkpointing=true), or split the model: planner.mode=pipeline (or hybrid) and "
            f"train with the hetero_deepspeed strategy")
