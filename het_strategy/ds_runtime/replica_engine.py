"""Asymmetric and tensor-parallel plans on unpatched DeepSpeed: each replica its own pipeline.

DeepSpeed's ``PipelineParallelGrid`` is one rectangle of stages x replicas:
every replica the same length and boundaries, every stage one rank.  An
asymmetric plan (an A100 holding all layers beside a V100 -> V100 pipeline)
or a tensor-parallel one (one A100 at tp 1 beside two V100s at tp 2, a tp-2
stage sending to a tp-1 stage) is not.  This module runs them with subclasses
and public entry points only: ``PlanGroups`` (every process group the plan
needs), ``ReplicaGrid`` (this rank's replica as a one-replica grid),
``ReplicaPipelineModule`` (only this rank's layers) and
``ReplicaPipelineEngine`` (partitioned stage sends, the plan's holder-set
reduction); ``build_replica_engine`` puts them together for one rank.

Invariants:

- every rank creates every process group once, in one order (``new_group`` is
  collective over the whole world), and reduces per holder set in that order;
- all replicas start equal (every layer broadcast from its holder in replica 0,
  ``broadcast_from_first_replica``) and stay equal: each gradient part is
  reduced over its holders, so an inf or nan on one rank reaches every holder
  of its layer and every replica's optimizer skips the same step;
- the update is the global-batch mean (``build_replica_engine`` says why).

DeepSpeed is imported at module level: ``engine.py`` imports this module only when it builds a per-replica
engine, so ``import het_strategy.ds_runtime.engine`` stays free of DeepSpeed.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe import schedule
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

from het_strategy.ds_runtime.holder_reduction import HolderSetReducer, holder_parts, loss_scale
from het_strategy.ds_runtime.holder_sharding import HolderSetSharding
from het_strategy.core.replica_layout import ReplicaLayout
from het_strategy.ds_runtime.stage_exchange import StageLink, recv_grads, recv_tensors, send_grads, send_tensors

__all__ = ["PlanGroups", "ReplicaGrid", "ReplicaPipelineModule", "ReplicaPipelineEngine", "build_replica_engine",
           "broadcast_from_first_replica", "split_layers"]


class PlanGroups:
    """Every process group a per-replica plan needs, created once and in one order on every rank.

    ``new_group`` is collective over the whole world, so every rank creates all of
    them: one per replica (all its ranks), one singleton per rank, one per
    tensor-parallel stage group, one per holder set (``ReplicaLayout.holder_sets``).
    """

    def __init__(self, layout: ReplicaLayout, rank: int) -> None:
        import deepspeed.comm as dist

        self.pipe: Any = None
        """All ranks of this rank's replica."""
        for groups in layout.stage_groups:
            ranks = [r for g in groups for r in g]
            g = dist.new_group(ranks=ranks)
            if rank in ranks:
                self.pipe = g
        self.single: Any = None
        for r in range(layout.world_size):
            g = dist.new_group(ranks=[r])
            if r == rank:
                self.single = g
        self.tp: Any = self.single
        """This rank's stage group (tensor parallelism's collectives; the rank alone at tp 1)."""
        for groups in layout.stage_groups:
            for ranks in groups:
                if len(ranks) > 1:
                    g = dist.new_group(ranks=list(ranks))
                    if rank in ranks:
                        self.tp = g
        self.holders: dict[tuple[int, ...], Any] = {}
        for hs in layout.holder_sets:
            g = dist.new_group(ranks=list(hs))
            if rank in hs:
                self.holders[hs] = g


@torch.no_grad()
def broadcast_from_first_replica(layout: ReplicaLayout, rank: int, groups: PlanGroups,
                                 module: torch.nn.Module) -> None:
    """Every layer's whole parameters from its holder in replica 0 to every rank holding it (before any split),
    so all replicas start equal; a tied matrix from replica 0's first stage to every copy."""
    import deepspeed.comm as dist

    for hs, parts in holder_parts(layout, rank, module, {}):
        params = [part.param for part in parts]
        flat = torch.cat([q.detach().reshape(-1) for q in params])
        dist.broadcast(flat, src=hs[0], group=groups.holders[hs])
        k = 0
        for q in params:
            q.copy_(flat[k:k + q.numel()].view_as(q))
            k += q.numel()


