"""What each runtime can run: one rule table, read by the planner, the runtimes and the strategies.

``runtime_problems(plan, runtime)`` lists every reason ``runtime`` cannot run
``plan`` exactly (an empty list: it can).  Each ``Problem`` names the plan
field by its full dotted path with indices (``plan.pipelines[1].stages[0].tp``),
its value and the rule it breaks, so one list serves the planner's filter
(``planning.runtimes.search_runtime`` keeps plans with no problem), the
DeepSpeed runtime (``ds_runtime.engine.check_runnable`` raises the first) and
the construction checks of both Lightning strategies.

The rules, by runtime:

``any``
    Nothing is refused: the unconstrained planner's space.

``deepspeed`` (``hetero_deepspeed``: ``ds_runtime.PlanRunner`` on unpatched DeepSpeed)
    1. Tensor parallelism (a stage of tp > 1 devices) runs per replica
       (``ds_runtime.replica_engine`` with ``tensor_parallel``'s Megatron split),
       so rule 3 applies to it as to an asymmetric plan; the tp degrees of the
       replicas holding a layer each divide the largest of them (a gradient is
       reduced in units of the largest degree's shard: ``ReplicaLayout.units``).
       Whether a model's blocks split that way (a tensor-parallel plan, heads
       and widths divisible by tp) is checked against the model when the
       runtime builds the stage (``tensor_parallel.check_layer``).
    2. A plan with a multi-stage pipeline runs at ZeRO 0 or 1: DeepSpeed's
       pipeline engine asserts against ZeRO 2 and 3 (0.19's
       ``PipelineEngine.__init__``: ``assert self.zero_optimization_stage() <
       ZeroStageEnum.gradients, "ZeRO-2 and ZeRO-3 are incompatible with
       pipeline parallelism"``).  One-stage replicas (pure
       data parallelism) run at every ZeRO stage.
    3. Replicas with different stage boundaries (an asymmetric plan), plans
       with tp > 1, fp16 plans at ZeRO 0 and ``per_device`` plans (rule 7) run each replica as its own
       pipeline (``ds_runtime.replica_engine``; ``runs_per_replica``).  Every
       dtype runs at ZeRO 0 (the runtime reduces the gradients DeepSpeed's
       mixed-precision optimizer steps on).  ZeRO 1 runs in every dtype: the
       runtime shards the optimizer state (and in bf16 and fp16 the fp32
       master weights; fp16 with a dynamic loss scale) within each set of
       ranks holding the same parameters (``ds_runtime.holder_sharding``).
       ZeRO 2 and 3 are refused: that sharding splits neither the gradients
       nor the weights.
    4. fp16 at ZeRO 0 runs per replica (rule 3): DeepSpeed 0.19's ZeRO-0 fp16
       optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) unscale the
       gradients by the loss scale at the step, but its ``engine.backward``
       scales the loss only for ZeRO optimizers, so on DeepSpeed's own engine
       every update would be 1/loss-scale too small (measured: a 3-step run
       moves the loss 1/13 as far as fp32's); the per-replica engine scales the
       loss itself.
    5. At ZeRO 2 and 3 DeepSpeed reduces on every micro-step, so every replica
       runs the largest micro-batch count of any replica: a replica with fewer
       samples than that count cannot be cut into it.
    6. With ``world_size`` given: one process per device the plan uses.
    7. A ``per_device`` plan (bf16 on some devices, fp16 on others) runs per
       replica (rule 3) with the runtime's own fp32 master weights
       (``holds_own_masters``: ``ds_runtime.holder_sharding``, sharded at ZeRO 1,
       whole on every holder at ZeRO 0), since DeepSpeed's engine takes one
       precision config: each rank computes in its device's dtype, a stage casts
       what it receives to its own, gradients are reduced in fp32 and one loss
       scale (DeepSpeed's dynamic scaler, kept in step on every rank by the one
       overflow decision) covers every backward.  A tensor-parallel group
       computes in one dtype (its all-reduces sum one dtype).

``hetero`` (the ``hetero`` strategy: uneven data parallelism on Lightning's DDP)
    1. Every pipeline is one stage of one device (a pure data-parallel plan);
       pipeline plans run on ``hetero_deepspeed``.  Every dtype runs,
       ``per_device`` too (``strategy.per_device_precision``).
    2. No ``plan.outer_sync``: a low-communication plan runs on ``hetero_diloco``
       (the ``deepspeed`` runtime refuses it too).

``hetero_diloco`` (the ``hetero_diloco`` strategy: DiLoCo over groups of uneven data parallelism)
    1. As ``hetero`` rule 1: pure data parallelism, each group's replicas one device each.
    2. A ``plan.outer_sync`` (its groups cover the used devices: ``Plan`` checks that when it is built).

Pure Python: the planning core reads this table without torch or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from het_strategy.core.errors import ConfigError, field_error, require_option
from het_strategy.core.plan import Plan

__all__ = ["Runtime", "as_runtime", "Problem", "runtime_problems", "raise_first", "shares_boundaries",
           "has_tensor_parallel", "runs_per_replica", "holds_own_masters"]


class Runtime(StrEnum):
    """A runtime a plan is made for (``planner.runtime``; member names are the config spellings)."""

    any = "any"
    """No constraint: the planner's whole search space."""
    deepspeed = "deepspeed"
    """``hetero_deepspeed``: pipelines, replicas and tensor-parallel stages on DeepSpeed."""
    hetero = "hetero"
    """The ``hetero`` strategy: pure data parallelism with uneven shares."""
    hetero_diloco = "hetero_diloco"
    """The ``hetero_diloco`` strategy: groups of uneven data parallelism that exchange parameters every H steps."""


