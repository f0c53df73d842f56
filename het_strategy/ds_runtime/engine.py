"""Run one rank of a Plan on unpatched DeepSpeed, with the update of one process on the whole batch.

``PlanRunner`` is built in every process of the job (one per device the plan
uses).  ``train_step(x, y)`` takes the whole global batch, identical on every
rank, and makes the optimizer step that a single process would make on the
mean loss over all ``B`` samples.  Aligned plans run on DeepSpeed's own grid;
asymmetric plans and plans with tensor-parallel stages run each replica as its
own pipeline (``replica_engine``).  ``check_runnable`` refuses a plan this
runtime cannot run exactly (``core.runtime_rules``'s ``deepspeed`` table);
``init_deepspeed_distributed`` sets up DeepSpeed's process group.

The distributed invariants (ranks, data, weights, collectives, shapes, loss,
clipping) are numbered in ``PlanRunner``'s docstring.  In short: ranks follow
``rank_layout``; pipeline ``p`` reads its contiguous slice of the batch; each
micro-batch carries its own loss weight in its labels, so the averaged
gradient is the global-batch mean; every replica meets the others in the same
collectives in the same order; and every rank returns the same, unrounded loss.

Import cost: torch at module level, deepspeed only inside functions.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.core.plan import Plan
from het_strategy.core.replica_layout import ReplicaLayout
from het_strategy.core.runtime_rules import (ClippingOwner, Runtime, clipping_owner, holds_own_masters, raise_first,
                                             runtime_problems)
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec
from het_strategy.ds_runtime.ds_config import deepspeed_config, rank_batches, rank_layout
from het_strategy.ds_runtime.replicas import replica_layout
from het_strategy.ds_runtime.tied_weights import tied_layout
from het_strategy.profiling.torch_device import TORCH_DTYPES

__all__ = ["init_deepspeed_distributed", "check_runnable", "PlanRunner"]

def _no_shm_op() -> None:
    """Mark DeepSpeed's CPU shared-memory allreduce op unusable so it is not JIT-built (1-2 min); gloo does it."""
    import deepspeed.ops

    compat = deepspeed.ops.__dict__.get("__compatible_ops__")
    if compat is None:
        compat = {}
        deepspeed.ops.__compatible_ops__ = compat
    compat["deepspeed_shm_comm"] = False


def init_deepspeed_distributed(timeout_s: float = 300.0) -> None:
    """``deepspeed.init_distributed`` from RANK/WORLD_SIZE/MASTER_* (gloo on CPU, the accelerator's on GPU).

    Idempotent: a second call (or one after ``torch.distributed`` was set up
    elsewhere) only wraps the existing process group.
    """
    import deepspeed
    import deepspeed.comm as ds_dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    on_cpu = accel.device_name() == "cpu"
    if on_cpu:
        _no_shm_op()
    if ds_dist.is_initialized():
        return
    backend = "gloo" if on_cpu else accel.communication_backend_name()
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                               timeout=timedelta(seconds=float(timeout_s)))


def check_runnable(plan: Plan, world_size: int | None = None, param_dtype: str | None = None) -> ReplicaLayout:
    """Refuse (``ConfigError``) a plan this runtime cannot run exactly; returns the plan's replica layout.

    The rules are the ``deepspeed`` table of ``core.runtime_rules`` (the one the
    planner's ``planner.runtime=deepspeed`` filter reads); ``world_size``, when
    given, must be the plan's device count.  Aligned plans (every replica the
    same boundaries) run on DeepSpeed's own grid; asymmetric ones on
    ``replica_engine``, and so do float64 models (``param_dtype``, as
    ``core.runtime_rules.runs_per_replica`` reads it).
    """
    raise_first(runtime_problems(plan, Runtime.deepspeed, world_size))
    return replica_layout(plan, param_dtype)


def _param_dtype(layers: Sequence[Any]) -> str | None:
    """The layers' parameters' dtype as torch names it without ``torch.`` (``"float64"``), from the first built
    layer holding a floating-point parameter; None where none does (``LayerSpec``s are built later)."""
    for layer in layers:
        if isinstance(layer, torch.nn.Module):
            first = next((q for q in layer.parameters() if q.is_floating_point()), None)
            if first is not None:
                return str(first.dtype).removeprefix("torch.")
    return None


