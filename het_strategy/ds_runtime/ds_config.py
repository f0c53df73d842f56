"""The DeepSpeed form of a Plan: ds_config per rank, pipeline boundaries, expert map.

DeepSpeed assumes every data-parallel rank runs the same micro-batch size and
the same number of micro-batches (it asserts ``train_batch_size ==
micro_batch * gradient_accumulation_steps * dp_world`` in each process, against
that process's own config).  A heterogeneous Plan gives ranks unequal shares,
so this module emits one config *per rank*, each internally consistent, plus
the loss weights that make the update equal to the global-batch mean:

1. ``rank_layout`` numbers the ranks the way ``PipeDataParallelTopology`` does
   (axes ``['pipe', 'data']``, row-major: ``rank = stage * dp + data_index``),
   so the rank -> device map agrees with what ``PipelineModule`` assumes.
2. ``deepspeed_config`` / ``per_rank_configs`` emit ds_config dicts holding only
   keys DeepSpeed knows; ``rank_batches`` gives each rank's samples, micro-batch
   sizes and loss weight (kept out of the ds_config on purpose).
3. ``pipeline_parts`` gives ``[0, b1, ..., L]``; ``hetero_pipeline_module``
   builds a ``PipelineModule`` that uses those boundaries instead of
   ``partition_method`` (which cannot express uneven, planned boundaries).
4. ``expert_map`` turns ``plan.experts`` into ``{rank: {layer: [expert ids]}}``.
5. ``write_deepspeed_files`` writes all of it atomically.

Nothing here imports deepspeed or torch at module level: the config builder
runs without them.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from het_strategy.core.atomic_file import write_atomic
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import (ClippingOwner, Runtime, clipping_owner, holds_own_masters, raise_first,
                                             runtime_problems, runs_per_replica)

if TYPE_CHECKING:
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.plan_score import PlanScore
    from het_strategy.core.train_settings import TrainSettings

__all__ = [
    "RankAssignment",
    "RankBatch",
    "rank_layout",
    "rank_batches",
    "deepspeed_config",
    "per_rank_configs",
    "pipeline_parts",
    "hetero_pipeline_module",
    "expert_map",
    "write_deepspeed_files",
    "FP16_INITIAL_SCALE_POWER",
]

FP16_INITIAL_SCALE_POWER = 16
"""fp16's dynamic loss scale starts at ``2 ** 16`` (DeepSpeed's ``initial_scale_power`` default), halved on overflow."""


@dataclass(frozen=True)
class RankAssignment:
    """Where one global rank sits in the Plan."""

    rank: int
    """Global rank (``torch.distributed`` rank)."""
    device: str
    """Device name of the cluster this rank runs on."""
    pipeline: int
    """Index of the data-parallel replica (DeepSpeed's ``data`` coordinate)."""
    stage: int
    """Pipeline stage index (DeepSpeed's ``pipe`` coordinate)."""
    tp_rank: int
    """Rank inside the stage's tensor-parallel group (0 when tp = 1)."""


@dataclass(frozen=True)
class RankBatch:
    """How many samples one rank processes per optimizer step, and how to weight its loss."""

    rank: int
    """Global rank."""
    samples: int
    """Samples of each global batch this rank's pipeline processes."""
    micro_batch_sizes: tuple[int, ...]
    """Size of each micro-batch, in order (their count is the rank's gradient accumulation steps)."""
    loss_weight: float
    """``dp_world * samples / global_batch``: multiply a full micro-batch's mean loss by this."""
    micro_loss_weights: tuple[float, ...]
    """Weight of each micro-batch's mean loss, ``dp_world * gas * m_k / global_batch`` (exact for a short last one)."""

    @property
    def gradient_accumulation_steps(self) -> int:
        return len(self.micro_batch_sizes)


# -- layout -------------------------------------------------------------------------------------

def _on_deepspeed_grid(plan: Plan) -> bool:
    """The ranks are numbered on DeepSpeed's stage x replica grid: all pipelines have the same number of stages
    and every stage has tp = 1 (the boundaries may differ: ``core.runtime_rules.shares_boundaries`` tells an
    aligned plan from an asymmetric one)."""
    num_stages = {len(p.stages) for p in plan.pipelines}
    return len(num_stages) == 1 and all(s.tp == 1 for p in plan.pipelines for s in p.stages)


def rank_layout(plan: Plan) -> list[RankAssignment]:
    """Global rank -> (device, pipeline, stage, tp rank).

    For plans DeepSpeed can run (equal stage counts, tp = 1) the order is
    ``PipeDataParallelTopology``'s: axes ``['pipe', 'data']`` in row-major
    order, so ``rank = stage * num_pipelines + pipeline``; ranks of one stage
    are adjacent (DeepSpeed keeps the gradient allreduce on the fast links).
    Pure data parallelism is the case of one stage: one rank per pipeline in
    plan order.  Other plans (uneven stage counts or tp > 1) are numbered in
    plan order (pipeline, stage, tp rank): ``replica_engine`` runs each
    replica of uneven stage counts or tp > 1 as its own pipeline.
    """
    out: list[RankAssignment] = []
    if _on_deepspeed_grid(plan):
        num_stages = len(plan.pipelines[0].stages)
        dp = plan.num_pipelines
        for stage in range(num_stages):
            for p, pipe in enumerate(plan.pipelines):
                out.append(RankAssignment(stage * dp + p, pipe.stages[stage].devices[0], p, stage, 0))
        return out
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            for t, dev in enumerate(stage.devices):
                out.append(RankAssignment(len(out), dev, p, s, t))
    return out


# -- batches ------------------------------------------------------------------------------------

def _split(samples: int, num_parts: int) -> list[int]:
    """``samples`` split into ``num_parts`` non-empty sizes that differ by at most one, largest first."""
    base, extra = divmod(samples, num_parts)
    return [base + 1] * extra + [base] * (num_parts - extra)


def rank_batches(plan: Plan) -> list[RankBatch]:
    """Each rank's micro-batch sizes and loss weight.

    Loss weighting, the why: DeepSpeed divides each micro-batch loss by the
    rank's ``gradient_accumulation_steps`` (gas_r) and averages gradients over
    the ``dp_world`` ranks with equal weight.  A rank whose micro-batch loss is
    the mean over its ``m_k`` samples therefore contributes
    ``(1 / dp_world) * (1 / gas_r) * (1 / m_k) * sum_i g_i`` per micro-batch,
    whereas the global-batch mean wants ``(1 / B) * sum_i g_i``.  Multiplying
    the micro-batch loss by ``w = dp_world * gas_r * m_k / B`` restores it;
    with full micro-batches (``gas_r * m_k = samples_r``) this is the rank's
    ``loss_weight = dp_world * samples_r / B``.  Check: ranks with 3 and 1
    samples of B = 4 get weights 1.5 and 0.5; ``(1/2)(1.5 * mean_3 + 0.5 *
    mean_1) = (3 mean_3 + 1 mean_1) / 4``, the mean of all 4.  Even plans get
    weight 1 everywhere.

    Every stage of a pipeline shares its pipeline's batches (the stages pass
    the same micro-batches along), so only the last stage's loss is weighted.

    With ZeRO-2/3 DeepSpeed reduces (and at 3 gathers) on every micro-step,
    not only at the accumulation boundary, so all ranks must run the same
    number of micro-batches: uneven pipelines are then given the largest
    micro-batch count of any pipeline, their samples split into that many
    micro-batches (each no larger than planned, so memory still fits).
    """
    raise_first(runtime_problems(plan, Runtime.deepspeed))  # also: every replica can take the common count
    layout = rank_layout(plan)
    dp = plan.num_pipelines
    counts = [p.num_micro_batches for p in plan.pipelines]
    equal_gas = plan.zero_stage >= 2 and len(set(counts)) > 1
    gas_common = max(counts)
    out: list[RankBatch] = []
    for ra in layout:
        pipe = plan.pipelines[ra.pipeline]
        if equal_gas:
            sizes = _split(pipe.samples, gas_common)
        else:
            n = pipe.num_micro_batches
            sizes = [pipe.micro_batch_size] * (n - 1) + [pipe.samples - (n - 1) * pipe.micro_batch_size]
        gas = len(sizes)
        out.append(RankBatch(
            rank=ra.rank, samples=pipe.samples, micro_batch_sizes=tuple(sizes),
            loss_weight=dp * pipe.samples / plan.global_batch_size,
            micro_loss_weights=tuple(dp * gas * m / plan.global_batch_size for m in sizes)))
    return out


# -- ds_config ----------------------------------------------------------------------------------

def _check_settings(plan: Plan, settings: "TrainSettings") -> None:
    if settings.global_batch_size != plan.global_batch_size:
        raise field_error("settings.global_batch_size", settings.global_batch_size,
                          f"equal the plan's global_batch_size ({plan.global_batch_size})")
    if settings.dtype != plan.dtype:
        raise field_error("settings.dtype", settings.dtype, f"equal the plan's dtype ({plan.dtype})",
                          "the plan's memory figures assume its own dtype; re-plan or change settings.dtype")
    if settings.zero_stage != plan.zero_stage:
        raise field_error("settings.zero_stage", settings.zero_stage, f"equal the plan's zero_stage ({plan.zero_stage})",
                          "the plan's memory figures assume its own ZeRO stage; re-plan or change settings.zero_stage")


def _offload_choice(plan: Plan, score: "PlanScore | None", offload: bool | None,
                    cost_model: "CostModel | None") -> tuple[bool, bool]:
    """(offload optimizer, offload params): forced by ``offload``, else from the score's memory."""
    if offload is not None:
        return bool(offload), bool(offload) and plan.zero_stage == 3
    if score is None:
        return False, False
    over = [d for d in score.memory_bytes if score.memory_bytes[d] > score.memory_capacity_bytes[d]]
    if not over:
        return False, False
    if cost_model is None:
        # no breakdown available: move everything DeepSpeed can move
        return True, plan.zero_stage == 3
    params_too = False
    for dev in over:
        optim, weights = _state_bytes(plan, dev, cost_model)
        left = score.memory_bytes[dev] - optim
        if left > score.memory_capacity_bytes[dev] and plan.zero_stage == 3:
            params_too = True
            left -= weights
        if left > score.memory_capacity_bytes[dev]:
            warnings.warn(f"device `{dev}` needs {left / 2**30:.2f} GiB even with offload "
                          f"(capacity {score.memory_capacity_bytes[dev] / 2**30:.2f} GiB): activations do not fit; "
                          "use activation checkpointing, a smaller micro-batch or re-plan", stacklevel=3)
    return True, params_too


def _state_bytes(plan: Plan, device: str, cost_model: "CostModel") -> tuple[float, float]:
    """(optimizer-state bytes, weight bytes) the cost model charges ``device`` (ZeRO sharding applied)."""
    s = cost_model.settings
    shards = s.zero_shards(plan.num_pipelines)
    held: dict[int, int] = {}
    for layer, mapping in plan.experts.items():
        if device in mapping:
            held[layer] = len(mapping[device])
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            if device in stage.devices:
                params = cost_model.stage_param_count(*stage.layers, held or None) / stage.tp
                return params * s.optimizer_bytes_per_param / shards.optimizer, params * s.param_bytes / shards.weights
    return 0.0, 0.0


def _warn_first_stage_clipping() -> None:
    """Warn (at ``deepspeed_config``'s caller) that plain DeepSpeed would clip this config by stage 0's norm."""
    # plain DeepSpeed running this config clips by the norm of stage 0's gradients only (clipping_owner);
    # PlanRunner passes gradient_clipping 0 here and clips by the global norm itself
    warnings.warn("DeepSpeed's fp32 ZeRO-0 pipeline engine clips gradients by the first stage's norm only; "
                  "use zero_stage 1 (or gradient_clipping 0) for clipping by the global norm", stacklevel=3)


def _rank_batch(plan: Plan, rank: int | None) -> RankBatch:
    """The batch figures of ``rank`` (rank 0 when None); refused outside the plan's ranks."""
    batches = rank_batches(plan)
    r = 0 if rank is None else rank
    if not 0 <= r < len(batches):
        raise field_error("rank", rank, f"be in [0, {len(batches)}) (the plan has {len(batches)} ranks)")
    return batches[r]


def _zero_optimization(plan: Plan, on_grid: bool, offload: bool | None, off_optim: bool,
                       off_params: bool) -> dict[str, Any]:
    """The ds_config's ``zero_optimization``: the stage DeepSpeed runs and what it offloads to the CPU."""
    if off_optim and not on_grid:
        raise field_error("offload", offload, "be off for a plan run per replica (asymmetric, tensor-parallel or "
                          "fp16 at ZeRO 0: DeepSpeed offloads only through ZeRO, which such a plan cannot use)",
                          "re-plan within the devices' memory")
    # a per-replica plan's grid has no data-parallel group for DeepSpeed's ZeRO to shard over: DeepSpeed runs at
    # ZeRO 0 and the runtime shards within the holder sets itself (ds_runtime.holder_sharding)
    zero: dict[str, Any] = {"stage": plan.zero_stage if on_grid else 0}
    if off_optim:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if off_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if off_optim and plan.zero_stage == 0:
        # DeepSpeed offloads only through ZeRO; stage 1 shards nothing extra at dp=1 and is the cheapest host
        zero["stage"] = 1
    return zero


def _mixed_precision(plan: Plan, param_dtype: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ds_config's ``bf16`` and ``fp16`` sections: DeepSpeed's mixed precision, unless the runtime keeps the
    fp32 masters itself."""
    # ZeRO 1 run per replica, or per_device: the holder sets keep the fp32 masters and clip (DeepSpeed runs plain)
    holder_sharded = holds_own_masters(plan, param_dtype)
    bf16 = {"enabled": plan.dtype == "bf16" and not holder_sharded}
    fp16: dict[str, Any] = {"enabled": plan.dtype == "fp16" and not holder_sharded}
    if fp16["enabled"]:
        fp16.update({"loss_scale": 0, "initial_scale_power": FP16_INITIAL_SCALE_POWER})
    return bf16, fp16


def deepspeed_config(plan: Plan, settings: "TrainSettings", score: "PlanScore | None" = None, *,
                     rank: int | None = None, gradient_clipping: float = 1.0, offload: bool | None = None,
                     cost_model: "CostModel | None" = None, param_dtype: str | None = None) -> dict[str, Any]:
    """The ds_config of one rank (rank 0 when ``rank`` is None); ``param_dtype``: the model's parameters' dtype
    (``"float64"`` runs per replica: ``core.runtime_rules.runs_per_replica``; None: the plan's dtype).

    ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` are
    the rank's own; ``train_batch_size`` is ``micro * gas * dp_world`` so
    DeepSpeed's per-process assertion holds (it is the batch *this* rank's
    figures imply; the true global batch is ``plan.global_batch_size``).
    Ranks with unequal shares must weight their loss: see ``rank_batches``
    (the weights are not put in the config: DeepSpeed gets only keys it knows).

    Offload (``offload=None``: automatic): when ``score`` shows a device over
    its memory capacity, the optimizer state goes to CPU, and at ZeRO-3 the
    parameters too (only when the optimizer alone is not enough, if
    ``cost_model`` is given to break the memory down).  ``True``/``False``
    force it on or off.  DeepSpeed offloads only through ZeRO, so offload on a
    ZeRO-0 plan emits stage 1 (which only lowers memory).

    Asymmetric plans (replicas with different boundaries) and plans with tp > 1
    run each replica as its own one-replica grid (``ds_runtime.replica_engine``):
    their ``train_batch_size`` is ``micro * gas``; ``gradient_clipping`` is 0
    where the runtime clips after its own reduction, counting each shard once
    (``core.runtime_rules.clipping_owner``).  At ZeRO 1 in bf16 and fp16 DeepSpeed's bf16 / fp16 is off:
    the runtime runs the layers in that dtype and keeps the fp32 master weights
    sharded itself (``ds_runtime.holder_sharding``; fp16 with DeepSpeed's
    dynamic loss scaler from ``2 ** FP16_INITIAL_SCALE_POWER``), so DeepSpeed's
    ``BF16_Optimizer`` / ``FP16_Optimizer`` (whole fp32 copies) are not built.
    A ``per_device`` plan runs per replica the same way at every ZeRO stage it
    allows (``core.runtime_rules.holds_own_masters``), its bf16 / fp16 off.

    Refused: plans the deepspeed runtime cannot run (``core.runtime_rules``) and
    asymmetric plans with offload.
    """
    _check_settings(plan, settings)
    raise_first(runtime_problems(plan, Runtime.deepspeed))
    on_grid = not runs_per_replica(plan, param_dtype)  # DeepSpeed's own stage x replica grid runs it
    deepspeed_clips = clipping_owner(plan, param_dtype) is ClippingOwner.deepspeed
    if on_grid and not deepspeed_clips and gradient_clipping > 0 and rank in (None, 0):
        _warn_first_stage_clipping()
    rb = _rank_batch(plan, rank)
    micro = max(rb.micro_batch_sizes)
    gas = rb.gradient_accumulation_steps
    # An asymmetric, tp or ZeRO-0 fp16 plan runs each replica as its own one-replica grid (ds_runtime.replica_engine)
    dp = plan.num_pipelines if on_grid else 1
    off_optim, off_params = _offload_choice(plan, score, offload, cost_model)
    zero = _zero_optimization(plan, on_grid, offload, off_optim, off_params)
    bf16, fp16 = _mixed_precision(plan, param_dtype)
    cfg: dict[str, Any] = {
        "train_batch_size": micro * gas * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        # on DeepSpeed's grid the config keeps the clipping (plain DeepSpeed may run it); per replica only where
        # DeepSpeed clips (core.runtime_rules.clipping_owner), else the runtime clips after its own reduction
        "gradient_clipping": float(gradient_clipping) if on_grid or deepspeed_clips else 0.0,
        "zero_optimization": zero,
        "bf16": bf16,
        "fp16": fp16,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if plan.dtype != "fp32":
        # reduce gradients in the dtype the cost model priced (settings.grad_dtype; fp32 unless set)
        cfg["communication_data_type"] = str(settings.grad_reduce_dtype)  # plain JSON: the config is saved too
    return cfg


def per_rank_configs(plan: Plan, settings: "TrainSettings", score: "PlanScore | None" = None, *,
                     gradient_clipping: float = 1.0, offload: bool | None = None,
                     cost_model: "CostModel | None" = None) -> list[dict[str, Any]]:
    """Every rank's ds_config, indexed by global rank."""
    n = len(rank_layout(plan))
    return [deepspeed_config(plan, settings, score, rank=r, gradient_clipping=gradient_clipping, offload=offload,
                             cost_model=cost_model) for r in range(n)]


# -- pipeline boundaries ------------------------------------------------------------------------

def pipeline_parts(plan: Plan) -> list[int]:
    """Stage boundaries ``[0, b1, ..., L]`` shared by every pipeline.

    DeepSpeed's ``PipelineModule`` holds one partition for all data-parallel
    replicas (a stage's gradients are allreduced with the same stage of every
    other replica, so they must hold the same layers).
    """
    first = plan.pipelines[0].boundaries()
    for p, pipe in enumerate(plan.pipelines[1:], start=1):
        if pipe.boundaries() != first:
            listing = "; ".join(f"pipeline {i}: {q.boundaries()}" for i, q in enumerate(plan.pipelines))
            raise field_error(f"plan.pipelines[{p}].stages[].layers", pipe.boundaries(),
                              f"match pipeline 0's boundaries {first} (DeepSpeed's PipelineModule needs one "
                              f"partition for all data-parallel replicas; {listing})",
                              "re-plan with mode pipeline (shared boundaries) or run with the hetero strategy")
    return list(first)


def _check_parts(parts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    parts = [int(b) for b in parts]
    if len(parts) - 1 != num_stages:
        raise field_error("parts", parts, f"have num_stages + 1 = {num_stages + 1} entries")
    if parts[0] != 0 or parts[-1] != num_layers:
        raise field_error("parts", parts, f"start at 0 and end at the number of layers ({num_layers})")
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise field_error("parts", parts, "increase strictly (every stage holds at least one layer)")
    return parts


_module_class: type | None = None


def _hetero_class() -> type:
    """``HeteroPipelineModule``, defined on first use so importing this module does not import deepspeed."""
    global _module_class
    if _module_class is not None:
        return _module_class
    from deepspeed.pipe import PipelineModule

    class HeteroPipelineModule(PipelineModule):
        """A ``PipelineModule`` whose stage boundaries are given (``parts``), not computed."""

        def __init__(self, layers: Sequence[Any], parts: Sequence[int], *, loss_weight: float = 1.0,
                     **kwargs: Any) -> None:
            # PipelineModule.__init__ partitions before it builds; the parts must be in place first.
            object.__setattr__(self, "_het_parts", list(parts))
            loss_fn = kwargs.pop("loss_fn", None)
            if loss_fn is not None and loss_weight != 1.0:
                loss_fn = _WeightedLoss(loss_fn, loss_weight)
            kwargs.pop("partition_method", None)
            super().__init__(layers, loss_fn=loss_fn, partition_method="het_parts", **kwargs)

        def _partition_layers(self, method: str = "het_parts") -> None:
            # Replaces DeepSpeed's uniform/parameters/type: partitioning with the plan's boundaries.
            self.parts = _check_parts(self._het_parts, len(self._layer_specs), self.num_stages)
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])

        def _index_tied_modules(self) -> dict[str, Any]:
            # DeepSpeed's TiedLayerSpec groups, then those of a parameter the first and last layer share
            # (tied embeddings: ``tied_weights``); the last stage's copy counts once in the norms, as DeepSpeed's
            from het_strategy.ds_runtime.tied_weights import tied_comms, tied_parameters

            comms = super()._index_tied_modules()
            object.__setattr__(self, "het_tied", tied_comms(self, tied_parameters(self._layer_specs)))
            for comm in self.het_tied:
                if self.global_rank != comm["ranks"][0]:
                    for q in comm["params"]:
                        q.ds_pipe_replicated = True
            return comms

        def get_tied_weights_and_groups(self) -> list[tuple[Any, Any]]:
            return [*super().get_tied_weights_and_groups(),
                    *((q, comm["group"]) for comm in self.het_tied for q in comm["params"])]

        def allreduce_tied_weight_gradients(self) -> None:
            import deepspeed.comm as dist

            super().allreduce_tied_weight_gradients()
            for comm in self.het_tied:
                for q in comm["params"]:
                    dist.all_reduce(q.grad, group=comm["group"])

        def _synchronize_tied_weights(self) -> None:
            import deepspeed.comm as dist

            super()._synchronize_tied_weights()
            for comm in getattr(self, "het_tied", ()):
                for q in comm["params"]:
                    dist.broadcast(q.data, src=comm["ranks"][0], group=comm["group"])

    _module_class = HeteroPipelineModule
    return HeteroPipelineModule


class _WeightedLoss:
    """``loss_fn`` scaled by a constant (the rank's loss weight)."""

    def __init__(self, loss_fn: Callable[..., Any], weight: float) -> None:
        self.loss_fn = loss_fn
        self.weight = weight
        self.__name__ = f"{getattr(loss_fn, '__name__', type(loss_fn).__name__)}*{weight:g}"

    def __call__(self, outputs: Any, labels: Any) -> Any:
        return self.loss_fn(outputs, labels) * self.weight


def hetero_pipeline_module(layers: Sequence[Any], parts: Sequence[int], **kwargs: Any) -> Any:
    """A ``HeteroPipelineModule`` (``deepspeed.pipe.PipelineModule`` subclass) split at ``parts``.

    ``kwargs`` go to ``PipelineModule`` (``loss_fn``, ``activation_checkpoint_interval``,
    ...); ``num_stages`` defaults to ``len(parts) - 1``; ``loss_weight`` scales
    ``loss_fn`` (see ``rank_batches``).  ``partition_method`` is ignored.
    """
    kwargs.setdefault("num_stages", len(parts) - 1)
    if kwargs.get("topology") is None and kwargs["num_stages"] != len(parts) - 1:
        raise field_error("parts", list(parts), f"have num_stages + 1 = {kwargs['num_stages'] + 1} entries")
    return _hetero_class()(layers, parts, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "HeteroPipelineModule":
        return _hetero_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- experts ------------------------------------------------------------------------------------

def expert_map(plan: Plan) -> dict[int, dict[int, list[int]]]:
    """``{rank: {layer: [expert ids]}}`` from ``plan.experts`` (``{layer: {device: [ids]}}``)."""
    by_device = {ra.device: ra.rank for ra in rank_layout(plan)}
    out: dict[int, dict[int, list[int]]] = {}
    for layer in sorted(plan.experts):
        for dev, ids in plan.experts[layer].items():
            if dev not in by_device:
                raise field_error(f"plan.experts[{layer}]", dev, "name a device the plan runs on",
                                  f"devices with ranks: {sorted(by_device)}")
            out.setdefault(by_device[dev], {})[int(layer)] = sorted(int(i) for i in ids)
    return dict(sorted(out.items()))


# -- files --------------------------------------------------------------------------------------

def write_deepspeed_files(plan: Plan, settings: "TrainSettings", score: "PlanScore | None", out_dir: str | Path, *,
                          gradient_clipping: float = 1.0, offload: bool | None = None,
                          cost_model: "CostModel | None" = None) -> list[Path]:
    """Write ``ds_config.json`` (rank 0), ``ds_config.rank{r}.json`` when ranks differ, and ``ds_plan_parts.json``."""
    out_dir = Path(out_dir)
    configs = per_rank_configs(plan, settings, score, gradient_clipping=gradient_clipping, offload=offload,
                               cost_model=cost_model)
    written = [write_atomic(out_dir / "ds_config.json", json.dumps(configs[0], indent=2) + "\n")]
    if any(c != configs[0] for c in configs):
        for r, cfg in enumerate(configs):
            written.append(write_atomic(out_dir / f"ds_config.rank{r}.json", json.dumps(cfg, indent=2) + "\n"))
    try:
        parts: list[int] | None = pipeline_parts(plan)
    except ConfigError:
        parts = None
    side = {
        "ranks": [asdict(ra) for ra in rank_layout(plan)],
        "parts": parts,
        "loss_weights": {str(b.rank): {"samples": b.samples, "micro_batch_sizes": list(b.micro_batch_sizes),
                                       "loss_weight": b.loss_weight,
                                       "micro_loss_weights": list(b.micro_loss_weights)}
                         for b in rank_batches(plan)},
        "experts": {str(r): {str(layer): ids for layer, ids in m.items()} for r, m in expert_map(plan).items()},
    }
    written.append(write_atomic(out_dir / "ds_plan_parts.json", json.dumps(side, indent=2) + "\n"))
    return written
