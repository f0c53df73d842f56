"""The gradient reduction of a per-replica plan: each part of each gradient averaged over the ranks holding it.

``ReplicaLayout`` says who holds what (units of a shard, whole replicated
parameters); this module reduces accordingly, after every replica's last
micro-batch (the schedule's ``ReduceGrads``):

1. this rank's parts are grouped by holder set; the sets run in
   ``holder_sets`` order on every rank (the shared order: no deadlock);
2. per set, one flat allreduce in fp32 at least (fp16 gradients are summed
   in fp32) of the parts, each replicated part scaled by ``1 / tp`` of this
   rank's stage first (its ``tp`` copies in a replica count once), the sum
   divided by the replica count;
3. clipping by the global norm (``clipping.clip_gradients``) over one
   replica's ranks, which after step 2 hold every parameter's reduced
   gradient: shards counted on every rank, replicated parameters on each
   stage's lead only.

Parts are views (``tensor_parallel.layers.unit_view``) of the gradients the
optimizer steps on: ``param.grad``, or ``BF16_Optimizer``'s fp32 buffers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from het_strategy.ds_runtime.clipping import clip_gradients
from het_strategy.core.replica_layout import ReplicaLayout

__all__ = ["HolderSetReducer", "GradientPart", "holder_parts", "gradient_of", "scaled_flat", "layer_parameters",
           "loss_scale"]


def layer_parameters(module: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Parameter]]]:
    """A PipelineModule names each built layer by its global index (``"5.attn.qkv.weight"`` is layer 5's
    ``attn.qkv.weight``): layer -> [(name in the layer, parameter)] in module order."""
    out: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, q in module.named_parameters():
        if q.requires_grad:
            layer, _, local = name.partition(".")
            out.setdefault(int(layer), []).append((local, q))
    return out


class GradientPart:
    """One piece of one parameter's gradient this rank reduces: a unit of a shard, or the whole parameter."""

    __slots__ = ("param", "spec", "units_here", "unit", "scale", "counted")

    def __init__(self, param: torch.nn.Parameter, spec: Any, units_here: int, unit: int, scale: float,
                 counted: bool) -> None:
        self.param, self.spec, self.units_here, self.unit = param, spec, units_here, unit
        self.scale = scale
        """``1 / tp`` for a replicated parameter of a tp stage (its copies count once), else 1."""
        self.counted = counted
        """Counted in the global norm by this rank (shards: always; replicated parameters: on the lead)."""

    def view(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of ``tensor``: the parameter, its gradient or any tensor of its shape (or flat)."""
        if self.spec is None:
            return tensor.view(self.param.shape)
        from het_strategy.tensor_parallel.layers import unit_view

        # BF16_Optimizer's buffers are flat: seen in the parameter's shape to cut the unit out
        return unit_view(tensor.view(self.param.shape), self.spec, self.units_here, self.unit)


def holder_parts(layout: ReplicaLayout, rank: int, module: torch.nn.Module,
                 specs: dict[int, dict[str, Any]]) -> list[tuple[tuple[int, ...], list[GradientPart]]]:
    """This rank's parts per holder set, in ``holder_sets`` order (a set's parts in layer, parameter, unit order:
    the same sequence on every holder).  A tied copy is in ``tied_holders``: a rank holding the first and last
    layer holds the matrix once, under the first layer's name (``named_parameters`` lists a shared one once)."""
    group = layout.group_of(rank)
    tp, tp_rank = len(group), group.index(rank)
    by_set: dict[tuple[int, ...], list[GradientPart]] = {}
    for layer, params in sorted(layer_parameters(module).items()):
        units = layout.units(layer)
        here = units // tp
        for name, q in params:
            spec = specs.get(layer, {}).get(name)
            if spec is not None and units > 1:
                for k in range(here):
                    hs = layout.unit_holders(layer, tp_rank * here + k)
                    by_set.setdefault(hs, []).append(GradientPart(q, spec, here, k, 1.0, True))
            elif layout.is_tied(layer, name):  # a copy of the tied matrix: counted in the norm on the first stage
                by_set.setdefault(layout.tied_holders, []).append(
                    GradientPart(q, None, 1, 0, 1.0 / tp, tp_rank == 0 and layer == 0))
            else:
                by_set.setdefault(layout.layer_holders(layer), []).append(
                    GradientPart(q, None, 1, 0, 1.0 / tp, tp_rank == 0))
    return [(hs, by_set[hs]) for hs in layout.holder_sets if hs in by_set]