def split_layers(layout: ReplicaLayout, rank: int, groups: PlanGroups, module: torch.nn.Module,
                 layers: Sequence[Any]) -> dict[int, dict[str, Any]]:
    """Check every layer of this rank's range against the plan's tp and split it for this tp rank.

    Returns the shard specs per layer (``{layer: {parameter name: ShardSpec}}``) the reduction reads; a
    layer runs whole (replicated) where it has no tensor-parallel plan.
    """
    from het_strategy.tensor_parallel.layers import parallelize_layer
    from het_strategy.tensor_parallel.tp_plan import check_layers, tensor_parallel_plan_of

    replica, stage = layout.where(rank)
    group = layout.group_of(rank)
    tp, tp_rank = len(group), group.index(rank)
    start, stop = layout.layers_of(rank)
    built = {int(name): child for name, child in module.named_children() if name.isdigit()}
    units = max(layout.units(layer) for layer in range(start, stop))
    check_layers([built.get(layer, layers[layer]) for layer in range(start, stop)], start, tp, units,
                 f"plan.pipelines[{replica}].stages[{stage}].tp")
    specs: dict[int, dict[str, Any]] = {}
    for layer in range(start, stop):
        child = built.get(layer)
        plan = tensor_parallel_plan_of(child) if child is not None else None
        if plan is None:
            continue
        specs[layer] = plan.shard_specs()
        parallelize_layer(child, plan, groups.tp, tp, tp_rank)
    return specs


class ReplicaGrid(PipelineParallelGrid):
    """One replica as a one-replica grid over the global ranks that run its stages.

    ``stage_to_global`` maps a stage to its lead (tp rank 0); the data-parallel
    group is the rank alone, so DeepSpeed reduces nothing across replicas by
    itself (the engine's holder-set reduction does).
    """

    def __init__(self, layout: ReplicaLayout, rank: int, groups: PlanGroups) -> None:
        # Not super().__init__(): it would create groups shaped by this replica alone, a collective
        # that ranks of other replicas would call with other shapes.  PlanGroups made them all.
        replica, stage = layout.where(rank)
        leads = list(layout.stage_ranks[replica])
        ranks = [r for g in layout.stage_groups[replica] for r in g]
        n = len(leads)
        self.global_rank, self.world_size = rank, layout.world_size
        self.replica, self._stage_ranks = replica, leads
        self._topo = PipeDataParallelTopology(num_pp=n, num_dp=1)
        self.data_parallel_size, self.pipe_parallel_size = 1, n
        self.model_parallel_size = self.slice_parallel_size = 1
        self.stage_id, self.data_parallel_id = stage, 0
        self.ds_model_proc_group, self.ds_model_world_size, self.ds_model_rank = groups.pipe, n, stage
        self.dp_group, self.dp_groups, self.dp_proc_group = [rank], [[rank]], groups.single
        self.is_first_stage, self.is_last_stage = stage == 0, stage == n - 1
        self.p2p_groups = [[r, leads[(i + 1) % n]] for i, r in enumerate(leads)]
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


class ReplicaPipelineModule(PipelineModule):
    """Only this rank's layers of a per-replica plan, on its replica's ``ReplicaGrid``.

    It builds only the layers of this rank's range, then takes the
    ``ReplicaGrid``.  ``PipelineModule.__init__`` always builds a grid from a
    topology; it is given a one-stage world topology (``3 * world + 1`` groups, the
    same on every rank: with a one-stage grid, tied-layer indexing and
    partitioning read nothing of it) and the grid is replaced before the engine
    reads it.  ``build_replica_engine`` then broadcasts every layer whole from its
    holder in replica 0 (all replicas start equal) and splits it for this rank's
    tp rank (``tensor_parallel.layers``).
    """

    def __init__(self, layers: Sequence[Any], bounds: tuple[int, int], grid: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "_het_bounds", tuple(bounds))
        world = PipeDataParallelTopology(num_pp=1, num_dp=grid.world_size)
        super().__init__(layers, topology=world, partition_method="het_replica", **kwargs)
        self._grid, self._topo = grid, grid.topology()
        self.num_stages, self.stage_id = grid.pipe_parallel_size, grid.stage_id

    het_input_dtype: torch.dtype | None = None
    """The dtype a stage computes in, when the engine builder cast it: what it receives is cast to it (a
    ``per_device`` plan's stages may compute in different dtypes)."""

    def _partition_layers(self, method: str = "het_replica") -> None:
        start, stop = self._het_bounds
        self.parts = [start, stop]
        self._set_bounds(start=start, stop=stop)

    def forward(self, forward_input: Any) -> Any:
        dtype = self.het_input_dtype
        if dtype is not None:  # differentiable: the gradient sent back is in the sender's dtype
            cast = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                    for t in ((forward_input,) if isinstance(forward_input, torch.Tensor) else forward_input)]
            forward_input = cast[0] if isinstance(forward_input, torch.Tensor) else tuple(cast)
        return super().forward(forward_input)


