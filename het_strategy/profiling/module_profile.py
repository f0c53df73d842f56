"""A workload from a real ``nn.Module``: per-block FLOPs, bytes and measured times.

``profile_module(model, sample_batch)`` turns a user's own model into the two
objects the planner needs, so it can be planned like the analytic transformers
(its docstring has the steps and tuning advice); ``ProfileResult`` holds them:

* a ``WorkloadSpec`` — one ``LayerCost`` per block, with forward FLOPs counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (no hand-written formulas), the
  parameters each layer holds, the bytes autograd saves for backward and the
  bytes of the layer's output;
* a ``MeasuredProfile`` — forward, backward and optimizer-update seconds per
  layer, measured on the local device, which the cost model prefers to
  datasheet throughput for that device type.

Invariants: every parameter is in exactly one layer, and the layers' FLOPs add
up exactly to the whole forward's count (code between two blocks belongs to the
earlier block).  The model is left as it was: modes, gradients and RNG state are
restored, and the update is timed on copies of its weights.

This is a runtime module: it imports torch (the planning core does not).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from het_strategy.core.catalog import catalog_device_name
from het_strategy.core.errors import field_error, require_int
from het_strategy.core.dtypes import DTYPE_BYTES
from het_strategy.core.workload import LayerCost, MeasuredProfile, WorkloadSpec
from het_strategy.profiling.batch_contents import first_tensor
from het_strategy.profiling.block_counts import SegmentCounts, count_pass
from het_strategy.profiling.block_times import adam_update_s, time_passes
from het_strategy.profiling.segments import BlockList
from het_strategy.profiling.torch_device import DTYPE_NAMES, indexed_device

__all__ = ["ProfileResult", "profile_module"]

_LEAD_NAME = "embedding"
_TRAIL_NAME = "head"


@dataclass
class ProfileResult:
    """What ``profile_module`` measured: the workload, its times, and how layers map to the model."""

    workload: WorkloadSpec
    """One LayerCost per layer: [embedding,] block0..blockN-1 [, head]."""
    profile: MeasuredProfile
    """Measured (forward_s, backward_s, update_s) per layer at ``(device_type, 1)`` and ``micro_batch``."""
    device_type: str
    """Device type the times are filed under (a catalog name where one matched)."""
    micro_batch: int
    """Batch size of the sample batch: the micro-batch the times were measured at."""
    block_modules: tuple[str, ...]
    """Dotted module path of each block, in order (``blocks[i]`` is workload layer ``block{i}``)."""
    layer_params: tuple[tuple[str, ...], ...]
    """Parameter names each workload layer holds (every parameter in exactly one layer)."""
    update_method: str = "measured torch.optim.Adam step on copies of the layer's trainable parameters"
    """How ``update_s`` was obtained."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: the workload, the times and the layer-to-parameter map."""
        return {
            "workload": self.workload.to_dict(),
            "device_type": self.device_type,
            "micro_batch": self.micro_batch,
            "times": [list(row) for row in self.profile.layer_times(self.device_type, 1, self.micro_batch)],
            "block_modules": list(self.block_modules),
            "layer_params": [list(names) for names in self.layer_params],
            "update_method": self.update_method,
        }


