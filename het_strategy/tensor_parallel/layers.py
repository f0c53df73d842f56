"""Megatron's column- and row-parallel linears as autograd functions over plain tensors, applied to a layer.

Why not ``torch.distributed.tensor.parallel.parallelize_module``: it turns
the parameters into ``DTensor``s, and DeepSpeed 0.19's engine and optimizers
work on plain tensors (its ``BF16_Optimizer`` flattens the parameters into one
buffer, its clipping and checkpoint code call tensor methods a ``DTensor``
routes through a device mesh DeepSpeed does not know).  Here a split linear
is replaced by a module that holds its *shard* as an ordinary
``nn.Parameter`` under the same name (``weight``, ``bias``), so DeepSpeed,
the optimizer, the gradient reduction and checkpoints see plain tensors.

The collectives over the stage's group (``group``), as in Megatron-LM:

- ``_CopyToGroup`` (Megatron's *f*): identity forward; backward all-reduces
  the input's gradient (each rank saw the same input, each contributed the
  gradient through its own shard);
- ``_ReduceFromGroup`` (*g*): forward all-reduces the partial outputs of a
  row-parallel linear; identity backward;
- ``_GatherFromGroup``: forward all-gathers a column-parallel output along the
  last dimension; backward keeps this rank's slice of the (identical)
  gradient.

So a transformer block costs 2 all-reduces forward (after the attention's
and the MLP's row-parallel linears) and 2 backward (before the q/k/v and
the first MLP linear): the count ``core.cost_model`` prices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from het_strategy.tensor_parallel.tp_plan import Colwise, ShardSpec, TensorParallelPlan, _resolve

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "parallelize_layer", "shard_of", "unit_view", "SOURCE"]

SOURCE = "tp_source"
"""Attribute of a shard's ``nn.Parameter``: the whole parameter it was cut from (an optimizer built over the whole
model, as a LightningModule's ``configure_optimizers`` builds it, is narrowed to the shards through it)."""


def _shard_parameter(full: nn.Parameter, spec: ShardSpec, tp: int, rank: int) -> nn.Parameter:
    shard = nn.Parameter(shard_of(full.detach(), spec, tp, rank).clone(), requires_grad=full.requires_grad)
    setattr(shard, SOURCE, full)
    return shard


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    import torch.distributed as dist

    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _all_reduce(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, tp: int, rank: int) -> torch.Tensor:
        import torch.distributed as dist

        ctx.width, ctx.rank = x.shape[-1], rank
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(tp)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        w, r = ctx.width, ctx.rank
        return grad[..., r * w:(r + 1) * w].contiguous(), None, None, None


def shard_of(full: torch.Tensor, spec: ShardSpec, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``full`` split ``tp`` ways along ``spec.dim``, each fused projection alone."""
    n = full.shape[spec.dim] // spec.fused
    per = n // tp
    view = full.unflatten(spec.dim, (spec.fused, n))
    return view.narrow(spec.dim + 1, rank * per, per).flatten(spec.dim, spec.dim + 1)


def unit_view(local: torch.Tensor, spec: ShardSpec, units_here: int, k: int) -> torch.Tensor:
    """Unit ``k`` of the ``units_here`` units a rank's shard ``local`` holds (a view: writes go to ``local``)."""
    n = local.shape[spec.dim] // spec.fused
    view = local.unflatten(spec.dim, (spec.fused, units_here, n // units_here))
    return view.select(spec.dim + 1, k)


class ColumnParallelLinear(nn.Module):
    """This rank's output features of a ``Linear`` (``weight``, ``bias`` are the shards)."""

    def __init__(self, full: nn.Linear, split: Colwise, group: Any, tp: int, rank: int) -> None:
        super().__init__()
        self.group, self.tp, self.rank, self.gather_output = group, tp, rank, split.gather_output
        spec = ShardSpec(0, split.fused)
        self.weight = _shard_parameter(full.weight, spec, tp, rank)
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = _shard_parameter(full.bias, spec, tp, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)
        if self.gather_output:
            y = _GatherFromGroup.apply(y, self.group, self.tp, self.rank)
        return y


class RowParallelLinear(nn.Module):
    """This rank's input features of a ``Linear``; partial outputs all-reduced, then the whole bias added."""

    def __init__(self, full: nn.Linear, group: Any, tp: int, rank: int) -> None:
        super().__init__()
        self.group = group
        self.weight = _shard_parameter(full.weight, ShardSpec(1), tp, rank)
        if full.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = full.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


def _set(layer: nn.Module, path: str, value: Any) -> None:
    parent, _, name = path.rpartition(".")
    owner = _resolve(layer, parent) if parent else layer
    if name.isdigit() and isinstance(owner, (nn.Sequential, nn.ModuleList)):
        owner[int(name)] = value
    else:
        setattr(owner, name, value)


def parallelize_layer(layer: nn.Module, plan: TensorParallelPlan, group: Any, tp: int, rank: int) -> None:
    """Replace ``layer``'s planned linears by their shards for tp rank ``rank`` of ``group`` (in place)."""
    if tp == 1:
        return
    for path, split in plan.linears.items():
        full = _resolve(layer, path)
        if isinstance(split, Colwise):
            _set(layer, path, ColumnParallelLinear(full, split, group, tp, rank))
        else:
            _set(layer, path, RowParallelLinear(full, group, tp, rank))
    for path in plan.divide:
        _set(layer, path, _resolve(layer, path) // tp)
    for name in plan.summed:
        # the reduction averages a replicated gradient over the group (each rank's is the whole one there); this
        # one is each rank's share of the sum, so it is scaled by tp first
        _resolve(layer, name).register_hook(lambda grad, tp=tp: grad * tp)