class _StageLinks:
    """This rank's links to the stages before and after it, and its own stage group (for the gathers)."""

    def __init__(self, layout: ReplicaLayout, rank: int, groups: PlanGroups) -> None:
        replica, stage = layout.where(rank)
        stages = layout.stage_groups[replica]
        self.prev = StageLink(stages[stage - 1], stages[stage]) if stage > 0 else None
        self.next = StageLink(stages[stage], stages[stage + 1]) if stage + 1 < len(stages) else None
        self.group = groups.tp
        self.pipe = groups.pipe
        self.lead = stages[-1][0]
        """The last stage's lead: the rank whose loss the others take."""
        self.replica_size = sum(len(g) for g in stages)


def _floating(x: Any) -> list[torch.Tensor]:
    return [t for t in ((x,) if isinstance(x, torch.Tensor) else x) if t.is_floating_point()]


class ReplicaPipelineEngine(PipelineEngine):
    """A ``PipelineEngine`` with partitioned stage sends and the plan's holder-set reduction.

    - sends activations and gradients between stages of any tp, partitioned
      (``stage_exchange``; DeepSpeed's own sends assume one rank per stage);
    - maps the schedule's ``ReduceGrads`` instruction (``_INSTRUCTION_MAP``) to
      ``HolderSetReducer``: per holder set, in the shared order, one flat
      allreduce (in fp32 at least) of this rank's parts of the gradients,
      divided by the replica count (``replicas`` says which parts: units of a
      shard, or whole replicated parameters scaled by ``1 / tp``); at ZeRO 1 to
      ``HolderSetSharding``, a reduce-scatter of the same parts into the chunk
      each holder owns;
    - on a tp > 1 last stage, the loss is broadcast from the stage's lead only.

    The gradients reduced are those the optimizer steps on: ``param.grad`` in
    fp32 and fp16 (DeepSpeed's fp16 optimizers unscale them at the step), the
    fp32 accumulation buffers of ``BF16_Optimizer`` in bf16
    (``bf16_groups[i][j]``'s gradient is ``fp32_groups_gradients[i][j]``, the
    buffer DeepSpeed's own tied-weight reduction reads too).  Then clipping by
    the global norm over one replica's ranks (replicas agree after the
    reduction; each shard counted once, each replicated parameter on its
    stage's lead only): the reducer's (``clipping.clip_gradients``) in fp32
    and whenever tp > 1, otherwise (asymmetric bf16, fp16) DeepSpeed's
    mixed-precision optimizer's, whose norm and overflow check run over the
    replica's pipeline group.  An inf or nan on one rank reaches every holder
    of its layer through the reduction, so every replica's optimizer skips the
    same step.  The engine is constructed directly, as ``deepspeed.initialize``
    does for a ``PipelineModule`` (it picks the class from the module's type).
    """

    def __init__(self, *args: Any, reducer: HolderSetReducer | HolderSetSharding, links: _StageLinks,
                 **kwargs: Any) -> None:
        object.__setattr__(self, "plan_reducer", reducer)
        object.__setattr__(self, "plan_links", links)
        # PipelineEngine.__init__ ends with a warm-up send of a 0 from each rank to stage_to_global(next),
        # one receive per rank: between stages of different tp the counts differ and a sender would block
        # forever.  Our sends need no warm-up, so during __init__ every rank is first and last stage (the
        # only use of those two tests there), and the warm-up is skipped.
        object.__setattr__(self, "_plan_constructing", True)
        super().__init__(*args, **kwargs)
        self._plan_constructing = False

    def is_first_stage(self) -> bool:
        return self._plan_constructing or super().is_first_stage()

    def is_last_stage(self) -> bool:
        return self._plan_constructing or super().is_last_stage()

    def _exec_plan_reduce_grads(self) -> None:
        self._force_grad_boundary = True
        self.plan_reducer(self.module, self.optimizer)
        self._force_grad_boundary = False

    def _exec_scaled_backward_pass(self, buffer_id: int) -> None:
        # fp16 at ZeRO 0: DeepSpeed 0.19's engine.backward scales the loss for ZeRO optimizers only, while its
        # FP16_Optimizer / FP16_UnfusedOptimizer unscale by the loss scale at the step; at ZeRO 1 the holder
        # sets' sharding keeps the scale and unscales in its reduction.  The loss is scaled here (the stages
        # before receive gradients already scaled)
        scale = (self.plan_reducer.loss_scale if isinstance(self.plan_reducer, HolderSetSharding)
                 else loss_scale(self.optimizer))
        if scale is not None and self.is_last_stage():
            self.loss = self.loss * scale
        PipelineEngine._exec_backward_pass(self, buffer_id)

    def _exec_send_activations(self, buffer_id: int) -> None:
        send_tensors(self.pipe_buffers["outputs"][buffer_id], self.plan_links.next, self.global_rank)

    def _exec_recv_activations(self, buffer_id: int) -> None:
        got = recv_tensors(self.plan_links.prev, self.global_rank, self.plan_links.group, self.device)
        for t in got:
            t.requires_grad = t.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = got[0] if len(got) == 1 else got

    def _exec_send_grads(self, buffer_id: int) -> None:
        inputs = self.pipe_buffers["inputs"][buffer_id]
        send_grads([t.grad for t in _floating(inputs)], self.plan_links.prev.reversed(), self.global_rank)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        grads = recv_grads(_floating(outputs), self.plan_links.next.reversed(), self.global_rank,
                           self.plan_links.group)
        self.grad_layer = grads[0] if isinstance(outputs, torch.Tensor) else grads

    def _aggregate_total_loss(self) -> Any:
        """The replica's loss on each of its ranks, from the last stage's lead (every tp rank of the last
        stage computes it; one broadcasts)."""
        import deepspeed.comm as dist

        links = self.plan_links
        if self.module.get_additional_losses() is not None:
            raise NotImplementedError("additional losses are not carried by per-replica plans")
        if self.global_rank == links.lead:
            loss = self._scale_loss_by_gas(self.total_loss)
            losses = torch.stack([loss.detach(), loss.detach()]).double()
        else:
            losses = torch.zeros(2, dtype=torch.float64, device=self.device)
        if links.replica_size > 1:
            dist.broadcast(tensor=losses, src=links.lead, group=links.pipe)
        self.dp_group_loss = losses[0].clone().detach()
        return losses[1].clone().detach()

    _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads: _exec_plan_reduce_grads,
                        schedule.BackwardPass: _exec_scaled_backward_pass,
                        schedule.SendActivation: _exec_send_activations,
                        schedule.RecvActivation: _exec_recv_activations,
                        schedule.SendGrad: _exec_send_grads, schedule.RecvGrad: _exec_recv_grads}