def profile_module(
    module: nn.Module,
    sample_batch: Any,
    *,
    blocks: Sequence[str] | None = None,
    name: str | None = None,
    dtype: str = "fp32",
    repeats: int = 3,
    warmup: int = 1,
    device_type: str | None = None,
) -> ProfileResult:
    """Profile ``module`` on ``sample_batch``: FLOPs, parameters, bytes and times per block.

    ``sample_batch`` is what the model is called with: a tensor (``module(x)``),
    a tuple/list (``module(*args)``) or a dict (``module(**kwargs)``); its first
    tensor's dim 0 is the batch size and, when it has >= 2 dims, its dim 1 the
    sequence length.  The loss for backward is the output when it is a scalar,
    else ``.float().sum()`` of it (of ``output[0]`` for a tuple, ``output["loss"]``
    or the first tensor for a dict).  ``dtype`` labels the byte figures and must
    be the dtype the module's parameters are in.  Modes, gradients and the RNG
    state of the module are restored afterwards.

    How it works, in order:

    1. Blocks: the dotted names given, or the first ``nn.ModuleList`` /
       ``nn.Sequential`` with >= 2 children found breadth-first.  Code that runs
       before the first block (embeddings) forms layer 0 (``embedding``), code after
       the last block (final norm, head, loss) forms the last layer (``head``); each
       is left out when it holds no parameters, FLOPs or saved bytes.
    2. One counting forward pass (``block_counts.py``, which says how each figure
       is counted): a forward pre/post hook on every block marks the boundaries
       of a single timeline (``segments.py``); FLOPs, saved-for-backward bytes and
       the first use of every parameter outside the blocks are charged to the
       layer whose interval is running.  Code between two blocks belongs to the
       earlier block, so the layers' FLOPs add up exactly to the whole forward's
       count.
    3. ``warmup + repeats`` timed forward + backward passes (``block_times.py``):
       the same boundaries in forward; in backward, autograd hooks on each block's
       output (and on the first block's input) mark where its backward starts.
       ``time.perf_counter``, with ``torch.cuda.synchronize`` at every boundary on
       CUDA; the median is kept.
    4. Update time: a measured ``torch.optim.Adam`` step on detached copies of the
       layer's trainable parameters (the model's own weights are not touched).

    Tuning advice: the sample batch sets the micro-batch size of the profile; the
    cost model scales times linearly to other sizes, so profile at the micro-batch
    you expect to train with.  Use ``repeats`` >= 5 on a busy machine.
    """
    params = list(module.parameters()) if isinstance(module, nn.Module) else []
    if not params:
        raise field_error("module", type(module).__name__, "be an nn.Module with parameters",
                          "profile a model that has trainable weights")
    if dtype not in DTYPE_BYTES:
        raise field_error("dtype", dtype, f"be one of {sorted(DTYPE_BYTES)}")
    _check_module_dtype(params, dtype)
    repeats = require_int(repeats, "repeats", minimum=1)
    warmup = require_int(warmup, "warmup", minimum=0)
    batch_size, seq_len = _batch_shape(sample_batch)
    block_list = _resolve_blocks(module, blocks)
    device = params[0].device
    if device_type is None:
        device_type = _local_device_type(device)
    elif not isinstance(device_type, str) or not device_type:
        raise field_error("device_type", device_type, "be a device type name (string)")

    counts, fwd_s, bwd_s = _count_and_time(module, params, sample_batch, block_list, device, repeats, warmup)
    seg_params, seg_tensors = _segment_parameters(module, params, block_list, counts)
    segments = _kept_segments(len(block_list), seg_tensors, counts, fwd_s, bwd_s)
    layers = _layer_costs(segments, len(block_list), counts, batch_size, seg_tensors)
    rows = [(fwd_s[seg], bwd_s[seg], adam_update_s([p for p in seg_tensors[seg] if p.requires_grad], repeats, warmup,
                                                   device)) for seg in segments]
    names = [tuple(seg_params[seg]) for seg in segments]
    model_name = name if name is not None else type(module).__name__
    workload = WorkloadSpec(name=model_name, layers=tuple(layers), seq_len=seq_len, dtype=dtype)
    profile = MeasuredProfile(model=model_name, times={(device_type, 1): {batch_size: rows}})
    profile.check_matches(workload)
    return ProfileResult(workload=workload, profile=profile, device_type=device_type, micro_batch=batch_size,
                         block_modules=tuple(bname for bname, _ in block_list), layer_params=tuple(names))


def _batch_shape(sample_batch: Any) -> tuple[int, int]:
    """(batch size, sequence length) of the sample batch: its first tensor's dim 0 and, when it has >= 2 dims,
    its dim 1 (else 1)."""
    first = first_tensor(sample_batch)
    if first is None:
        raise field_error("sample_batch", type(sample_batch).__name__, "hold at least one tensor",
                          "pass a tensor, a tuple of positional arguments or a dict of keyword arguments")
    if first.dim() == 0 or first.shape[0] < 1:
        raise field_error("sample_batch", f"a tensor of shape {tuple(first.shape)}",
                          "have a batch dimension (dim 0 of its first tensor, size >= 1)")
    batch_size = int(first.shape[0])
    seq_len = int(first.shape[1]) if first.dim() >= 2 and first.shape[1] >= 1 else 1
    return batch_size, seq_len