def _holder_state(plan: Plan, param_dtype: str | None) -> str | None:
    """What the holder sets keep of a per-replica plan's optimizer state (``core.runtime_rules.holds_own_masters``):
    ``"sharded"`` at ZeRO 1, ``"whole"`` otherwise; None where DeepSpeed's optimizer keeps it."""
    if not holds_own_masters(plan, param_dtype):
        return None
    return "sharded" if plan.zero_stage == 1 else "whole"


def _times(loss: torch.Tensor, weight: Any, tokens: Any) -> torch.Tensor:
    """``loss * weight``; by tokens, ``tokens.weighted`` (a micro-batch without a counted token adds 0, not nan)."""
    return loss * weight if tokens is None else tokens.weighted(loss, weight)


class _MicroWeightedLoss:
    """``loss_fn(outputs, y) * w`` with labels ``(y, w)``: the micro-batch's own weight rides with its labels."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor], tokens: Any = None) -> None:
        self.loss_fn = loss_fn
        self.tokens = tokens
        self.__name__ = f"weighted_{getattr(loss_fn, '__name__', type(loss_fn).__name__)}"

    def __call__(self, outputs: Any, labels: tuple[Any, torch.Tensor]) -> torch.Tensor:
        y, w = labels
        return _times(self.loss_fn(outputs, y), w, self.tokens)


def _rows(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, (tuple, list)):
        return tuple(t[start:stop] for t in batch)
    return batch[start:stop]


def _num_rows(batch: Any) -> int:
    return int((batch[0] if isinstance(batch, (tuple, list)) else batch).shape[0])


def _one_input(x: Any) -> Any:
    """What the first layer is called with off a pipeline: a tuple of inputs whole, as a pipeline stage passes it (a
    one-tensor tuple as its tensor)."""
    return x[0] if isinstance(x, tuple) and len(x) == 1 else x


def _to(batch: Any, device: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return tuple(t.to(device) for t in batch)
    return batch.to(device)


class PlanRunner:
    """This rank's share of a Plan as a DeepSpeed engine.

    ``layers``: the whole model as an ordered list of ``nn.Module`` or
    ``deepspeed.pipe.LayerSpec`` (identical on every rank); ``loss_fn(outputs,
    labels)`` a mean over the micro-batch (over its counted label tokens when
    ``loss_tokens``, a ``LossTokens``, is given: each micro-batch is then weighted
    by its tokens, not its samples); ``optimizer_factory(params)`` builds
    the optimizer over this rank's parameters.  ``settings`` defaults to the
    plan's own batch, dtype and ZeRO stage.  ``ds_config_overrides`` are merged
    into the emitted ds_config last (top-level keys).

    The distributed invariants, in order:

    1. Ranks.  The world size is the plan's device count and ranks follow
       ``rank_layout``.  Aligned plans (every pipeline the same boundaries,
       ``pipeline_parts``) run on DeepSpeed's own grid, ``PipeDataParallelTopology``
       (``rank = stage * dp + pipeline``), since stage ``s`` of every replica
       allreduces the same parameters; DeepSpeed broadcasts each stage's
       parameters from data-parallel rank 0 at ``initialize``, so replicas start
       equal.  Asymmetric plans (replicas of other lengths or boundaries, plan
       order), plans with tensor-parallel stages and float64 models (the cases of
       ``core.runtime_rules.runs_per_replica``; the layers' dtype read by
       ``_param_dtype``) run each replica as its own pipeline
       (``replica_engine``): every part of every gradient is reduced over the
       ranks holding it (``holder_reduction``), every layer broadcast
       from replica 0's holder at the start, then split for each tp rank
       (``tensor_parallel``); stages of any tp pass partitioned activations
       (``stage_exchange``).  A matrix the first and the last layer share
       (tied embeddings) on two stages is a copy on each, equal at the start,
       its gradient summed between the copies after each backward
       (``tied_weights``: DeepSpeed's tied-weight groups, or one holder set).
    2. Data.  Pipeline ``p`` takes the contiguous slice ``[sum(samples[:p]),
       +samples[p])`` and cuts it into ``rank_batches(plan)[rank]
       .micro_batch_sizes``.  Its first stage (inputs) and last stage (labels)
       read the same micro-batches from their own iterators; middle stages read
       nothing.
    3. Weights.  DeepSpeed divides each micro-batch loss by the rank's own
       ``gas_r`` and averages gradients over the ``dp`` replicas with equal
       weight (the asymmetric reduction averages over replicas too).
       Micro-batch ``k`` (``m_k`` samples, mean loss ``L_k``) therefore
       travels with ``w_k = dp * gas_r * m_k / B`` (``RankBatch.micro_loss_weights``)
       inside its labels, ``(y_k, w_k)``, and the loss is ``loss_fn(out, y_k) *
       w_k``: the averaged gradient is ``(1/dp) sum_r (1/gas_r) sum_k w_k dL_k =
       (1/B) sum_i dl_i``, the global-batch mean.  A per-micro-batch weight (not
       one per rank) keeps a short last micro-batch exact.  With ``loss_tokens``
       (``L_k`` a mean over its ``t_k`` counted label tokens:
       ``strategy.loss_tokens.LossTokens``) ``m_k`` and ``B`` are ``t_k`` and the global
       batch's count ``T``, counted from the global batch every rank loads (no
       collective): ``w_k = dp * gas_r * t_k / T``, the mean over all ``T`` tokens.
    4. Collectives.  At ZeRO 0/1 DeepSpeed reduces gradients once per step, at the
       accumulation boundary, so replicas with different ``gas_r`` still meet in
       the same collectives in the same order; ZeRO 2/3 reduce on every
       micro-step, so there every replica runs the largest micro-batch count
       (``rank_batches``), and a replica with fewer samples than that count is
       refused (``core.runtime_rules``).
    5. Shapes.  The pipeline engine caches the first activation shape it sends and
       receives; a short last micro-batch would then be received into a buffer of
       the wrong size.  The module is built with ``dynamic_shape=True`` (shape
       metadata is sent with every micro-batch: one small message per transfer).
    6. Loss.  The last stage's ``train_batch`` value is ``(1/dp) sum_r (1/gas_r)
       sum_k w_k L_k = (1/B) sum_r sum_k m_k L_k``, the global-batch mean (tokens: ``t_k``, ``T``).
       DeepSpeed broadcasts it to the other stages as fp32; ``train_step``
       re-broadcasts the last stage's value in float64 so every rank returns the
       same, unrounded number.  Pure DP: ``sum_k m_k L_k`` is summed over ranks
       and divided by ``B`` (tokens: ``sum_k t_k L_k`` by ``T``).
    7. Clipping.  DeepSpeed 0.19's fp32 ZeRO-0 pipeline engine clips by stage 0's
       gradient norm only, so for that combination DeepSpeed's clipping is off
       and the engine clips by the global norm after its reduction
       (``clipping.py``); ZeRO 1 clips by the global norm itself.
    """

    def __init__(self, plan: Plan, layers: Sequence[Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                 optimizer_factory: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                 settings: TrainSettings | None = None, *, gradient_clipping: float = 0.0,
                 activation_checkpoint_interval: int = 0, ds_config_overrides: dict[str, Any] | None = None,
                 timeout_s: float = 300.0, emulated_cluster: "ClusterSpec | None" = None,
                 workload: "WorkloadSpec | None" = None, loss_tokens: Any = None, load_layers: Any = None) -> None:
        import deepspeed
        import deepspeed.comm as ds_dist

        if settings is None:
            settings = TrainSettings(global_batch_size=plan.global_batch_size, dtype=plan.dtype,
                                     zero_stage=plan.zero_stage)
        init_deepspeed_distributed(timeout_s)
        self.rank, self.world_size = ds_dist.get_rank(), ds_dist.get_world_size()
        param_dtype = _param_dtype(layers)  # float64 runs per replica (core.runtime_rules.runs_per_replica)
        self.layout = check_runnable(plan, self.world_size, param_dtype)
        if len(layers) != self.layout.num_layers:
            raise field_error("layers", f"{len(layers)} layers", f"be the plan's {self.layout.num_layers} layers "
                              "in order (its stage boundaries index this list)",
                              "plan for this model's layers (e.g. CharGPT.pipeline_layers(): blocks + 2)")
        self.layout = tied_layout(self.layout, layers)  # tied embeddings: a copy per stage, gradients summed
        self.plan = plan
        self.assignment = rank_layout(plan)[self.rank]
        self.batch = rank_batches(plan)[self.rank]
        self.loss_fn = loss_fn
        self.loss_tokens = loss_tokens
        """How the labels' counted tokens are counted (``LossTokens``); None: micro-batches weighted by samples."""
        p = self.assignment.pipeline
        self.num_stages = len(plan.pipelines[p].stages)
        self.sample_start = sum(q.samples for q in plan.pipelines[:p])
        self.reducer = None
        """The holder-set gradient reduction of an asymmetric plan (``None`` on DeepSpeed's own grid)."""
        self.sharding = None
        """ZeRO-1 within the holder sets of a per-replica plan at ZeRO 1 (``holder_sharding``), else ``None``."""

        runtime_clips = clipping_owner(plan, param_dtype) is ClippingOwner.runtime
        # on DeepSpeed's grid the runtime clips with its ClippingPipelineEngine (clipping.py), per replica with its
        # reducer or sharding (build_replica_engine)
        self.own_clipping = not self.layout.per_replica and runtime_clips and gradient_clipping > 0
        cfg = deepspeed_config(plan, settings, rank=self.rank, param_dtype=param_dtype,
                               gradient_clipping=0.0 if self.own_clipping else gradient_clipping)
        if plan.zero_stage > 0:
            cfg["zero_allow_untested_optimizer"] = True  # the caller's optimizer is a choice, not a mistake
        cfg.update(ds_config_overrides or {})
        self.ds_config = cfg
        weighted = _MicroWeightedLoss(loss_fn, loss_tokens)

        if self.layout.per_replica:
            from het_strategy.ds_runtime.replica_engine import build_replica_engine

            self.engine, self.module, self.reducer, self.sharding = build_replica_engine(
                self.layout, self.rank, layers, weighted, optimizer_factory, cfg,
                gradient_clipping=gradient_clipping if runtime_clips else 0.0,
                activation_checkpoint_interval=activation_checkpoint_interval,
                holder_state=_holder_state(plan, param_dtype),
                compute_dtype=self._rank_torch_dtype(), loss_scaling="fp16" in self._plan_dtypes(),
                load_layers=load_layers)
            self.optimizer = self.engine.optimizer
            self._emulate(emulated_cluster, workload)
            return
        parts = list(self.layout.parts[0])
        if self.num_stages > 1:
            from het_strategy.ds_runtime.ds_config import hetero_pipeline_module

            module = hetero_pipeline_module(list(layers), parts, loss_fn=weighted,
                                            activation_checkpoint_interval=activation_checkpoint_interval,
                                            dynamic_shape=True)
        else:
            from deepspeed.pipe import LayerSpec

            module = torch.nn.Sequential(*[l.build() if isinstance(l, LayerSpec) else l for l in layers])
        self.module = module
        self.optimizer = optimizer_factory([q for q in module.parameters() if q.requires_grad])
        if self.own_clipping:
            from het_strategy.ds_runtime.clipping import clipping_pipeline_engine

            self.engine = clipping_pipeline_engine(module, self.optimizer, cfg, gradient_clipping)
        else:
            self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=self.optimizer, config=cfg)
        self._emulate(emulated_cluster, workload)

    def _emulate(self, cluster: "ClusterSpec | None", workload: "WorkloadSpec | None") -> None:
        """Pad this rank's stage to its emulated device (``emulation.stage_padding``) if the cluster asks."""
        self.padding = None
        if cluster is None:
            return
        from het_strategy.emulation.speeds import cluster_is_emulated
        from het_strategy.emulation.stage_padding import StagePadding

        if not cluster_is_emulated(cluster):
            return
        if workload is None:
            raise field_error("workload", None, "be given with an emulated cluster (it prices each stage)")
        if workload.num_layers != self.layout.num_layers:
            raise field_error("workload.num_layers", workload.num_layers,
                              f"equal the plan's layer count ({self.layout.num_layers})")
        self.padding = StagePadding(cluster, self.assignment.device, workload, self.layout.layers_of(self.rank),
                                    str(self.plan.compute_dtype(self.assignment.device)),
                                    step=lambda: int(self.engine.global_steps),
                                    tp=len(self.layout.group_of(self.rank)))
        self.padding.attach(self.module)

    # -- helpers ------------------------------------------------------------------------------
    @property
    def is_pipeline(self) -> bool:
        """Run through a pipeline engine (every replica of an asymmetric plan is one, even a one-stage one)."""
        return self.num_stages > 1 or self.reducer is not None

    def _micro_batches(self, inputs: Any, labels: torch.Tensor, where: str
                       ) -> tuple[list[tuple[Any, Any, int, float]], int]:
        """This rank's ``(x_k, y_k, n_k, w_k)``, cut from the global batch (invariant 2), and the global batch's
        count ``N``: ``n_k`` and ``N`` are samples, or counted label tokens (invariant 3)."""
        B = self.plan.global_batch_size
        for name, b in (("inputs", inputs), ("labels", labels)):
            if _num_rows(b) != B:
                raise field_error(f"{where}.{name}.shape[0]", _num_rows(b),
                                  f"equal the plan's global_batch_size ({B}): every rank gets the whole batch")
        tokens = self.loss_tokens
        total = B if tokens is None else tokens.count(labels)  # every rank holds the whole batch: no collective
        scale = self.plan.num_pipelines * len(self.batch.micro_batch_sizes)  # dp * gas_r
        out, k = [], self.sample_start
        for m, w in zip(self.batch.micro_batch_sizes, self.batch.micro_loss_weights):
            x, y, n = _rows(inputs, k, k + m), labels[k:k + m], m
            if tokens is not None:
                n = tokens.count(y)
                w = scale * n / total if total else 0.0
            out.append((x, y, n, w))
            k += m
        return out, total

    def _weight(self, w: float, like: torch.Tensor) -> torch.Tensor:
        """The micro-batch's loss weight in the labels' dtype (integer labels: the layers' dtype), at least fp32
        (a bf16 weight would round; a float64 model keeps a float64 weight)."""
        if like.is_floating_point():
            return torch.tensor(w, dtype=torch.promote_types(like.dtype, torch.float32))
        params = (q for q in self.module.parameters() if q.is_floating_point())
        first = next(params, None)
        return torch.tensor(w, dtype=torch.float32 if first is None else torch.promote_types(first.dtype,
                                                                                               torch.float32))

    def _plan_dtypes(self) -> set[str]:
        """The dtypes the plan's devices compute in (several for a ``per_device`` plan)."""
        return {str(self.plan.compute_dtype(d)) for d in self.plan.used_devices}

    def _rank_torch_dtype(self) -> torch.dtype | None:
        """What this rank computes in: its device's dtype (None in a one-dtype fp32 plan: the layers' own dtype,
        fp32, or fp64 in the exactness tests)."""
        if self.plan.dtype == "fp32":
            return None
        return TORCH_DTYPES[str(self.plan.compute_dtype(self.assignment.device))]

    def _compute_inputs(self, x: Any) -> Any:
        """Floating-point inputs in this rank's compute dtype (DeepSpeed runs the layers in bf16/fp16 there)."""
        dtype = self._rank_torch_dtype()
        if dtype is None:
            return x
        if isinstance(x, (tuple, list)):
            return tuple(t.to(dtype) if t.is_floating_point() else t for t in x)
        return x.to(dtype) if x.is_floating_point() else x

    def _pipe_data(self, micro: list[tuple[Any, Any, int, float]]) -> list[tuple[Any, Any]]:
        return [(self._compute_inputs(x), (y, self._weight(w, y))) for x, y, _, w in micro]

    def _from_last_stage(self, value: torch.Tensor | None) -> float:
        """The global-batch value on every rank, in float64 (invariant 6).

        Aligned plans: DeepSpeed already averaged the last stage's value over
        replicas; it is broadcast along the pipeline.  Per-replica plans: each
        replica's last stage holds its own ``(1/gas_r) sum_k w_k L_k`` (on every
        rank of a tp group: its lead counts); the mean over replicas is a sum
        over the world of ``value / replicas``.
        """
        import deepspeed.comm as ds_dist

        eng = self.engine
        t = torch.zeros(1, dtype=torch.float64, device=eng.device)
        if eng.is_last_stage() and self.assignment.tp_rank == 0:
            t.fill_(float(value))
        if self.reducer is not None:
            t.div_(self.layout.num_replicas)
            ds_dist.all_reduce(t)
            return float(t.item())
        ds_dist.broadcast(t, src=eng.grid.stage_to_global(self.num_stages - 1),
                          group=eng.grid.get_pipe_parallel_group())
        return float(t.item())

    def _dp_mean(self, local_sum: torch.Tensor, total: int) -> float:
        """``sum over ranks of sum_k n_k L_k`` / N (pure DP: every rank is one replica; samples or tokens)."""
        import deepspeed.comm as ds_dist

        t = local_sum.detach().to(torch.float64).reshape(1).to(self.engine.device)
        ds_dist.all_reduce(t)
        return float(t.item()) / total if total else float("nan")

    # -- steps --------------------------------------------------------------------------------
    def train_step(self, inputs: Any, labels: torch.Tensor) -> float:
        """One optimizer step on the global batch; returns the global-batch mean loss (same on every rank)."""
        micro, count = self._micro_batches(inputs, labels, "train_step")
        eng = self.engine
        if self.is_pipeline:
            eng.train_batch(data_iter=iter(self._pipe_data(micro)))
            return self._from_last_stage(eng.agg_train_loss if eng.is_last_stage() else None)
        eng.train()
        total = torch.zeros((), dtype=torch.float64)
        for x, y, n, w in micro:
            x = self._compute_inputs(x)
            out = eng(_one_input(_to(x, eng.device)))
            loss = self.loss_fn(out, y.to(eng.device))
            eng.backward(_times(loss, w, self.loss_tokens))  # DeepSpeed divides by gas_r; the allreduce averages
            eng.step()              # steps the optimizer at the rank's own accumulation boundary only
            total += _times(loss.detach().double().cpu(), n, self.loss_tokens)
        return self._dp_mean(total, count)

    @torch.no_grad()
    def eval_step(self, inputs: Any, labels: torch.Tensor) -> float:
        """The global-batch mean loss without a step (``eval_batch`` for pipelines)."""
        micro, count = self._micro_batches(inputs, labels, "eval_step")
        eng = self.engine
        if self.is_pipeline:
            # eval_batch averages over its num_micro_batches (here gas_r) and over replicas: the same
            # algebra as invariant 6.  bcast_loss=False: we broadcast in float64 ourselves.
            out = eng.eval_batch(iter(self._pipe_data(micro)), num_micro_batches=len(micro), bcast_loss=False)
            return self._from_last_stage(out if eng.is_last_stage() else None)
        eng.eval()
        total = torch.zeros((), dtype=torch.float64)
        try:
            for x, y, n, _ in micro:
                x = self._compute_inputs(x)
                out = eng(_one_input(_to(x, eng.device)))
                total += _times(self.loss_fn(out, y.to(eng.device)).double().cpu(), n, self.loss_tokens)
        finally:
            eng.train()
        return self._dp_mean(total, count)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoint_dir(self, path: str | Path, replica: int | None = None) -> Path:
        """Where a replica's DeepSpeed checkpoint lives under ``path`` (this rank's replica by default).

        Aligned plans: ``path`` itself (DeepSpeed names the files by stage and
        data-parallel rank).  Per-replica plans: ``path/replica{p}``: every
        replica is its own one-replica grid, so two replicas would otherwise
        write the same file names (stage ``s``'s model and optimizer states)
        for different layers; with tensor parallelism ``path/replica{p}-tp{t}``
        for tp rank ``t`` (the ranks of a stage hold different shards under
        the same names).
        """
        if self.reducer is None:
            return Path(path)
        name = f"replica{self.assignment.pipeline if replica is None else replica}"
        if self.layout.has_tensor_parallel:
            name += f"-tp{self.assignment.tp_rank}"
        return Path(path) / name

    def save_checkpoint(self, path: str | Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank writes its share (layers, optimizer state) through DeepSpeed; collective over the world.

        With tensor parallelism each tp rank's directory must hold a model-state file per stage (DeepSpeed's
        loader counts them against the pipeline's stage count), so a rank of a stage with fewer tp ranks than
        the replica's widest stage also copies its files into the directories of the tp ranks its stage lacks
        (``replica{p}-tp{t'}`` for ``t' >= tp``, ``t' mod tp`` its own tp rank).
        """
        self.engine.save_checkpoint(str(self.checkpoint_dir(path)), tag=tag, client_state=client_state)
        if self.layout.has_tensor_parallel:
            self._fill_tp_directories(Path(path), tag)

    def barrier(self) -> None:
        """Wait until every rank of the plan gets here (DeepSpeed's process group)."""
        import deepspeed.comm as ds_dist

        ds_dist.barrier()

    def _fill_tp_directories(self, path: Path, tag: str) -> None:
        import shutil

        replica, stage = self.layout.where(self.rank)
        tp = len(self.layout.group_of(self.rank))
        widest = max(len(g) for g in self.layout.stage_groups[replica])
        mine = self.checkpoint_dir(path) / tag
        start, stop = self.layout.layers_of(self.rank)
        files = [f for f in mine.iterdir() if f.name.startswith(f"mp_rank_{stage:02d}_")
                 or any(f.name.startswith(f"layer_{layer:02d}-") for layer in range(start, stop))]
        for other in range(tp, widest):
            if other % tp == self.assignment.tp_rank:
                target = path / f"replica{replica}-tp{other}" / tag
                target.mkdir(parents=True, exist_ok=True)
                for f in files:  # copied under a temporary name, then renamed: never a half-written file
                    part = target / f".{f.name}.part"
                    shutil.copy2(f, part)
                    os.replace(part, target / f.name)
        import deepspeed.comm as ds_dist

        ds_dist.barrier()  # every directory complete before any rank goes on (and may read one)

    def load_checkpoint(self, path: str | Path, tag: str, **kwargs: Any) -> tuple[Any, Any]:
        """``engine.load_checkpoint`` from this rank's ``checkpoint_dir``: ``(load_path, client_state)``; every file
        is read as data (``checkpoint_files.read_as_data``: a file that needs more is refused, naming it)."""
        from het_strategy.ds_runtime.checkpoint_files import read_as_data

        read_as_data(self.engine)
        where = str(self.checkpoint_dir(path))
        if not (self.plan.dtype == "bf16" and self.plan.zero_stage == 0 and kwargs.get("load_optimizer_states", True)):
            return self.engine.load_checkpoint(where, tag=tag, **kwargs)
        # DeepSpeed 0.19 at ZeRO 0 hands BF16_Optimizer.load_state_dict the one state dict its state_dict() wrote,
        # where the loader indexes a list by data-parallel rank (KeyError: 0): the model is loaded by DeepSpeed,
        # the optimizer state (moments and fp32 master weights) here, as that list (every data-parallel rank's
        # state is the same at ZeRO 0)
        loaded = self.engine.load_checkpoint(where, tag=tag, **{**kwargs, "load_optimizer_states": False})
        state = self.engine.checkpoint_engine.load(self.engine._get_ckpt_name(where, tag), map_location="cpu")
        import deepspeed.comm as ds_dist

        dp_rank = ds_dist.get_rank(group=self.engine.optimizer.dp_process_group)
        # the fp32 master weights too: BF16_Optimizer keeps them apart from the bf16 ones the model loaded
        self.engine.optimizer.load_state_dict([state["optimizer"]] * (dp_rank + 1), load_optimizer_states=True,
                                              load_from_fp32_weights=True)
        return loaded

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters by their name in the full model (a stage holds its layers' names).

        Under ZeRO 3 the parameters are gathered for the copy (a collective: call it on every rank)."""
        module = self.engine.module
        if self.plan.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(module.parameters())):
                return {n: q.detach().clone() for n, q in module.named_parameters()}
        return {n: q.detach() for n, q in module.named_parameters()}