class HolderSetReducer:
    """Average each gradient part over the ranks holding it, then clip by the global norm (see the module)."""

    def __init__(self, layout: ReplicaLayout, rank: int, groups: Any, gradient_clipping: float,
                 specs: dict[int, dict[str, Any]] | None = None) -> None:
        self.layout, self.rank, self.groups = layout, rank, groups
        self.specs = specs or {}
        """``{layer: {parameter name: ShardSpec}}`` of this rank's split layers (``replica_engine.split_layers``)."""
        self.gradient_clipping = float(gradient_clipping)
        """The largest global norm the reducer clips to (0: off, or DeepSpeed's optimizer clips)."""
        self.last_norm: float | None = None
        """The global gradient norm of the last step (after the reduction, before clipping), when the reducer
        clips."""
        self.last_reduce_s = 0.0
        """Wall seconds of the last step's reduction (waiting for the other holders included)."""
        self._buckets: list[tuple[tuple[int, ...], list[GradientPart]]] | None = None
        """This rank's parts per holder set, in the shared order (found on the first step: fixed after)."""

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        """Reduce this step's gradients; ``optimizer``: the engine's (``BF16_Optimizer`` keeps them outside
        ``param.grad``; a ZeRO-0 fp16 optimizer's gradients carry its loss scale, which clipping allows for)."""
        import deepspeed.comm as dist

        t0 = time.perf_counter()
        replicas = self.layout.num_replicas
        if self._buckets is None:
            self._buckets = holder_parts(self.layout, self.rank, module, self.specs)
        kept = _gradient_buffers(optimizer)
        for hs, parts in self._buckets:
            views = [part.view(gradient_of(part.param, kept)) for part in parts]
            flat = scaled_flat(views, parts)
            dist.all_reduce(flat, group=self.groups.holders[hs])
            flat.div_(replicas)
            k = 0
            for v in views:
                v.copy_(flat[k:k + v.numel()].view(v.shape))
                k += v.numel()
        if self.gradient_clipping > 0:
            grads, counted = [], []
            for _, parts in self._buckets:
                for part in parts:
                    if part.spec is None or part.unit == 0:  # each parameter once (its units share the tensor)
                        grads.append(gradient_of(part.param, kept))
                        counted.append(part.counted)
            scale = loss_scale(optimizer) or 1.0  # fp16: the gradients are scaled, so is the bound
            self.last_norm = clip_gradients(grads, counted, self.gradient_clipping * scale, self.groups.pipe) / scale
        self.last_reduce_s = time.perf_counter() - t0


def scaled_flat(views: list[torch.Tensor], parts: list[GradientPart]) -> torch.Tensor:
    """The gradient ``views`` of ``parts`` as one flat vector in fp32 at least (fp16 gradients are reduced in fp32),
    each replicated part of a tp stage scaled by its ``1 / tp``."""
    wire = torch.promote_types(views[0].dtype, torch.float32)
    return torch.cat([v.reshape(-1).to(wire) * part.scale if part.scale != 1.0 else v.reshape(-1).to(wire)
                      for v, part in zip(views, parts)])


def loss_scale(optimizer: Any) -> float | None:
    """The current loss scale of DeepSpeed's ZeRO-0 fp16 optimizers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``:
    both keep ``loss_scale_config``), or None for any other optimizer."""
    config = getattr(optimizer, "loss_scale_config", None)
    if config is None or type(optimizer).__name__ not in ("FP16_Optimizer", "FP16_UnfusedOptimizer"):
        return None
    return float(config.cur_scale)


def _gradient_buffers(optimizer: Any) -> dict[int, torch.Tensor] | None:
    """``BF16_Optimizer``'s fp32 gradient buffer of each bf16 parameter (by id); None: gradients are ``.grad``."""
    groups = getattr(optimizer, "bf16_groups", None)
    if groups is None:
        return None
    return {id(lp): hp for lps, hps in zip(groups, optimizer.fp32_groups_gradients) for lp, hp in zip(lps, hps)}


def gradient_of(q: torch.nn.Parameter, kept: dict[int, torch.Tensor] | None) -> torch.Tensor:
    """The gradient the optimizer steps on for ``q`` (zeros when this step gave it none)."""
    if kept is not None:
        return kept[id(q)]
    if q.grad is None:
        q.grad = torch.zeros_like(q)
    return q.grad
