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


def time_passes(module: nn.Module, batch: Any, block_list: BlockList, device: torch.device,
                repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per segment over ``repeats`` timed passes."""
    n = len(block_list)
    sync = synchronizer(device)
    acc: list[list[float]] = [[0.0] * (n + 2)]
    last = [0.0]
    phase = ["idle"]
    bwd_seen: set[int] = set()

    def on_leave(seg: int) -> None:
        sync()
        now = time.perf_counter()
        acc[0][seg] += now - last[0]
        last[0] = now

    timeline = Timeline(on_leave)

    def backward_event(seg: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if seg not in bwd_seen:  # the first gradient to arrive opens the segment's backward
                bwd_seen.add(seg)
                timeline.switch(seg)
        return hook

    hooked: set[int] = set()

    def pre_hook(idx: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if phase[0] != "forward":
                return  # e.g. activation checkpointing recomputing a block inside backward
            timeline.switch(idx + 1)
            if idx == 0 and 0 not in hooked:
                hooked.add(0)
                for t in tensors_in((args, kwargs)):
                    if t.requires_grad:
                        t.register_hook(backward_event(0))
        return hook

    def post_hook(idx: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if phase[0] != "forward":
                return
            if idx + 1 not in hooked:
                hooked.add(idx + 1)
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(backward_event(idx + 1))
            timeline.switch(idx + 1 if idx < n - 1 else n + 1)
        return hook

    fwd_runs: list[list[float]] = []
    bwd_runs: list[list[float]] = []
    params = list(module.parameters())
    with block_hooks(block_list, pre_hook, post_hook), torch.enable_grad():
        for run in range(warmup + repeats):
            hooked.clear()
            bwd_seen.clear()
            fwd = [0.0] * (n + 2)
            bwd = [0.0] * (n + 2)
            acc[0] = fwd
            phase[0] = "forward"
            sync()
            last[0] = time.perf_counter()
            timeline.current = 0
            loss = _loss(call_module(module, batch))
            timeline.switch(n + 1)
            acc[0] = bwd
            phase[0] = "backward"
            loss.backward()
            timeline.switch(n + 1)
            phase[0] = "idle"
            del loss
            for p in params:
                p.grad = None
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