def as_runtime(value: Any, field: str = "planner.runtime") -> Runtime:
    """``value`` as a ``Runtime``, or a ``ConfigError`` naming ``field`` and the runtimes there are."""
    return require_option(Runtime, value, field)


@dataclass(frozen=True)
class Problem:
    """One reason a runtime cannot run a plan: the field, its value, and the rule it breaks."""

    field: str
    """Full dotted name with indices, e.g. ``plan.pipelines[1].stages[0].tp``."""
    value: Any
    """The field's value in the plan."""
    rule: str
    """What the value must be, completing "it must ..." (with the runtime's reason in parentheses)."""
    fix: str | None = None
    """How to get a plan the runtime runs, when there is one simple way."""

    def error(self) -> ConfigError:
        """The house-form ``ConfigError``: "`field` is value; it must rule (fix)"."""
        return field_error(self.field, self.value, self.rule, self.fix)

    def __str__(self) -> str:
        return str(self.error())


def raise_first(problems: list[Problem]) -> None:
    """Raise the first problem's ``ConfigError`` (nothing when the list is empty)."""
    if problems:
        raise problems[0].error()


def shares_boundaries(plan: Plan) -> bool:
    """Every replica has the same stage boundaries (an aligned plan; otherwise it is asymmetric)."""
    return len({tuple(pipe.boundaries()) for pipe in plan.pipelines}) == 1


def has_tensor_parallel(plan: Plan) -> bool:
    """Some stage of the plan is a tensor-parallel group (tp > 1)."""
    return any(stage.tp > 1 for pipe in plan.pipelines for stage in pipe.stages)


def runs_per_replica(plan: Plan) -> bool:
    """The deepspeed runtime runs each replica as its own pipeline (``ds_runtime.replica_engine``): the replicas'
    boundaries differ, a stage has tp > 1, or the plan is fp16 at ZeRO 0 (rule 4); otherwise the plan runs on
    DeepSpeed's own stage x replica grid."""
    return (not shares_boundaries(plan) or has_tensor_parallel(plan)
            or (plan.dtype == "fp16" and plan.zero_stage == 0) or plan.dtype == "per_device")


def holds_own_masters(plan: Plan) -> bool:
    """The deepspeed runtime keeps the optimizer state (and in 16-bit dtypes the fp32 master weights) itself, in
    ``ds_runtime.holder_sharding``: a per-replica plan at ZeRO 1 (sharded within the holder sets), or a
    ``per_device`` plan (rule 7; at ZeRO 0 whole on every holder).  DeepSpeed's engine then runs plain."""
    return runs_per_replica(plan) and (plan.zero_stage == 1 or plan.dtype == "per_device")


def runtime_problems(plan: Plan, runtime: Runtime | str, world_size: int | None = None) -> list[Problem]:
    """Every reason ``runtime`` cannot run ``plan`` (see the module docstring); ``[]``: it runs it.

    ``world_size`` (the launched process count) adds the check that the job
    has one process per device the plan uses; the planner leaves it out.
    """
    return _RULES[as_runtime(runtime, "runtime")](plan, world_size)


def _no_rules(plan: Plan, world_size: int | None) -> list[Problem]:
    return []


