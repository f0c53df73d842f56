"""Asymmetric plans on unpatched DeepSpeed: each replica its own pipeline, each layer reduced over its holders.

DeepSpeed's ``PipelineParallelGrid`` is one rectangle of stages x replicas:
every replica the same length and boundaries.  An asymmetric plan (an A100
holding all layers beside a V100 -> V100 pipeline) is not a rectangle.  This
module runs it with subclasses and public entry points only:

- ``PlanGroups`` creates every process group the plan needs once, in one
  order on every rank (``new_group`` is collective over the whole world):
  one per replica's pipeline, one singleton per rank, one per holder set
  (``ReplicaLayout.holder_sets``).
- ``ReplicaGrid`` (a ``PipelineParallelGrid``) is this rank's replica as a
  one-replica grid over global ranks: ``stage_to_global`` maps the replica's
  stages to the ranks that run them, the data-parallel group is the rank
  alone, so DeepSpeed reduces nothing across replicas by itself.
- ``ReplicaPipelineModule`` (a ``PipelineModule``) builds only the layers of
  this rank's range, then takes the ``ReplicaGrid``.  ``PipelineModule.
  __init__`` always builds a grid from a topology; it is given a one-stage
  world topology (``3 * world + 1`` groups, the same on every rank: with a
  one-stage grid, tied-layer indexing and partitioning read nothing of it)
  and the grid is replaced before the engine reads it.
- ``ReplicaPipelineEngine`` (a ``PipelineEngine``) maps the schedule's
  ``ReduceGrads`` instruction (``_INSTRUCTION_MAP``) to ``HolderSetReducer``:
  per holder set, in the shared order, one flat allreduce (in fp32 at least)
  of this rank's layers' gradients, divided by the replica count.  The gradients are those
  the optimizer steps on: ``param.grad`` in fp32 and fp16 (DeepSpeed's fp16
  optimizers unscale them at the step), the fp32 accumulation buffers of
  ``BF16_Optimizer`` in bf16 (``bf16_groups[i][j]``'s gradient is
  ``fp32_groups_gradients[i][j]``, the buffer DeepSpeed's own tied-weight
  reduction reads too).  Then clipping by the global norm over one
  replica's stages (replicas agree after the reduction): in fp32 the
  reducer's (``clipping.clip_by_global_norm``; DeepSpeed's clipping is off in
  this config), in bf16 and fp16 DeepSpeed's mixed-precision optimizer's,
  whose norm and overflow check run over the replica's pipeline group.  An
  inf or nan on one rank reaches every holder of its layer through the
  reduction, so every replica's optimizer skips the same step.
  The engine is constructed directly, as ``deepspeed.initialize`` does for
  a ``PipelineModule`` (it picks the class from the module's type).

Loss weights are those of ``rank_batches`` with ``dp = replicas``: DeepSpeed
divides each micro-batch loss by the rank's own accumulation count, the
reducer averages over replicas, so the update is the global-batch mean.
ZeRO >= 1 is refused (no two ranks hold the same parameter set to shard
over); fp32 or fp64 layers, or DeepSpeed's bf16 / fp16 mixed precision.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from het_strategy.ds_runtime.clipping import clip_by_global_norm
from het_strategy.ds_runtime.replicas import ReplicaLayout

__all__ = ["PlanGroups", "HolderSetReducer", "build_replica_engine", "broadcast_from_first_replica"]


class PlanGroups:
    """Every process group an asymmetric plan needs, created once and in one order on every rank."""

    def __init__(self, layout: ReplicaLayout, rank: int) -> None:
        import deepspeed.comm as dist

        self.pipe: Any = None
        for ranks in layout.stage_ranks:
            g = dist.new_group(ranks=list(ranks))
            if rank in ranks:
                self.pipe = g
        self.single: Any = None
        for r in range(layout.world_size):
            g = dist.new_group(ranks=[r])
            if r == rank:
                self.single = g
        self.holders: dict[tuple[int, ...], Any] = {}
        for hs in layout.holder_sets:
            g = dist.new_group(ranks=list(hs))
            if rank in hs:
                self.holders[hs] = g


def _params_by_layer(module: torch.nn.Module) -> dict[int, list[torch.nn.Parameter]]:
    """A PipelineModule names each built layer by its global index (``"5.weight"`` is layer 5's)."""
    out: dict[int, list[torch.nn.Parameter]] = {}
    for name, q in module.named_parameters():
        if q.requires_grad:
            out.setdefault(int(name.split(".", 1)[0]), []).append(q)
    return out


def _flat_groups(layout: ReplicaLayout, rank: int, module: torch.nn.Module):
    by_layer = _params_by_layer(module)
    for hs, layers in layout.layers_by_holders(rank):
        params = [q for layer in layers for q in by_layer.get(layer, [])]
        if params:
            yield hs, params


@torch.no_grad()
def broadcast_from_first_replica(layout: ReplicaLayout, rank: int, groups: PlanGroups,
                                 module: torch.nn.Module) -> None:
    """Every layer's parameters from its holder in replica 0, so all replicas start equal."""
    import deepspeed.comm as dist

    for hs, params in _flat_groups(layout, rank, module):
        flat = torch.cat([q.detach().reshape(-1) for q in params])
        dist.broadcast(flat, src=hs[0], group=groups.holders[hs])
        k = 0
        for q in params:
            q.copy_(flat[k:k + q.numel()].view_as(q))
            k += q.numel()


class HolderSetReducer:
    """Average each layer's gradient over the ranks holding it, then clip by the global norm (fp32 plans)."""

    def __init__(self, layout: ReplicaLayout, rank: int, groups: PlanGroups, gradient_clipping: float) -> None:
        self.layout, self.rank, self.groups = layout, rank, groups
        self.gradient_clipping = float(gradient_clipping)
        """The largest global norm the reducer clips to (0: off, or DeepSpeed's optimizer clips: bf16/fp16)."""
        self.last_norm: float | None = None
        """The global gradient norm of the last step (after the reduction, before clipping; fp32 plans)."""
        self.last_reduce_s = 0.0
        """Wall seconds of the last step's reduction (waiting for the other holders included)."""
        self._buckets: list[tuple[tuple[int, ...], list[torch.nn.Parameter]]] | None = None
        """This rank's parameters per holder set, in the shared order (found on the first step: fixed after)."""

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        """Reduce this step's gradients; ``optimizer``: the engine's, when it keeps them outside ``param.grad``
        (``BF16_Optimizer``)."""
        import deepspeed.comm as dist

        t0 = time.perf_counter()
        replicas = self.layout.num_replicas
        if self._buckets is None:
            self._buckets = list(_flat_groups(self.layout, self.rank, module))
        kept = _gradient_buffers(optimizer)
        for hs, params in self._buckets:
            grads = [_gradient_of(q, kept) for q in params]
            wire = torch.promote_types(grads[0].dtype, torch.float32)  # fp16 gradients are reduced in fp32
            flat = torch.cat([g.reshape(-1).to(wire) for g in grads])
            dist.all_reduce(flat, group=self.groups.holders[hs])
            flat.div_(replicas)
            k = 0
            for g in grads:
                g.copy_(flat[k:k + g.numel()].view_as(g))
                k += g.numel()
        if self.gradient_clipping > 0:  # one replica's stages cover every layer once
            self.last_norm = clip_by_global_norm(module, self.gradient_clipping, self.groups.pipe)
        self.last_reduce_s = time.perf_counter() - t0


def _gradient_buffers(optimizer: Any) -> dict[int, torch.Tensor] | None:
    """``BF16_Optimizer``'s fp32 gradient buffer of each bf16 parameter (by id); None: gradients are ``.grad``."""
    groups = getattr(optimizer, "bf16_groups", None)
    if groups is None:
        return None
    return {id(lp): hp for lps, hps in zip(groups, optimizer.fp32_groups_gradients) for lp, hp in zip(lps, hps)}


def _gradient_of(q: torch.nn.Parameter, kept: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """The gradient the optimizer steps on for ``q`` (zeros when this step gave it none)."""
    if kept is not None:
        return kept[id(q)]
    if q.grad is None:
        q.grad = torch.zeros_like(q)
    return q.grad


def _grid_class() -> type:
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    class ReplicaGrid(PipelineParallelGrid):
        """One replica as a one-replica grid over the global ranks that run its stages."""

        def __init__(self, layout: ReplicaLayout, rank: int, groups: PlanGroups) -> None:
            # Not super().__init__(): it would create groups shaped by this replica alone, a collective
            # that ranks of other replicas would call with other shapes.  PlanGroups made them all.
            replica, stage = layout.where(rank)
            ranks = list(layout.stage_ranks[replica])
            n = len(ranks)
            self.global_rank, self.world_size = rank, layout.world_size
            self.replica, self._stage_ranks = replica, ranks
            self._topo = PipeDataParallelTopology(num_pp=n, num_dp=1)
            self.data_parallel_size, self.pipe_parallel_size = 1, n
            self.model_parallel_size = self.slice_parallel_size = 1
            self.stage_id, self.data_parallel_id = stage, 0
            self.ds_model_proc_group, self.ds_model_world_size, self.ds_model_rank = groups.pipe, n, stage
            self.dp_group, self.dp_groups, self.dp_proc_group = [rank], [[rank]], groups.single
            self.is_first_stage, self.is_last_stage = stage == 0, stage == n - 1
            self.p2p_groups = [[r, ranks[(i + 1) % n]] for i, r in enumerate(ranks)]
            self.pp_group, self.pipe_groups, self.pp_proc_group = ranks, [ranks], groups.pipe
            self.slice_group, self.slice_proc_group = [rank], groups.single

        def get_stage_id(self) -> int:
            return self.stage_id

        def get_data_parallel_id(self) -> int:
            return 0

        def stage_to_global(self, stage_id: int, **kwargs: Any) -> int:
            return self._stage_ranks[stage_id]

        def _is_grid_valid(self) -> bool:
            return True

    return ReplicaGrid


def _module_class() -> type:
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

    class ReplicaPipelineModule(PipelineModule):
        """Only this rank's layers of an asymmetric plan, on its replica's ``ReplicaGrid``."""

        def __init__(self, layers: Sequence[Any], bounds: tuple[int, int], grid: Any, **kwargs: Any) -> None:
            object.__setattr__(self, "_het_bounds", tuple(bounds))
            world = PipeDataParallelTopology(num_pp=1, num_dp=grid.world_size)
            super().__init__(layers, topology=world, partition_method="het_replica", **kwargs)
            self._grid, self._topo = grid, grid.topology()
            self.num_stages, self.stage_id = grid.pipe_parallel_size, grid.stage_id

        def _partition_layers(self, method: str = "het_replica") -> None:
            start, stop = self._het_bounds
            self.parts = [start, stop]
            self._set_bounds(start=start, stop=stop)

    return ReplicaPipelineModule


def _engine_class() -> type:
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class ReplicaPipelineEngine(PipelineEngine):
        """A ``PipelineEngine`` whose ``ReduceGrads`` is the plan's holder-set reduction."""

        def __init__(self, *args: Any, reducer: HolderSetReducer, **kwargs: Any) -> None:
            object.__setattr__(self, "plan_reducer", reducer)
            super().__init__(*args, **kwargs)

        def _exec_plan_reduce_grads(self) -> None:
            self._force_grad_boundary = True
            self.plan_reducer(self.module, self.optimizer if self.using_bf16_optimizer else None)
            self._force_grad_boundary = False

        _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads: _exec_plan_reduce_grads}

    return ReplicaPipelineEngine


def build_replica_engine(layout: ReplicaLayout, rank: int, layers: Sequence[Any], loss_fn: Callable[..., Any],
                         optimizer_factory: Callable[..., torch.optim.Optimizer], ds_config: dict[str, Any], *,
                         gradient_clipping: float, activation_checkpoint_interval: int = 0) -> tuple[Any, Any, Any]:
    """``(engine, module, reducer)`` for this rank; every rank of the world calls it once, in step."""
    from deepspeed.runtime.config import DeepSpeedConfig

    groups = PlanGroups(layout, rank)
    grid = _grid_class()(layout, rank, groups)
    module = _module_class()(list(layers), layout.layers_of(rank), grid, loss_fn=loss_fn,
                             activation_checkpoint_interval=activation_checkpoint_interval, dynamic_shape=True)
    broadcast_from_first_replica(layout, rank, groups, module)
    # in bf16/fp16 DeepSpeed's mixed-precision optimizer clips (ds_config's gradient_clipping), after the reduction
    own_clip = gradient_clipping if not (ds_config.get("bf16", {}).get("enabled") or
                                         ds_config.get("fp16", {}).get("enabled")) else 0.0
    reducer = HolderSetReducer(layout, rank, groups, own_clip)
    optimizer = optimizer_factory([q for q in module.parameters() if q.requires_grad])
    mpu = module.mpu()
    engine = _engine_class()(args=None, model=module, optimizer=optimizer, model_parameters=None,
                             training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=False,
                             collate_fn=None, config=ds_config, config_class=DeepSpeedConfig(ds_config, mpu),
                             reducer=reducer)
    return engine, module, reducer
