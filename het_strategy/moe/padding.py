"""Padding an emulated rank's expert compute, inside the MoE layer, between its two all-to-alls.

The experts of an MoE layer run between the dispatch and the combine
all-to-all, and every rank waits at the combine for the slowest rank's
experts: padding the whole batch at its end (``emulation/padding.py``) would put the
slow expert time in the wrong place.  So a HeteroMoE layer on an emulated
device pads there itself: the forward of its local experts takes at least
``tokens x seconds_per_token x factor`` and their backward ``backward_ratio``
times that (``ExpertPadding``; ``tokens`` counts the rows this rank's experts
computed).  Everything the layer does (routing, all-to-alls, waits, expert
compute) is added to a ``MoEClock``; the batch padding of the dense part
subtracts it, so dense and expert emulated times add up as on the device.

Backward is timed with ``on_backward``: an identity whose backward calls a
function first.  On a block's output it runs when the block's backward
begins; on its input, once the block's backward is over.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from het_strategy.core.errors import field_error

__all__ = ["ExpertPadding", "MoEClock", "on_backward"]


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

    def __init__(self, seconds_per_token: float, backward_ratio: float = 2.0) -> None:
        if not (isinstance(seconds_per_token, (int, float)) and seconds_per_token > 0):
            raise field_error("emulation.expert_seconds_per_token", seconds_per_token, "be > 0")
        self.seconds_per_token = float(seconds_per_token)
        self.backward_ratio = backward_ratio
        self.factor = 1.0
        """Slowdown x noise of the current step (set by the runtime per batch)."""

    def target_s(self, tokens: int, backward: bool = False) -> float:
        return tokens * self.seconds_per_token * self.factor * (self.backward_ratio if backward else 1.0)

    def pad(self, tokens: int, computed_s: float, backward: bool = False) -> None:
        remaining = self.target_s(tokens, backward) - computed_s
        if remaining > 0:
            time.sleep(remaining)


class _OnBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
        ctx.fn = fn
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.fn()
        return grad, None


def on_backward(x: torch.Tensor, fn: Callable[[], None]) -> torch.Tensor:
    """``x`` unchanged; ``fn()`` runs when the gradient w.r.t. ``x`` arrives in backward."""
    return _OnBackward.apply(x, fn)
