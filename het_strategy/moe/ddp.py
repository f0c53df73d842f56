"""Expert gradients under data parallelism: out of DDP's allreduce, scaled like the dense ones.

An expert lives on one rank, and the all-to-all's backward already brings it
the gradient of every rank's tokens: summing it over ranks again would be
wrong.  ``prepare_for_ddp(module, world_size)`` (call it before wrapping in
``DistributedDataParallel``; the ``hetero`` strategy does) lists the expert
parameters in DDP's ignore list and registers a gradient hook dividing them by
``world_size``: DDP averages the dense gradients over the ranks, so the
expert gradients get the same ``1/world``, and every parameter then holds the
gradient of the mean of the ranks' losses.
"""

from __future__ import annotations

from torch import nn

from het_strategy.moe.layer import HeteroMoE

__all__ = ["moe_layers", "expert_parameter_names", "prepare_for_ddp"]


def moe_layers(module: nn.Module) -> list[HeteroMoE]:
    """The HeteroMoE layers of ``module``, in module order."""
    return [m for m in module.modules() if isinstance(m, HeteroMoE)]


def expert_parameter_names(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the expert parameters of its HeteroMoE layers."""
    return [name for name, p in module.named_parameters() if getattr(p, "het_expert", False)]


def prepare_for_ddp(module: nn.Module, world_size: int) -> list[str]:
    """Keep ``module``'s expert parameters out of DDP and scale their gradients by ``1/world_size``.

    Idempotent; returns the ignored names.
    """
    from torch.nn.parallel import DistributedDataParallel

    names = expert_parameter_names(module)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    for name, p in module.named_parameters():
        if getattr(p, "het_expert", False) and getattr(p, "_het_grad_scale", None) != world_size:
            if getattr(p, "_het_grad_hook", None) is not None:
                p._het_grad_hook.remove()
            scale = 1.0 / world_size
            p._het_grad_hook = p.register_hook(lambda g, scale=scale: g * scale)
            p._het_grad_scale = world_size
    return names
