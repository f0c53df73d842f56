"""What each runtime can run: one rule table, read by the planner, the runtimes and the strategies.

``runtime_problems(plan, runtime)`` lists every reason ``runtime`` cannot run
``plan`` exactly (an empty list: it can).  Each ``Problem`` names the plan
field by its full dotted path with indices (``plan.pipelines[1].stages[0].tp``),
its value and the rule it breaks, so one list serves the planner's filter
(``planning.runtimes.search_runtime`` keeps plans with no problem), the
DeepSpeed runtime (``ds_runtime.engine.check_runnable`` raises the first) and
the construction checks of the Lightning strategies.

Beside the table, the decisions the deepspeed runtime's parts must agree on are
made here once: whether it runs a plan per replica (``runs_per_replica``), keeps
the fp32 masters itself (``holds_own_masters``), who clips the gradients
(``clipping_owner``), and which Lightning precisions it runs
(``DEEPSPEED_PRECISIONS``).

Invariants: a rule is a function of the plan alone (and the launched world size),
so the planner and the runtime refuse exactly the same plans (the path decisions
also take the parameters' dtype, which a plan's ``fp32`` does not tell from float64); each rule function's
docstring gives its rule and the reason, and the docs' "What a runtime runs"
(``docs/how-it-works/runtimes.md``) lists them all by runtime.  Pure Python: the
planning core reads this table without torch or DeepSpeed.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from het_strategy.core.dtypes import Dtype
from het_strategy.core.errors import ConfigError, field_error, require_option
from het_strategy.core.plan import Plan

__all__ = ["Runtime", "as_runtime", "Problem", "runtime_problems", "raise_first", "shares_boundaries",
           "has_tensor_parallel", "runs_per_replica", "holds_own_masters", "ClippingOwner", "clipping_owner",
           "DEEPSPEED_PRECISIONS"]

DEEPSPEED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "per_device")
"""Lightning's precisions the deepspeed runtime (``hetero_deepspeed``) runs, each in the dtype
``core.dtypes.precision_dtype`` gives it: DeepSpeed's bf16 and fp16 keep fp32 master weights, which is
Lightning's ``-mixed`` (its ``-true`` keeps none); ``per_device`` (the ``PerDevicePrecision`` plugin) runs each
rank in its device's dtype over the runtime's fp32 masters (``holds_own_masters``)."""


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
    hetero_fsdp = "hetero_fsdp"
    """The ``hetero_fsdp`` strategy: fully sharded data parallelism, shares by speed and shards by memory."""


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


def runs_per_replica(plan: Plan, param_dtype: str | None = None) -> bool:
    """The deepspeed runtime runs each replica as its own pipeline (``ds_runtime.replica_engine``); otherwise the
    plan runs on DeepSpeed's own stage x replica grid.  ``param_dtype``: the model's parameters' dtype as torch
    names it without ``torch.`` (``"float64"``; None: the plan's dtype).  Per replica:

    * replicas with different stage boundaries (an asymmetric plan): DeepSpeed's grid has one set of boundaries;
    * a stage of tp > 1: the replica engine runs ``tensor_parallel``'s Megatron split;
    * fp16 at ZeRO 0: DeepSpeed 0.19's ZeRO-0 fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``)
      unscale the gradients by the loss scale at the step, but its ``engine.backward`` scales the loss only for
      ZeRO optimizers, so on DeepSpeed's own engine every update would be 1/loss-scale too small (measured: a
      3-step run moves the loss 1/13 as far as fp32's); the per-replica engine scales the loss itself;
    * ``per_device``: DeepSpeed's engine takes one precision config (``holds_own_masters``);
    * float64 parameters (an ``fp32`` plan) at ZeRO 0 and 1: DeepSpeed 0.19's grid reduces no float64 gradient
      ("attempting to reduce an unsupported grad type: torch.float64": its accelerators' ``supported_dtypes``);
      the holder sets reduce in the parameters' dtype, so a float64 run is exact (ZeRO 2 and 3 stay on the grid,
      where DeepSpeed refuses it)."""
    return (not shares_boundaries(plan) or has_tensor_parallel(plan)
            or (plan.dtype == "fp16" and plan.zero_stage == 0) or plan.dtype == "per_device"
            or (param_dtype == "float64" and plan.zero_stage <= 1))


def holds_own_masters(plan: Plan, param_dtype: str | None = None) -> bool:
    """The deepspeed runtime keeps the optimizer state (and in 16-bit dtypes the fp32 master weights) itself, in
    ``ds_runtime.holder_sharding``; DeepSpeed's engine then runs plain (``param_dtype``: as ``runs_per_replica``).

    * A per-replica plan at ZeRO 1: sharded within each set of ranks holding the same parameters (in bf16 and
      fp16 the fp32 masters too; fp16 with DeepSpeed's dynamic loss scaler), since a replica's grid has no
      data-parallel group for DeepSpeed's ZeRO to shard over.
    * A ``per_device`` plan (bf16 on some devices, fp16 on others), whole on every holder at ZeRO 0: each rank
      computes in its device's dtype, a stage casts what it receives to its own, gradients are reduced in fp32
      and one loss scale (DeepSpeed's dynamic scaler, kept in step on every rank by the one overflow decision)
      covers every backward."""
    return runs_per_replica(plan, param_dtype) and (plan.zero_stage == 1 or plan.dtype == "per_device")


class ClippingOwner(StrEnum):
    """Who clips the gradients by their global norm in the deepspeed runtime (``clipping_owner``)."""

    deepspeed = "deepspeed"
    """DeepSpeed: its engine, or its mixed-precision optimizer (the ds_config's ``gradient_clipping``)."""
    runtime = "runtime"
    """The runtime, after its own reduction (``ds_runtime.clipping``; per replica the holder-set reducer or
    sharding, each shard counted once); DeepSpeed is given no clipping."""


def clipping_owner(plan: Plan, param_dtype: str | None = None) -> ClippingOwner:
    """Who clips ``plan``'s gradients by the global norm in the deepspeed runtime (``param_dtype``: as
    ``runs_per_replica``).

    * On DeepSpeed's own grid (``runs_per_replica`` false): DeepSpeed, except for an fp32 ZeRO-0 pipeline of
      several stages: DeepSpeed 0.19's engine clips that by stage 0's gradient norm only (``clip_grad_norm_``
      counts non-tensor-parallel parameters on model-parallel rank 0 alone, and a ``PipelineParallelGrid``'s
      model-parallel group is the whole pipeline), so the runtime's ``ClippingPipelineEngine`` clips by the
      global norm after DeepSpeed's reduction.  ZeRO 1 to 3 clip by the global norm in DeepSpeed.
    * Per replica: DeepSpeed's mixed-precision optimizer in bf16 and fp16 (its norm and overflow check run over
      the replica's pipeline group, after the runtime's reduction), except where the runtime clips: in fp32
      (DeepSpeed's plain ZeRO-0 pipeline engine would clip by stage 0's norm, as above), with tp > 1 (DeepSpeed's
      norm would count a replicated parameter once per tp rank) and where the runtime holds the masters
      (``holds_own_masters``: DeepSpeed runs plain)."""
    if not runs_per_replica(plan, param_dtype):
        pipeline = len(plan.pipelines[0].stages) > 1
        return ClippingOwner.runtime if pipeline and plan.zero_stage == 0 and plan.dtype == Dtype.fp32 \
            else ClippingOwner.deepspeed
    if plan.dtype in (Dtype.bf16, Dtype.fp16) and not holds_own_masters(plan, param_dtype) \
            and not has_tensor_parallel(plan):
        return ClippingOwner.deepspeed
    return ClippingOwner.runtime


def runtime_problems(plan: Plan, runtime: Runtime | str, world_size: int | None = None) -> list[Problem]:
    """Every reason ``runtime`` cannot run ``plan`` (the rule functions below, one per runtime); ``[]``: it runs it.

    ``world_size`` (the launched process count) adds the check that the job
    has one process per device the plan uses; the planner leaves it out.
    """
    return _RULES[as_runtime(runtime, "runtime")](plan, world_size)


def _no_rules(plan: Plan, world_size: int | None) -> list[Problem]:
    """``any``: nothing is refused (the unconstrained planner's space)."""
    return []


def _deepspeed(plan: Plan, world_size: int | None) -> list[Problem]:
    """``deepspeed`` (``hetero_deepspeed``: ``ds_runtime.PlanRunner`` on unpatched DeepSpeed).

    1. Tensor parallelism (a stage of tp > 1 devices) runs per replica (rule 3); the tp degrees of the replicas
       holding a layer each divide the largest of them (``_tp_degrees``).  Whether a model's blocks split that
       way (heads and widths divisible by tp) is checked when the runtime builds the stage
       (``tensor_parallel.check_layer``).
    2. A plan with a multi-stage pipeline runs at ZeRO 0 or 1: DeepSpeed's pipeline engine asserts against
       ZeRO 2 and 3 (0.19's ``PipelineEngine.__init__``: "ZeRO-2 and ZeRO-3 are incompatible with pipeline
       parallelism").  One-stage replicas (pure data parallelism) run at every ZeRO stage.
    3. Asymmetric plans, plans with tp > 1, fp16 plans at ZeRO 0, ``per_device`` plans and float64 models at
       ZeRO 0 and 1 run each replica as its own pipeline (``runs_per_replica``), in every dtype at ZeRO 0 (the
       runtime reduces the gradients DeepSpeed's optimizer steps on) and at ZeRO 1 (the runtime shards the
       optimizer state within the holder sets: ``holds_own_masters``).  ZeRO 2 and 3 are refused: that sharding
       splits neither the gradients nor the weights.
    4. fp16 at ZeRO 0 runs per replica (rule 3; the reason: ``runs_per_replica``).
    5. At ZeRO 2 and 3 DeepSpeed reduces on every micro-step, so every replica runs the largest micro-batch
       count of any replica: a replica with fewer samples than that count cannot be cut into it.
    6. With ``world_size`` given: one process per device the plan uses.
    7. A ``per_device`` plan runs per replica (rule 3) over the runtime's own fp32 masters
       (``holds_own_masters``), since DeepSpeed's engine takes one precision config; a tensor-parallel group
       computes in one dtype (``_tp_group_dtypes``).

    And no ``plan.outer_sync``: a low-communication plan runs on ``hetero_diloco``; no ``plan.shards``: a fully
    sharded plan runs on ``hetero_fsdp``.
    """
    out: list[Problem] = _tp_degrees(plan) + _no_outer_sync(plan, "hetero_deepspeed")
    out += _no_shards(plan, "hetero_deepspeed")
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
    """deepspeed rule 7: the devices of a tensor-parallel stage compute in one dtype (its all-reduces sum one)."""
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
    """deepspeed rule 1: the tp degrees holding each layer each divide the largest (a gradient is reduced in units
    of the largest degree's shard: ``ReplicaLayout.units``)."""
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


def _no_shards(plan: Plan, runtime: str) -> list[Problem]:
    if not plan.shards:
        return []
    return [Problem("plan.shards", dict(plan.shards), f"be absent for {runtime}, which keeps whole parameters on "
                    "every replica (a plan with shards runs on hetero_fsdp)",
                    "run it with strategy=hetero_fsdp, or plan without planner.mode=fsdp")]


def _hetero_diloco(plan: Plan, world_size: int | None) -> list[Problem]:
    """``hetero_diloco`` (DiLoCo over groups of uneven data parallelism): as ``hetero`` rule 1, pure data
    parallelism, each group's replicas one device each; and a ``plan.outer_sync`` (its groups cover the used
    devices: ``Plan`` checks that when it is built); no ``plan.shards``."""
    out = _data_parallel(plan) + _no_shards(plan, "hetero_diloco")
    if plan.outer_sync is None:
        out.append(Problem("plan.outer_sync", None, "be given (hetero_diloco runs low-communication plans: groups, "
                           "inner steps and the outer codec)", "plan with `het-plan planner.mode=low_communication`"))
    return out


def _hetero(plan: Plan, world_size: int | None) -> list[Problem]:
    """``hetero`` (uneven data parallelism on Lightning's DDP).

    1. Every pipeline is one stage of one device (a pure data-parallel plan); pipeline plans run on
       ``hetero_deepspeed``.  Every dtype runs, ``per_device`` too (the ``PerDevicePrecision`` plugin).
    2. No ``plan.outer_sync``: a low-communication plan runs on ``hetero_diloco``.
    3. No ``plan.shards``: a fully sharded plan runs on ``hetero_fsdp`` (DDP keeps a whole replica per rank).
    """
    return _data_parallel(plan) + _no_outer_sync(plan, "hetero") + _no_shards(plan, "hetero")


def _hetero_fsdp(plan: Plan, world_size: int | None) -> list[Problem]:
    """``hetero_fsdp`` (fully sharded data parallelism: shares by speed, shards by memory).

    1. As ``hetero`` rule 1: every pipeline is one stage of one device (each rank computes its share of the
       batch on the whole model, gathered unit by unit).
    2. A ``plan.shards``: each used device's fraction of every flat parameter (``Plan`` checks that it names
       every used device and sums to 1; ``core/shard_sizes.py`` cuts the pieces).
    3. Every device of ``plan.cluster_devices`` is used: every launched rank holds a piece of every unit and
       takes part in each unit's all-gathers and reduce-scatters (a fraction may be 0; a share may not).
    4. ``plan.zero_stage`` 0: the runtime shards parameters, gradients and optimizer state itself, by
       ``plan.shards`` (``zero_stage`` is DeepSpeed's).
    5. No ``plan.outer_sync``: a low-communication plan runs on ``hetero_diloco``.
    6. With ``world_size`` given: one process per device the plan uses.
    """
    out = _data_parallel(plan, "hetero_fsdp") + _no_outer_sync(plan, "hetero_fsdp")
    if not plan.shards:
        out.append(Problem("plan.shards", None, "be given (hetero_fsdp runs fully sharded plans: each rank's "
                           "fraction of every flat parameter)", "plan with `het-plan planner.mode=fsdp`"))
    idle = [d for d in plan.cluster_devices if d not in set(plan.used_devices)]
    if idle:
        out.append(Problem("plan.cluster_devices", idle, "all be used (every hetero_fsdp rank takes part in "
                           "every unit's all-gather and reduce-scatter)", "re-plan with planner.mode=fsdp"))
    if plan.zero_stage != 0:
        out.append(Problem("plan.zero_stage", plan.zero_stage, "be 0 (hetero_fsdp shards parameters, gradients and "
                           "optimizer state itself, by plan.shards)", "re-plan with planner.mode=fsdp"))
    if world_size is not None and world_size != len(plan.used_devices):
        out.append(Problem("WORLD_SIZE", world_size, f"equal the plan's device count ({len(plan.used_devices)})",
                           "start one process per device the plan uses"))
    return out


def _data_parallel(plan: Plan, strategy: str = "hetero") -> list[Problem]:
    out: list[Problem] = []
    mode = "fsdp" if strategy == "hetero_fsdp" else "dp"
    for p, pipe in enumerate(plan.pipelines):
        if len(pipe.stages) != 1:
            out.append(Problem(f"plan.pipelines[{p}].stages", len(pipe.stages),
                               f"be 1 stage (the {strategy} strategy runs pure data-parallel plans)",
                               f"plan with mode {mode}, or run pipeline plans on hetero_deepspeed"))
        elif pipe.stages[0].tp != 1:
            out.append(Problem(f"plan.pipelines[{p}].stages[0].tp", pipe.stages[0].tp,
                               f"be 1 (the {strategy} strategy runs pure data-parallel plans)",
                               f"plan with mode {mode}"))
    return out


_RULES = {Runtime.any: _no_rules, Runtime.deepspeed: _deepspeed, Runtime.hetero: _hetero,
          Runtime.hetero_diloco: _hetero_diloco, Runtime.hetero_fsdp: _hetero_fsdp}
