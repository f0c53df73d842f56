"""``PerDeviceScaling``: per-device mixed precision, each rank computing in its device's fast 16-bit dtype.

``Trainer(strategy="hetero", plugins=[PerDevicePrecision()])`` (het-train: ``train.precision=per_device``)
plans with ``dtype=per_device``: a device with fast bf16 computes in bf16, one without it (V100, T4) in fp16,
and the strategy hands each rank its dtype (``use``).  ``PerDevicePrecision`` is the precision plugin, one
written-out class per Lightning package (``lightning_classes.py``), and this is what it does, on each rank:

* **forward** runs under ``torch.autocast`` in the rank's dtype; parameters, gradients and the optimizer state
  stay fp32 (master weights);
* **backward** of an fp16 rank runs on the loss times the rank's loss scale (dynamic: halved on an overflow,
  doubled after ``growth_interval`` clean steps), a bf16 rank's on the loss itself;
* **before the gradient reduction** the comm hook hands every bucket to ``prepare_bucket``: an fp16 rank divides
  it by its scale (a power of two: exact), so every rank adds unscaled fp32 gradients to one fp32 all-reduce,
  and notes whether its bucket held an inf or NaN;
* **the step**: one all-reduce (max) of those notes is the ranks' one overflow decision: on an overflow every rank
  skips the step (each fp16 rank halves its scale), otherwise every rank clips and steps on the same gradients.

The scale and its clean-step count are the plugin's ``state_dict``.  On ``hetero_deepspeed`` the plugin only
names the precision: that runtime runs each rank in its device's dtype itself (``core.runtime_rules``).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist

from het_strategy.core.dtypes import Dtype
from het_strategy.core.errors import ConfigError, field_error, require_int
from het_strategy.core.log import rank_debug
from het_strategy.profiling.torch_device import TORCH_DTYPES

__all__ = ["PerDeviceScaling", "PER_DEVICE"]

PER_DEVICE = "per_device"
"""The plugin's ``precision`` string (``Trainer.precision`` reads it; the precision table maps it)."""


class PerDeviceScaling:
    """Autocast in this rank's device dtype, fp16 loss scaling, one overflow decision (module docstring).

    Args:
        init_scale: the fp16 ranks' first loss scale (a power of two, as torch's ``GradScaler``: 2**16).
        growth_interval: clean steps after which the fp16 ranks double their scale (``GradScaler``'s 2000).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        if isinstance(init_scale, bool) or not isinstance(init_scale, (int, float)) or not init_scale > 0 \
                or not math.isfinite(init_scale) or math.log2(init_scale) != round(math.log2(init_scale)):
            raise field_error("PerDevicePrecision.init_scale", init_scale, "be a power of two > 0 (unscaling by it "
                              "is then exact)", "e.g. 65536.0")
        self.init_scale = float(init_scale)
        self.growth_interval = require_int(growth_interval, "PerDevicePrecision.growth_interval", minimum=1)
        self.dtype: Dtype | None = None
        """This rank's compute dtype, once the strategy planned (``use``); None: fp32 until then."""
        self.device: torch.device | None = None
        self.scale = 1.0
        """The loss scale of this rank: > 1 on an fp16 rank, 1 otherwise."""
        self.clean_steps = 0
        """Steps since the last overflow (or growth) on an fp16 rank."""
        self.skipped_steps = 0
        """Optimizer steps skipped on an overflow in this run."""
        self._nonfinite: torch.Tensor | None = None
        self._restored: dict[str, Any] = {}

    def use(self, dtype: Dtype | str, device: torch.device) -> None:
        """Compute in ``dtype`` (bf16, fp16 or fp32) on ``device`` from now on; an fp16 rank starts at
        ``init_scale`` unless a checkpoint set its scale."""
        dtype = Dtype(dtype)
        if dtype not in TORCH_DTYPES:
            raise field_error("plan.device_dtypes", str(dtype), f"be one of {', '.join(TORCH_DTYPES)}")
        if dtype != self.dtype:
            restored = self._restored if self._restored.get("dtype") == dtype else {}
            self.scale = float(restored.get("scale", self.init_scale if dtype == Dtype.fp16 else 1.0))
            self.clean_steps = int(restored.get("clean_steps", 0))
        self.dtype, self.device = dtype, device
        self._nonfinite = torch.zeros((), device=device)

    # -- forward and backward ---------------------------------------------------------------------
    def forward_context(self) -> ContextManager:
        if self.dtype is None or self.dtype == Dtype.fp32 or self.device is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=TORCH_DTYPES[self.dtype])

    def train_step_context(self) -> ContextManager:
        if self.dtype is None:
            raise ConfigError("PerDevicePrecision trains under strategy='hetero' only: it takes each rank's dtype "
                              "from the hetero plan (plan.device_dtypes), and this run made none")
        return self.forward_context()

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss backward runs on: times this rank's scale (fp16), else the loss itself."""
        return loss * self.scale if self.scale != 1.0 else loss

    def prepare_bucket(self, buffer: torch.Tensor) -> None:
        """Before a gradient bucket is reduced: unscale it (fp16 ranks) and note a non-finite value."""
        if self.scale != 1.0:
            buffer.mul_(1.0 / self.scale)
        if self._nonfinite is not None:
            self._nonfinite = torch.maximum(self._nonfinite, (~torch.isfinite(buffer).all()).to(self._nonfinite))

    # -- the step ------------------------------------------------------------------------------------
    def optimizer_step(self, parent: Callable[..., Any], optimizer: Any, model: Any, closure: Callable[[], Any],
                       **kwargs: Any) -> Any:
        """Run the closure (forward and backward), then, unless a rank overflowed, Lightning's own step
        (``parent``: the ``on_before_optimizer_step`` hooks, gradient clipping, ``optimizer.step``) on its result."""
        closure_result = closure()
        if self._overflow_anywhere():
            self.skipped_steps += 1
            if self.scale != 1.0:
                self.scale /= 2.0
            self.clean_steps = 0
            rank_debug(dist.get_rank() if dist.is_initialized() else 0, "per-device precision: an inf/NaN gradient "
                       "on some rank, step skipped on every rank; loss scale now %g", self.scale)
            return closure_result
        step_output = parent(optimizer, model, lambda: closure_result, **kwargs)
        if self.scale != 1.0:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0
        return step_output

    def _overflow_anywhere(self) -> bool:
        """The ranks' one overflow decision: a max all-reduce of each rank's non-finite note, which it resets."""
        flag = self._nonfinite.clone() if self._nonfinite is not None else torch.zeros(())
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self._nonfinite is not None:
            self._nonfinite.zero_()
        return bool(flag.item() > 0)

    # -- checkpoint ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"dtype": None if self.dtype is None else str(self.dtype), "scale": self.scale,
                "clean_steps": self.clean_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved scale applies to a rank computing in the saved dtype (now, or once ``use`` says so); a rank
        that now computes in another dtype (a new plan) starts its scale afresh."""
        self._restored = dict(state_dict)
        if self.dtype is not None and state_dict.get("dtype") == self.dtype:
            self.scale = float(state_dict["scale"])
            self.clean_steps = int(state_dict.get("clean_steps", 0))