def _count_and_time(module: nn.Module, params: list[nn.Parameter], sample_batch: Any, block_list: BlockList,
                    device: torch.device, repeats: int, warmup: int) -> tuple[SegmentCounts, list[float], list[float]]:
    """The counting pass and the timed passes, in train mode from cleared gradients under a forked RNG; the
    module's modes and gradients restored after them, however they end."""
    saved_modes = {m: m.training for m in module.modules()}
    saved_grads = {p: p.grad for p in params}
    rng_devices = [indexed_device(device).index] if device.type == "cuda" else []
    try:
        module.train()
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=rng_devices):
            counts = count_pass(module, sample_batch, block_list)
            fwd_s, bwd_s = time_passes(module, sample_batch, block_list, device, repeats, warmup)
    finally:
        for m, mode in saved_modes.items():
            m.training = mode
        for p, g in saved_grads.items():
            p.grad = g
    return counts, fwd_s, bwd_s


def _segment_parameters(module: nn.Module, params: list[nn.Parameter], block_list: BlockList,
                        counts: SegmentCounts) -> tuple[list[list[str]], list[list[nn.Parameter]]]:
    """The names and tensors of the parameters each segment holds (every parameter in exactly one)."""
    owner = _assign_params(module, block_list, counts.first_use)
    n = len(block_list)
    seg_params: list[list[str]] = [[] for _ in range(n + 2)]
    seg_tensors: list[list[nn.Parameter]] = [[] for _ in range(n + 2)]
    for pname, p in module.named_parameters():
        seg_params[owner[id(p)]].append(pname)
        seg_tensors[owner[id(p)]].append(p)
    seg_numel = [sum(p.numel() for p in ts) for ts in seg_tensors]
    if sum(seg_numel) != sum(p.numel() for p in params):  # every parameter in exactly one layer
        raise AssertionError(f"layer parameters sum to {sum(seg_numel)}, the module has "
                             f"{sum(p.numel() for p in params)}")
    return seg_params, seg_tensors


def _kept_segments(n: int, seg_tensors: list[list[nn.Parameter]], counts: SegmentCounts, fwd_s: list[float],
                   bwd_s: list[float]) -> list[int]:
    """The segments that become layers: every block, and the code before the first block and after the last
    only when something happens there (else their time goes to the neighbouring block, in place)."""
    seg_numel = [sum(p.numel() for p in ts) for ts in seg_tensors]
    keep_lead = seg_numel[0] > 0 or counts.flops[0] > 0 or counts.saved_bytes[0] > 0
    keep_trail = seg_numel[n + 1] > 0 or counts.flops[n + 1] > 0 or counts.saved_bytes[n + 1] > 0
    if not keep_lead:
        fwd_s[1] += fwd_s[0]
        bwd_s[1] += bwd_s[0]
    if not keep_trail:
        fwd_s[n] += fwd_s[n + 1]
        bwd_s[n] += bwd_s[n + 1]
    return ([0] if keep_lead else []) + list(range(1, n + 1)) + ([n + 1] if keep_trail else [])


def _layer_costs(segments: list[int], n: int, counts: SegmentCounts, batch_size: int,
                 seg_tensors: list[list[nn.Parameter]]) -> list[LayerCost]:
    """The ``LayerCost`` of each kept segment: its per-sample FLOPs and bytes, its parameter count."""
    return [LayerCost(name=_LEAD_NAME if seg == 0 else _TRAIL_NAME if seg == n + 1 else f"block{seg - 1}",
                      flops_per_sample=counts.flops[seg] / batch_size,
                      params=sum(p.numel() for p in seg_tensors[seg]),
                      activation_bytes_per_sample=counts.saved_bytes[seg] / batch_size,
                      output_bytes_per_sample=counts.output_bytes[seg] / batch_size)
            for seg in segments]


