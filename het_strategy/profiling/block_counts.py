"""The counting pass of the module profiler: per segment, FLOPs, saved-for-backward bytes and output bytes.

One forward pass with gradients on, under three watchers at once:

* ``FlopCounterMode``: its running total is charged to the segment running
  when the timeline crosses a boundary, so the segments' FLOPs add up exactly
  to the whole forward's count (code between two blocks belongs to the
  earlier block);
* ``saved_tensors_hooks``: the bytes autograd keeps for backward, storages
  deduplicated, parameters and buffers counted out, a storage charged to the
  first segment that saves it;
* a ``TorchFunctionMode``: the segment where each parameter outside the blocks
  is first used (which decides the layer that holds it).

Importing this module also teaches ``FlopCounterMode`` the CPU kernels of
``scaled_dot_product_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from het_strategy.core.errors import field_error
from het_strategy.profiling.batch_contents import tensors_in
from het_strategy.profiling.segments import BlockList, Timeline, block_hooks, call_module

__all__ = ["SegmentCounts", "count_pass"]


def _register_cpu_attention_flops() -> None:
    """Count the CPU kernels of ``scaled_dot_product_attention`` as torch counts the CUDA ones.

    FlopCounterMode (torch 2.13) has formulas for the flash/efficient/cuDNN
    attention ops but not for ``_scaled_dot_product_flash_attention_for_cpu``
    and its backward, so attention scores cost 0 FLOPs on CPU (4·s²·h per
    block missing).  Same formulas: full (non-causal) attention.
    """
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if forward is not None and forward not in fc.flop_registry:
        @fc.register_flop_formula(forward)
        def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):  # type: ignore[no-untyped-def]
            return fc.sdpa_flop_count(query_shape, key_shape, value_shape)
    if backward is not None and backward not in fc.flop_registry:
        @fc.register_flop_formula(backward)
        def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args,  # type: ignore[no-untyped-def]
                               out_shape=None, **kwargs):
            return fc.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_flops()


@dataclass
class SegmentCounts:
    """Per-segment figures of one forward pass (segments: leading, blocks, trailing)."""

    flops: list[int]
    """Forward FLOPs of the whole batch."""
    saved_bytes: list[int]
    """Bytes of storages saved for backward (parameters and buffers excluded)."""
    output_bytes: list[int]
    """Bytes of the segment's output tensors."""
    first_use: dict[int, int]
    """Segment where each non-block parameter (by id) was first used."""


class _FirstUse(TorchFunctionMode):
    """Records the segment in which each watched tensor first reaches a torch function."""

    def __init__(self, watched: set[int], timeline: Timeline) -> None:
        super().__init__()
        self.watched = watched
        self.timeline = timeline
        self.first_use: dict[int, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.watched:
            for t in tensors_in((args, kwargs)):
                if id(t) in self.watched:
                    self.watched.discard(id(t))
                    self.first_use[id(t)] = self.timeline.current
        return func(*args, **kwargs)


def count_pass(module: nn.Module, batch: Any, block_list: BlockList) -> SegmentCounts:
    """One forward pass of ``module`` on ``batch``, its FLOPs and bytes charged to the segments of ``block_list``."""
    n = len(block_list)
    flops = [0] * (n + 2)
    saved = [0] * (n + 2)
    out_bytes = [0] * (n + 2)
    counter = FlopCounterMode(display=False)
    charged = [0]

    def on_leave(seg: int) -> None:
        total = counter.get_total_flops()
        flops[seg] += total - charged[0]
        charged[0] = total

    timeline = Timeline(on_leave)
    called: list[int] = []
    block_param_ids = {id(p) for _, b in block_list for p in b.parameters()}
    watcher = _FirstUse({id(p) for p in module.parameters()} - block_param_ids, timeline)
    state_ptrs = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    seen_storages: set[int] = set()
    keep_alive: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        ptr = storage.data_ptr()
        if storage.nbytes() and ptr not in state_ptrs and ptr not in seen_storages:
            seen_storages.add(ptr)
            keep_alive.append(t)  # the pointer must not be reused by a later tensor in this pass
            saved[timeline.current] += storage.nbytes()
        return t

    def pre_hook(idx: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if idx not in called:
                called.append(idx)
                if idx == 0:
                    out_bytes[0] = _nbytes((args, kwargs))
            timeline.switch(idx + 1)
        return hook

    def post_hook(idx: int) -> Callable:
        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not out_bytes[idx + 1]:
                out_bytes[idx + 1] = _nbytes(output)
            # code between two blocks belongs to the earlier one
            timeline.switch(idx + 1 if idx < n - 1 else n + 1)
        return hook

    with block_hooks(block_list, pre_hook, post_hook):
        with torch.enable_grad(), counter, watcher, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = call_module(module, batch)
            timeline.switch(n + 1)
        out_bytes[n + 1] = _nbytes(output)
        del output
    _check_block_calls(called, block_list)
    return SegmentCounts(flops=flops, saved_bytes=saved, output_bytes=out_bytes, first_use=watcher.first_use)


def _check_block_calls(called: list[int], block_list: BlockList) -> None:
    for i, (bname, _) in enumerate(block_list):
        if i not in called:
            raise field_error(f"blocks[{i}]", bname, "run during the model's forward",
                              "list only blocks the forward pass calls")
    if called != sorted(called):
        order = [block_list[i][0] for i in called]
        raise field_error("blocks", [b for b, _ in block_list], f"be listed in the order the forward runs them ({order})",
                          "pass blocks=[...] in execution order")


def _nbytes(obj: Any) -> int:
    """Bytes of the distinct tensors in ``obj``."""
    seen: set[int] = set()
    total = 0
    for t in tensors_in(obj):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
