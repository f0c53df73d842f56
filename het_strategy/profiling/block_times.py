"""The timed passes of the module profiler: forward, backward and optimizer-update seconds per segment.

``time_passes`` runs ``warmup + repeats`` forward + backward passes and keeps
the median per segment.  In forward, hooks on the blocks mark the segment
boundaries; in backward, autograd hooks on each block's output (and on the
first block's input) mark where its backward starts.  Time is
``time.perf_counter``, with the device synchronised at every boundary on CUDA.
``adam_update_s`` times a ``torch.optim.Adam`` step on detached copies of a
layer's parameters (the model's own weights are not touched).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping

import torch
from torch import nn

from het_strategy.core.errors import field_error
from het_strategy.profiling.batch_contents import first_tensor, tensors_in
from het_strategy.profiling.segments import BlockList, Timeline, block_hooks, call_module
from het_strategy.profiling.torch_device import synchronizer

__all__ = ["time_passes", "adam_update_s"]


class _PassTimer:
    """The clock of one forward + backward pass: block hooks and autograd hooks mark the segment boundaries, and
    the time since the last boundary is charged to the segment that was running."""

    def __init__(self, num_blocks: int, sync: Callable[[], None]) -> None:
        self.n = num_blocks
        self.sync = sync
        self.acc: list[float] = [0.0] * (num_blocks + 2)
        """The pass's figures the clock charges now (the forward's, then the backward's)."""
        self.last = 0.0
        self.phase = "idle"
        self.bwd_seen: set[int] = set()
        """Segments whose backward has begun in this pass."""
        self.hooked: set[int] = set()
        """Segments whose backward-start hook is registered in this pass."""
        self.timeline = Timeline(self._on_leave)

    def _on_leave(self, seg: int) -> None:
        self.sync()
        now = time.perf_counter()
        self.acc[seg] += now - self.last
        self.last = now

    def _backward_event(self, seg: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if seg not in self.bwd_seen:  # the first gradient to arrive opens the segment's backward
                self.bwd_seen.add(seg)
                self.timeline.switch(seg)
        return hook

    def pre_hook(self, idx: int) -> Callable:
        """Block ``idx``'s forward pre-hook: its segment begins (and, on the first block, its input's gradient
        will mark where segment 0's backward begins)."""
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.phase != "forward":
                return  # e.g. activation checkpointing recomputing a block inside backward
            self.timeline.switch(idx + 1)
            if idx == 0 and 0 not in self.hooked:
                self.hooked.add(0)
                for t in tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(self._backward_event(0))
        return hook

    def post_hook(self, idx: int) -> Callable:
        """Block ``idx``'s forward hook: the next segment begins, and its output's gradient will mark where the
        block's backward begins."""
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self.phase != "forward":
                return
            if idx + 1 not in self.hooked:
                self.hooked.add(idx + 1)
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._backward_event(idx + 1))
            self.timeline.switch(idx + 1 if idx < self.n - 1 else self.n + 1)
        return hook

    def run(self, module: nn.Module, batch: Any, params: list[nn.Parameter]) -> tuple[list[float], list[float]]:
        """One forward + backward pass of ``module`` on ``batch`` (the hooks registered): forward and backward
        seconds per segment; the gradients are cleared after it."""
        n = self.n
        self.hooked.clear()
        self.bwd_seen.clear()
        fwd = [0.0] * (n + 2)
        bwd = [0.0] * (n + 2)
        self.acc = fwd
        self.phase = "forward"
        self.sync()
        self.last = time.perf_counter()
        self.timeline.current = 0
        loss = _loss(call_module(module, batch))
        self.timeline.switch(n + 1)
        self.acc = bwd
        self.phase = "backward"
        loss.backward()
        self.timeline.switch(n + 1)
        self.phase = "idle"
        del loss
        for p in params:
            p.grad = None
        return fwd, bwd


def time_passes(module: nn.Module, batch: Any, block_list: BlockList, device: torch.device,
                repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per segment over ``repeats`` timed passes."""
    n = len(block_list)
    timer = _PassTimer(n, synchronizer(device))
    fwd_runs: list[list[float]] = []
    bwd_runs: list[list[float]] = []
    params = list(module.parameters())
    with block_hooks(block_list, timer.pre_hook, timer.post_hook), torch.enable_grad():
        for run in range(warmup + repeats):
            fwd, bwd = timer.run(module, batch, params)
            if run >= warmup:
                fwd_runs.append(fwd)
                bwd_runs.append(bwd)
    fwd_med = [statistics.median(r[s] for r in fwd_runs) for s in range(n + 2)]
    bwd_med = [statistics.median(r[s] for r in bwd_runs) for s in range(n + 2)]
    return fwd_med, bwd_med


def adam_update_s(params: list[nn.Parameter], repeats: int, warmup: int, device: torch.device) -> float:
    """Median seconds of one Adam step on detached copies of ``params`` (0 for none)."""
    if not params:
        return 0.0
    sync = synchronizer(device)
    copies = [p.detach().clone().requires_grad_(True) for p in params]
    for c in copies:
        c.grad = torch.full_like(c, 1e-3)
    optimizer = torch.optim.Adam(copies, lr=1e-4)
    optimizer.step()  # creates the optimizer state; not timed
    times = []
    for run in range(warmup + repeats):
        sync()
        start = time.perf_counter()
        optimizer.step()
        sync()
        if run >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _loss(output: Any) -> torch.Tensor:
    """The scalar to call backward on: the output if scalar, else the float sum of the main tensor."""
    main: torch.Tensor | None
    if isinstance(output, torch.Tensor):
        main = output
    elif isinstance(output, Mapping):
        main = output["loss"] if isinstance(output.get("loss"), torch.Tensor) else first_tensor(output)
    elif isinstance(output, (tuple, list)):
        main = output[0] if output and isinstance(output[0], torch.Tensor) else first_tensor(output)
    else:
        main = None
    if main is None:
        raise field_error("module output", type(output).__name__, "hold a tensor to call backward on",
                          "return a tensor, a tuple whose first item is one, or a dict with `loss`")
    if not main.requires_grad:
        raise field_error("module output", f"a tensor of shape {tuple(main.shape)} without grad",
                          "depend on trainable parameters", "check requires_grad of the model's parameters")
    return main if main.dim() == 0 else main.float().sum()
