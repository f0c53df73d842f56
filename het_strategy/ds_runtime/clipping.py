"""Gradient clipping by the global norm of a pipeline, after the gradient reduction.

DeepSpeed 0.19's fp32 ZeRO-0 pipeline engine clips by the norm of stage 0's
gradients only (``clip_grad_norm_`` counts non-tensor-parallel parameters on
model-parallel rank 0 alone, and a pipeline grid's model-parallel group is the
whole pipeline).  Here each stage sums the squares of its own gradients in
float64, the sums are added over the pipeline's stages (after the reduction
every replica holds the same gradients, so one pipeline's stages cover every
layer once), and every stage scales by torch's ``clip_grad_norm_`` rule.

``clipping_pipeline_engine`` builds DeepSpeed's own ``PipelineEngine`` for an
aligned plan with that step after its ``ReduceGrads`` (``_INSTRUCTION_MAP``),
DeepSpeed's clipping off: constructed directly, as ``deepspeed.initialize``
does for a ``PipelineModule``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clip_by_global_norm", "clip_gradients", "clipping_pipeline_engine"]


@torch.no_grad()
def clip_by_global_norm(module: torch.nn.Module, max_norm: float, group: Any) -> float:
    """Clip this stage's gradients by the norm over ``group``'s stages; returns that norm (before clipping).  A tied
    copy DeepSpeed marks ``ds_pipe_replicated`` (the last stage's, ``tied_weights``) is counted on its first stage."""
    params = [q for q in module.parameters() if q.grad is not None]
    return clip_gradients([q.grad for q in params], [not getattr(q, "ds_pipe_replicated", False) for q in params],
                          max_norm, group)


@torch.no_grad()
def clip_gradients(grads: list[torch.Tensor], counted: list[bool], max_norm: float, group: Any) -> float:
    """Scale ``grads`` by torch's ``clip_grad_norm_`` rule for the norm over ``group`` of the ``counted`` ones.

    A tensor-parallel stage counts a replicated parameter on one rank only (``counted``), so every parameter
    enters the norm once; every gradient is scaled.  Returns the norm before clipping."""
    import deepspeed.comm as dist

    sq = torch.zeros(1, dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for g, c in zip(grads, counted):
        if c:
            sq += g.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    norm = float(sq.sqrt().item())
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def _engine_class() -> type:
    from deepspeed.runtime.pipe import schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    class ClippingPipelineEngine(PipelineEngine):
        """DeepSpeed's pipeline engine, clipping by the pipeline's global norm after its own reduction."""

        def __init__(self, *args: Any, max_norm: float, **kwargs: Any) -> None:
            object.__setattr__(self, "het_max_norm", float(max_norm))
            super().__init__(*args, **kwargs)

        def _exec_reduce_then_clip(self) -> None:
            PipelineEngine._exec_reduce_grads(self)
            clip_by_global_norm(self.module, self.het_max_norm, self.grid.get_pipe_parallel_group())

        _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, schedule.ReduceGrads: _exec_reduce_then_clip}

    return ClippingPipelineEngine


def clipping_pipeline_engine(module: Any, optimizer: torch.optim.Optimizer, ds_config: dict[str, Any],
                             max_norm: float) -> Any:
    """A ``ClippingPipelineEngine`` for ``module`` (a ``PipelineModule``); ``ds_config`` must not clip."""
    from deepspeed.runtime.config import DeepSpeedConfig

    if ds_config.get("gradient_clipping", 0.0):
        raise ValueError("ds_config clips already: pass gradient_clipping 0 to DeepSpeed")
    mpu = module.mpu()
    return _engine_class()(args=None, model=module, optimizer=optimizer, model_parameters=None, training_data=None,
                           lr_scheduler=None, mpu=mpu, dist_init_required=False, collate_fn=None, config=ds_config,
                           config_class=DeepSpeedConfig(ds_config, mpu), max_norm=max_norm)