# -- blocks ----------------------------------------------------------------------------------------
def _resolve_blocks(module: nn.Module, blocks: Sequence[str] | None) -> BlockList:
    """(dotted name, module) of each block, in order; checks names, duplicates and nesting."""
    if blocks is None:
        return _find_block_list(module)
    if isinstance(blocks, str) or not isinstance(blocks, Sequence) or not blocks:
        raise field_error("blocks", blocks, "be a non-empty list of submodule names (dotted paths)",
                          "or None to detect the model's ModuleList/Sequential of blocks")
    out: list[tuple[str, nn.Module]] = []
    for i, bname in enumerate(blocks):
        if not isinstance(bname, str) or not bname:
            raise field_error(f"blocks[{i}]", bname, "be the dotted name of a submodule, e.g. `transformer.h.0`")
        try:
            sub = module.get_submodule(bname)
        except AttributeError:
            known = [n for n, _ in module.named_modules() if n][:8]
            raise field_error(f"blocks[{i}]", bname, "name a submodule of the model",
                              f"submodules include: {', '.join(known)}") from None
        out.append((bname, sub))
    for i, (bname, sub) in enumerate(out):
        for j, (other_name, other) in enumerate(out):
            if i == j:
                continue
            if other is sub:
                raise field_error(f"blocks[{j}]", other_name, f"be a different module from blocks[{i}] (`{bname}`)")
            if any(m is sub for m in other.modules()):
                raise field_error(f"blocks[{i}]", bname, f"not lie inside another block (`{other_name}`)",
                                  "list blocks that do not contain each other")
    return out


def _find_block_list(module: nn.Module) -> BlockList:
    """The children of the first ModuleList/Sequential with >= 2 children, breadth-first."""
    queue: collections.deque[tuple[str, nn.Module]] = collections.deque([("", module)])
    while queue:
        path, mod = queue.popleft()
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(list(mod.children())) >= 2:
            prefix = f"{path}." if path else ""
            return [(prefix + cname, child) for cname, child in mod.named_children()]
        for cname, child in mod.named_children():
            queue.append((f"{path}.{cname}" if path else cname, child))
    raise field_error("blocks", None, "be given: the model has no nn.ModuleList or nn.Sequential with >= 2 children",
                      "pass blocks=[...] with the dotted names of its repeated blocks")


def _assign_params(module: nn.Module, block_list: BlockList,
                   first_use: dict[int, int]) -> dict[int, int]:
    """Segment of every parameter (by id): its block; else where it was first used; else by position.

    Segments: 0 leading, 1..n blocks, n+1 trailing.  A parameter no op touched
    goes to the leading layer when registered before the first block's
    parameters, else to the trailing layer.
    """
    n = len(block_list)
    owner: dict[int, int] = {}
    for i, (_, block) in enumerate(block_list):
        for p in block.parameters():
            owner.setdefault(id(p), i + 1)
    seen_block = False
    for _, p in module.named_parameters():
        if id(p) in owner:
            seen_block = seen_block or 1 <= owner[id(p)] <= n
            continue
        owner[id(p)] = first_use.get(id(p), n + 1 if seen_block else 0)
    return owner


# -- small helpers ---------------------------------------------------------------------------------
def _local_device_type(device: torch.device) -> str:
    """``CPU`` on the CPU; a CUDA device's catalog name where one matches, else its reported name."""
    if device.type == "cpu":
        return "CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return catalog_device_name(props.name, props.total_memory / 2**30)
    return device.type.upper()


def _check_module_dtype(params: list[nn.Parameter], dtype: str) -> None:
    floating = next((p.dtype for p in params if p.is_floating_point()), None)
    actual = DTYPE_NAMES.get(floating) if floating is not None else None
    if actual is not None and actual != dtype:
        raise field_error("dtype", dtype, f"match the module's parameter dtype ({actual})",
                          f"pass dtype={actual!r}, or cast the module first, e.g. module.to(torch.bfloat16)")

