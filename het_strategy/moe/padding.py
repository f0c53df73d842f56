"""Padding an emulated rank's expert compute, inside the MoE layer, between its two all-to-alls.

The experts of an MoE layer run between the dispatch and the combine
all-to-all, and every rank waits at the combine for the slowest rank's
experts: padding the whole batch at its end (``emulation/padding.py``) would put the
slow expert time in the wrong place.  So a HeteroMoE layer on an emulated
device pads there itself: the forward of its local experts takes at least
``tokens x seconds_per_token x factor`` and their backward ``backward_ratio``
times that (``ExpertPadding``; ``tokens`` counts the routed token-expert pairs
this rank received).  Everything the layer does (routing, all-to-alls, waits,
expert compute) is added to ``inside_s``; the batch padding of the dense part
subtracts it, so dense and expert emulated times add up as on the device.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from het_strategy.core.errors import field_error

__all__ = ["ExpertPadding", "MoEClock", "mark_backward_start", "pad_backward_end", "time_backward"]


class MoEClock:
    """Wall time a rank spent inside its MoE layers (forward and backward) since ``reset``."""

    def __init__(self) -> None:
        self.inside_s = 0.0
        self.total_s = 0.0
        """Over every batch since the clock was made."""
        self.batches = 0
        """Batches begun (``reset`` calls)."""

    def reset(self) -> None:
        """A new batch begins."""
        self.inside_s = 0.0
        self.batches += 1

    def add(self, seconds: float) -> None:
        self.inside_s += seconds
        self.total_s += seconds


class ExpertPadding:
    """One rank's emulated expert speed for one MoE layer."""

    def __init__(self, seconds_per_token: float, clock: MoEClock | None = None, backward_ratio: float = 2.0) -> None:
        if not (isinstance(seconds_per_token, (int, float)) and seconds_per_token > 0):
            raise field_error("emulation.expert_seconds_per_token", seconds_per_token, "be > 0")
        self.seconds_per_token = float(seconds_per_token)
        self.backward_ratio = backward_ratio
        self.clock = clock or MoEClock()
        self.factor = 1.0
        """Slowdown x noise of the current step (set by the runtime per batch)."""
        self.padded_s = 0.0
        """Seconds slept since the last ``reset`` of the clock's owner (forward + backward)."""

    def target_s(self, tokens: int, backward: bool = False) -> float:
        return tokens * self.seconds_per_token * self.factor * (self.backward_ratio if backward else 1.0)

    def pad(self, tokens: int, computed_s: float, backward: bool = False) -> None:
        remaining = self.target_s(tokens, backward) - computed_s
        if remaining > 0:
            time.sleep(remaining)
            self.padded_s += remaining


class _BackwardStart(torch.autograd.Function):
    """Identity on the experts' output; its backward notes when the experts' backward begins."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, box: list[float]) -> torch.Tensor:
        ctx.box = box
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.box[0] = time.perf_counter()
        return grad, None


class _BackwardEnd(torch.autograd.Function):
    """Identity on the experts' input; its backward runs once the experts' backward is done, and pads it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[float], padding: ExpertPadding, tokens: int) -> torch.Tensor:
        ctx.box, ctx.padding, ctx.tokens = box, padding, tokens
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        ctx.padding.pad(ctx.tokens, time.perf_counter() - ctx.box[0], backward=True)
        return grad, None, None, None


def pad_backward_end(x: torch.Tensor, box: list[float], padding: ExpertPadding, tokens: int) -> torch.Tensor:
    return _BackwardEnd.apply(x, box, padding, tokens)


def mark_backward_start(y: torch.Tensor, box: list[float]) -> torch.Tensor:
    return _BackwardStart.apply(y, box)


class _TimeBackward(torch.autograd.Function):
    """Identity pair around a whole layer: adds the layer's backward wall time to a ``MoEClock``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, box: list[float], clock: MoEClock | None, start: bool) -> torch.Tensor:
        ctx.box, ctx.clock, ctx.start = box, clock, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.start:  # on the layer's output: its backward begins
            ctx.box[0] = time.perf_counter()
        elif ctx.clock is not None:  # on the layer's input: its backward is over
            ctx.clock.add(time.perf_counter() - ctx.box[0])
        return grad, None, None, None


def time_backward(x: torch.Tensor, box: list[float], clock: MoEClock, start: bool) -> torch.Tensor:
    """Identity; ``start=True`` on a layer's output, ``False`` on its input, to time the layer's backward."""
    return _TimeBackward.apply(x, box, clock, start)