def _fp16_scaler() -> Any:
    """DeepSpeed's dynamic loss scaler with its fp16 defaults (window 1000, hysteresis 2, minimum 1) from
    ``2 ** FP16_INITIAL_SCALE_POWER``, as ``deepspeed_config`` configures DeepSpeed's own fp16 optimizers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from het_strategy.ds_runtime.ds_config import FP16_INITIAL_SCALE_POWER

    return DynamicLossScaler(init_scale=2.0 ** FP16_INITIAL_SCALE_POWER, scale_window=1000, min_scale=1,
                             delayed_shift=2, consecutive_hysteresis=False, dtype=torch.float16)


def build_replica_engine(layout: ReplicaLayout, rank: int, layers: Sequence[Any], loss_fn: Callable[..., Any],
                         optimizer_factory: Callable[..., torch.optim.Optimizer], ds_config: dict[str, Any], *,
                         gradient_clipping: float, activation_checkpoint_interval: int = 0,
                         holder_state: Literal["sharded", "whole"] | None = None,
                         compute_dtype: torch.dtype | None = None, loss_scaling: bool = False,
                         load_layers: Any = None) -> tuple[Any, Any, Any, HolderSetSharding | None]:
    """``(engine, module, reducer, sharding)`` for this rank; every rank of the world calls it once, in step.
    ``gradient_clipping``: the largest global norm the runtime's reducer or sharding clips to, 0 where it does not
    clip (off, or DeepSpeed clips: ``core.runtime_rules.clipping_owner``).
    ``holder_state``: the runtime keeps the optimizer state and master weights itself (``holder_sharding``; the
    sharding, else None), ``"sharded"`` within the holder sets (ZeRO 1) or ``"whole"`` on each holder; the
    layers then run in ``compute_dtype`` (bf16 or fp16; None: as built), cast here since DeepSpeed runs them
    plain, and the stage casts what it receives to it.  ``loss_scaling``: DeepSpeed's dynamic loss scaler (some
    rank of the plan computes in fp16).  ``load_layers``: every rank reads its layers from files (the same values
    on every replica, so nothing is broadcast from the first): ``load_layers.prepare(module)`` before the split
    (the tensors the split cuts, on the meta device), ``load_layers.load(module, tp_rank)`` after it (each shard
    read alone; ``hf.checkpoints.ShardLoad``).

    Loss weights are those of ``rank_batches`` with ``dp = replicas``: DeepSpeed
    divides each micro-batch loss by the rank's own accumulation count, the
    reducer averages over replicas, so the update is the global-batch mean.
    DeepSpeed runs at ZeRO 0 here (its ZeRO shards over a data-parallel group,
    which a replica's grid does not have); a ZeRO-1 plan shards the optimizer
    state within each holder set instead (``holder_sharding``; in bf16 and fp16
    the fp32 master weights too, DeepSpeed's bf16 / fp16 off and the layers cast
    here; fp16 with DeepSpeed's dynamic loss scaler).  A ``per_device`` plan
    (``core.runtime_rules`` rule 7) runs the same way at ZeRO 1, and at ZeRO 0
    with the masters and state whole on each holder: each rank's layers are cast
    to its device's dtype, a stage casts the activations it receives to its own
    (the gradient it sends back is in the sender's dtype), and one loss scale
    covers every backward when any rank computes in fp16.
    Layers in fp32 or fp64, DeepSpeed's bf16 / fp16 mixed precision, or bf16 /
    fp16 layers over the sharding's fp32 masters.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    groups = PlanGroups(layout, rank)
    grid = ReplicaGrid(layout, rank, groups)
    module = ReplicaPipelineModule(list(layers), layout.layers_of(rank), grid, loss_fn=loss_fn,
                             activation_checkpoint_interval=activation_checkpoint_interval, dynamic_shape=True)
    if load_layers is None:
        broadcast_from_first_replica(layout, rank, groups, module)
    else:
        load_layers.prepare(module)
    specs = split_layers(layout, rank, groups, module, layers)
    if load_layers is not None:
        load_layers.load(module, layout.group_of(rank).index(rank))
    weights = None
    if holder_state is not None and compute_dtype is not None:
        # the fp32 masters are the sharding's chunks, taken from the weights as built (not as rounded by the cast,
        # which differs between holders computing in different dtypes)
        weights = {id(q): q.detach().clone() for q in module.parameters()}
        module.to(compute_dtype)
        module.het_input_dtype = compute_dtype
    optimizer = optimizer_factory([q for q in module.parameters() if q.requires_grad])
    sharding = (HolderSetSharding(optimizer, holder_parts(layout, rank, module, specs), groups.holders,
                                  layout.num_replicas, gradient_clipping, _fp16_scaler() if loss_scaling else None,
                                  shard=holder_state == "sharded") if holder_state is not None else None)
    if sharding is not None and weights is not None:
        sharding.set_full_values(weights)
    reducer = sharding if sharding is not None else HolderSetReducer(layout, rank, groups, gradient_clipping, specs)
    mpu = module.mpu()
    engine = ReplicaPipelineEngine(args=None, model=module, optimizer=optimizer, model_parameters=None,
                             training_data=None, lr_scheduler=None, mpu=mpu, dist_init_required=False,
                             collate_fn=None, config=ds_config, config_class=DeepSpeedConfig(ds_config, mpu),
                             reducer=reducer, links=_StageLinks(layout, rank, groups))
    return engine, module, reducer, sharding