def _deepspeed(plan: Plan, world_size: int | None) -> list[Problem]:
    out: list[Problem] = _tp_degrees(plan) + _no_outer_sync(plan, "hetero_deepspeed")
    out += _tp_group_dtypes(plan)
    zero = plan.zero_stage
    if zero >= 2 and any(len(pipe.stages) > 1 for pipe in plan.pipelines):
        out.append(Problem("plan.zero_stage", zero, "be 0 or 1 for a plan with a multi-stage pipeline "
                           "(DeepSpeed's pipeline engine refuses ZeRO 2 and 3)",
                           "use zero_stage 0 or 1, or plan pure data parallelism (mode dp)"))
    if runs_per_replica(plan) and zero >= 2:
        if not shares_boundaries(plan):
            bounds = [pipe.boundaries() for pipe in plan.pipelines]
            why = f"an asymmetric plan (its replicas have the different boundaries {bounds})"
        elif has_tensor_parallel(plan):
            why = "a plan with tensor parallelism (it runs each replica as its own pipeline)"
        else:
            why = "this plan (it runs each replica as its own pipeline)"
        out.append(Problem("plan.zero_stage", zero, f"be 0 or 1 for {why}: the runtime shards the optimizer "
                           "state within the sets of ranks holding the same parameters (ZeRO 1), not the gradients "
                           "or the weights",
                           "use zero_stage 0 or 1, or re-plan with max_tp=1 and mode pipeline (shared boundaries)"))
    counts = [pipe.num_micro_batches for pipe in plan.pipelines]
    if zero >= 2 and len(set(counts)) > 1:
        common = max(counts)
        for p, pipe in enumerate(plan.pipelines):
            if pipe.samples < common:
                out.append(Problem(f"plan.pipelines[{p}].samples", pipe.samples,
                                   f"be >= {common} under ZeRO {zero} (ZeRO 2/3 reduce on every micro-step, so every "
                                   f"replica runs {common} micro-batches, the most of any replica)",
                                   "use zero_stage 0 or 1, or re-plan with equal micro-batch counts"))
    if world_size is not None:
        used = len(plan.used_devices)
        if world_size != used:
            out.append(Problem("WORLD_SIZE", world_size, f"equal the plan's device count ({used})",
                               "start one process per device the plan uses"))
    return out


def _tp_group_dtypes(plan: Plan) -> list[Problem]:
    """Rule 7: the devices of a tensor-parallel stage compute in one dtype."""
    out: list[Problem] = []
    if plan.dtype != "per_device":
        return out
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            dtypes = sorted({str(plan.compute_dtype(d)) for d in stage.devices})
            if len(dtypes) > 1:
                out.append(Problem(f"plan.pipelines[{p}].stages[{s}].devices", list(stage.devices),
                                   f"compute in one dtype (a tensor-parallel group all-reduces one dtype; these "
                                   f"compute in {', '.join(dtypes)})",
                                   "set settings.device_dtypes so the group's devices share a dtype"))
    return out


def _tp_degrees(plan: Plan) -> list[Problem]:
    """Rule 1: the tp degrees holding each layer each divide the largest (the reduction's unit of a shard)."""
    out: list[Problem] = []
    if not has_tensor_parallel(plan):  # every degree is 1 (the planner's filter calls this for every candidate)
        return out
    num_layers = plan.pipelines[0].boundaries()[-1]
    for layer in range(num_layers):
        held = [(p, s, st.tp) for p, pipe in enumerate(plan.pipelines) for s, st in enumerate(pipe.stages)
                if st.layers[0] <= layer < st.layers[1]]
        units = max(tp for _, _, tp in held)
        for p, s, tp in held:
            if units % tp:
                out.append(Problem(f"plan.pipelines[{p}].stages[{s}].tp", tp, f"divide {units}, the largest tp "
                                   f"holding layer {layer} in another replica (gradients are reduced in units of "
                                   "the finest shard)", "use powers of two for tp"))
                return out
    return out


def _no_outer_sync(plan: Plan, runtime: str) -> list[Problem]:
    if plan.outer_sync is None:
        return []
    return [Problem("plan.outer_sync", plan.outer_sync.to_dict(), f"be absent for {runtime}, which synchronises "
                    "every step (a low-communication plan runs on hetero_diloco)",
                    "run it with strategy=hetero_diloco, or plan without planner.mode=low_communication")]


def _hetero_diloco(plan: Plan, world_size: int | None) -> list[Problem]:
    out = _data_parallel(plan)
    if plan.outer_sync is None:
        out.append(Problem("plan.outer_sync", None, "be given (hetero_diloco runs low-communication plans: groups, "
                           "inner steps and the outer codec)", "plan with `het-plan planner.mode=low_communication`"))
    return out


def _hetero(plan: Plan, world_size: int | None) -> list[Problem]:
    return _data_parallel(plan) + _no_outer_sync(plan, "hetero")


def _data_parallel(plan: Plan) -> list[Problem]:
    out: list[Problem] = []
    for p, pipe in enumerate(plan.pipelines):
        if len(pipe.stages) != 1:
            out.append(Problem(f"plan.pipelines[{p}].stages", len(pipe.stages),
                               "be 1 stage (the hetero strategy runs pure data-parallel plans)",
                               "plan with mode dp, or run pipeline plans on hetero_deepspeed"))
        elif pipe.stages[0].tp != 1:
            out.append(Problem(f"plan.pipelines[{p}].stages[0].tp", pipe.stages[0].tp,
                               "be 1 (the hetero strategy runs pure data-parallel plans)", "plan with mode dp"))
    return out


_RULES = {Runtime.any: _no_rules, Runtime.deepspeed: _deepspeed, Runtime.hetero: _hetero,
          Runtime.hetero_diloco: _hetero_diloco}
