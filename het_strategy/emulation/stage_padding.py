"""Padding one pipeline stage's forward and backward to its emulated device's time.

In a pipeline each rank runs only its stage's layers, micro-batch by
micro-batch, and the schedule interleaves forwards and backwards; a per-batch
pad (``padding.BatchPadding``) would shift all of a step's waiting to its end.
``StagePadding`` pads every micro-batch instead: its forward to ``f(m)``, its
backward to ``2 f(m)`` (the cost model's split), with hooks on the stage module
(its docstring says how), so the gradient leaves the stage on time whatever
the real backward's ratio to the forward.

Times are the cost model's (``CostModel.stage_compute_s`` of the device with
its ``emulated_speed``, at the stage's tp: the compute of its shard and the
priced tensor-parallel all-reduces, which the real ones run inside) x the scheduled slowdown / noise of the step
(``emulated_factor``), so a measured step time checks the cost model's
schedule arithmetic with compute costed exactly as it predicts.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec
from het_strategy.emulation.speeds import emulated_factor

__all__ = ["StagePadding"]


class _PadBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, padding: "StagePadding", micro: int, forward_s: float) -> torch.Tensor:
        ctx.padding, ctx.micro, ctx.forward_s = padding, micro, forward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.padding.backward_started(ctx.micro, ctx.forward_s)
        return grad, None, None, None


class StagePadding:
    """One rank's stage: ``attach(module)`` pads its forwards and backwards.

    - forward: a forward hook on the stage module sleeps until the forward has
      taken ``f(m) = stage_compute_s(m) / 3`` (the cost model's split: backward =
      2 x forward; ``m`` is the micro-batch's first dimension);
    - backward: the hook wraps the stage's output in ``_PadBackward``, an identity
      whose backward runs first in the stage's backward and notes the time; a
      multi-grad hook on the stage's trainable parameters
      (``torch.autograd.graph.register_multi_grad_hook``) runs once their
      gradients are all computed, still inside the stage's backward, and sleeps
      ``2 f(m)`` minus the real backward measured between the two, so the
      gradient leaves the stage on time whatever the real backward's ratio to the
      forward (a CPU's fp16 backward takes about 6x its forward).  A stage without
      trainable parameters sleeps at the start instead, ``2 f(m)`` minus the real
      backward expected from the real forward (``backward_ratio`` x forward).
    """

    def __init__(self, cluster: ClusterSpec, device: str, workload: WorkloadSpec, layers: tuple[int, int],
                 dtype: str = "fp32", step: Callable[[], int] | None = None, backward_ratio: float = 2.0,
                 tp: int = 1) -> None:
        self.cluster, self.device, self.layers, self.tp = cluster, device, layers, int(tp)
        self.cost = CostModel(cluster, workload, TrainSettings(global_batch_size=1, dtype=dtype,
                                                               micro_batch_sizes=(1,)))
        self.step = step or (lambda: 0)
        self.backward_ratio = float(backward_ratio)
        self.slept_s = 0.0
        """Total seconds slept so far (forward and backward)."""
        self._cache: dict[int, float] = {}
        self._t0 = 0.0
        self._measured = False
        """The attached stage has trainable parameters: its backward is padded at its end, measured."""
        self._backward: tuple[int, float] | None = None
        """(micro-batch size, start time) of the stage backward running now, when it is measured."""

    def stage_s(self, micro: int) -> float:
        """Emulated forward + backward seconds of one micro-batch of ``micro`` samples on this stage."""
        hit = self._cache.get(micro)
        if hit is None:
            start, stop = self.layers
            hit = self._cache[micro] = self.cost.stage_compute_s(self.cluster.device(self.device), self.tp, micro,
                                                                 start, stop)
        return hit * emulated_factor(self.cluster, self.device, self.step())

    def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
            self.slept_s += seconds

    def backward_started(self, micro: int, forward_s: float) -> None:
        """The stage's backward of a ``micro``-sample micro-batch begins (its forward took ``forward_s``)."""
        if self._measured:
            self._backward = (micro, time.perf_counter())
        else:
            self._sleep(self.stage_s(micro) * 2 / 3 - self.backward_ratio * forward_s)

    def _backward_done(self, grads: Any) -> None:
        """Every trainable parameter's gradient of this backward is computed: pad to the emulated backward."""
        if self._backward is None:
            return
        micro, start = self._backward
        self._backward = None
        self._sleep(self.stage_s(micro) * 2 / 3 - (time.perf_counter() - start))

    def attach(self, module: torch.nn.Module) -> list[Any]:
        """Register the hooks on the stage module; returns their handles."""

        def before(mod: Any, args: Any) -> None:
            self._t0 = time.perf_counter()

        def after(mod: Any, args: Any, output: Any) -> Any:
            first = args[0] if isinstance(args, tuple) and args else args
            if isinstance(first, (tuple, list)):
                first = first[0]
            micro = int(first.shape[0])
            real = time.perf_counter() - self._t0
            self._sleep(self.stage_s(micro) / 3 - real)
            if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
                return _PadBackward.apply(output, self, micro, real)
            return output

        handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
        params = [q for q in module.parameters() if q.requires_grad]
        self._measured = bool(params)
        if params:
            handles.append(torch.autograd.graph.register_multi_grad_hook(params, self._backward_done))
        return handles
