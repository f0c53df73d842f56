"""A workload from a real ``nn.Module``: per-block FLOPs, bytes and measured times.

``profile_module(model, sample_batch)`` turns a user's own model into the two
objects the planner needs, so it can be planned like the analytic transformers:

* a ``WorkloadSpec`` — one ``LayerCost`` per block, with forward FLOPs counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (no hand-written formulas), the
  parameters each layer holds, the bytes autograd saves for backward and the
  bytes of the layer's output;
* a ``MeasuredProfile`` — forward, backward and optimizer-update seconds per
  layer, measured on the local device, which the cost model prefers to
  datasheet throughput for that device type.

How it works, in order:

1. Blocks: the dotted names given, or the first ``nn.ModuleList`` /
   ``nn.Sequential`` with >= 2 children found breadth-first.  Code that runs
   before the first block (embeddings) forms layer 0 (``embedding``), code after
   the last block (final norm, head, loss) forms the last layer (``head``); each
   is left out when it holds no parameters, FLOPs or saved bytes.
2. One counting forward pass: a forward pre/post hook on every block marks the
   boundaries of a single timeline; FLOPs (running total of ``FlopCounterMode``),
   saved-for-backward bytes (``saved_tensors_hooks``; storages deduplicated,
   parameters and buffers counted out, a storage charged to the first layer that
   saves it) and the first use of every parameter outside the blocks (a
   ``TorchFunctionMode``) are charged to the layer whose interval is running.
   Code between two blocks belongs to the earlier block, so the layers' FLOPs
   add up exactly to the whole forward's count.
3. ``warmup + repeats`` timed forward + backward passes: the same boundaries in
   forward; in backward, autograd hooks on each block's output (and on the first
   block's input) mark where its backward starts.  ``time.perf_counter``, with
   ``torch.cuda.synchronize`` at every boundary on CUDA; the median is kept.
4. Update time: a measured ``torch.optim.Adam`` step on detached copies of the
   layer's trainable parameters (the model's own weights are not touched).

Tuning advice: the sample batch sets the micro-batch size of the profile; the
cost model scales times linearly to other sizes, so profile at the micro-batch
you expect to train with.  Use ``repeats`` >= 5 on a busy machine.

This is a runtime module: it imports torch (the planning core does not).
"""

from __future__ import annotations

import collections
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from het_strategy.core.errors import ConfigError, field_error, require_int
from het_strategy.core.workload import DTYPE_BYTES, LayerCost, MeasuredProfile, WorkloadSpec
from het_strategy.profiling.batch_contents import first_tensor, tensors_in

__all__ = ["ProfileResult", "profile_module", "catalog_device_name"]

_TORCH_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


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
    first = first_tensor(sample_batch)
    if first is None:
        raise field_error("sample_batch", type(sample_batch).__name__, "hold at least one tensor",
                          "pass a tensor, a tuple of positional arguments or a dict of keyword arguments")
    if first.dim() == 0 or first.shape[0] < 1:
        raise field_error("sample_batch", f"a tensor of shape {tuple(first.shape)}",
                          "have a batch dimension (dim 0 of its first tensor, size >= 1)")
    batch_size = int(first.shape[0])
    seq_len = int(first.shape[1]) if first.dim() >= 2 and first.shape[1] >= 1 else 1
    block_list = _resolve_blocks(module, blocks)
    device = params[0].device
    if device_type is None:
        device_type = _local_device_type(device)
    elif not isinstance(device_type, str) or not device_type:
        raise field_error("device_type", device_type, "be a device type name (string)")

    saved_modes = {m: m.training for m in module.modules()}
    saved_grads = {p: p.grad for p in params}
    rng_devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    try:
        module.train()
        for p in params:
            p.grad = None
        with torch.random.fork_rng(devices=rng_devices):
            counts = _count_pass(module, sample_batch, block_list)
            fwd_s, bwd_s = _time_passes(module, sample_batch, block_list, device, repeats, warmup)
    finally:
        for m, mode in saved_modes.items():
            m.training = mode
        for p, g in saved_grads.items():
            p.grad = g

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

    # Layer 0 and the last layer exist only when something happens there.
    keep_lead = seg_numel[0] > 0 or counts.flops[0] > 0 or counts.saved_bytes[0] > 0
    keep_trail = seg_numel[n + 1] > 0 or counts.flops[n + 1] > 0 or counts.saved_bytes[n + 1] > 0
    if not keep_lead:
        fwd_s[1] += fwd_s[0]
        bwd_s[1] += bwd_s[0]
    if not keep_trail:
        fwd_s[n] += fwd_s[n + 1]
        bwd_s[n] += bwd_s[n + 1]
    segments = ([0] if keep_lead else []) + list(range(1, n + 1)) + ([n + 1] if keep_trail else [])

    layers: list[LayerCost] = []
    rows: list[tuple[float, float, float]] = []
    names: list[tuple[str, ...]] = []
    for seg in segments:
        label = _LEAD_NAME if seg == 0 else _TRAIL_NAME if seg == n + 1 else f"block{seg - 1}"
        layers.append(LayerCost(
            name=label,
            flops_per_sample=counts.flops[seg] / batch_size,
            params=seg_numel[seg],
            activation_bytes_per_sample=counts.saved_bytes[seg] / batch_size,
            output_bytes_per_sample=counts.output_bytes[seg] / batch_size,
        ))
        trainable = [p for p in seg_tensors[seg] if p.requires_grad]
        rows.append((fwd_s[seg], bwd_s[seg], _adam_update_s(trainable, repeats, warmup, device)))
        names.append(tuple(seg_params[seg]))
    model_name = name if name is not None else type(module).__name__
    workload = WorkloadSpec(name=model_name, layers=tuple(layers), seq_len=seq_len, dtype=dtype)
    profile = MeasuredProfile(model=model_name, times={(device_type, 1): {batch_size: rows}})
    profile.check_matches(workload)
    return ProfileResult(workload=workload, profile=profile, device_type=device_type, micro_batch=batch_size,
                         block_modules=tuple(bname for bname, _ in block_list), layer_params=tuple(names))


def catalog_device_name(raw_name: str, memory_gb: float | None = None) -> str:
    """The catalog name of a device reported as ``raw_name`` (e.g. ``torch.cuda.get_device_name()``).

    ``"NVIDIA A100-SXM4-80GB"`` -> ``A100-80GB``, ``"NVIDIA H100 80GB HBM3"`` -> ``H100-SXM``,
    ``"NVIDIA GeForce RTX 4090"`` -> ``RTX-4090``.  Every word of the catalog name
    (memory size and form factor aside) must appear in ``raw_name``; a memory
    size in the raw name, else ``memory_gb``, picks between entries of one
    model.  An unknown device keeps its raw name.
    """
    from het_strategy.core.cluster import device_catalog, lookup_device_type

    try:
        return lookup_device_type(raw_name).name
    except ConfigError:
        pass
    words = set(_words(raw_name))
    raw_mem = next((int(w[:-2]) for w in words if re.fullmatch(r"\d+GB", w)), None)
    wanted_mem = raw_mem if raw_mem is not None else memory_gb
    candidates = []
    for entry in device_catalog().values():
        entry_words = [w for w in _words(entry.name) if not re.fullmatch(r"\d+GB|SXM\d*|PCIE", w)]
        if entry_words and all(w in words for w in entry_words):
            candidates.append(entry)
    if not candidates:
        return raw_name
    if wanted_mem is None or len(candidates) == 1:
        return candidates[0].name
    return min(candidates, key=lambda e: abs(e.memory_gb - wanted_mem)).name


# -- blocks ----------------------------------------------------------------------------------------
def _resolve_blocks(module: nn.Module, blocks: Sequence[str] | None) -> list[tuple[str, nn.Module]]:
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


def _find_block_list(module: nn.Module) -> list[tuple[str, nn.Module]]:
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


def _assign_params(module: nn.Module, block_list: list[tuple[str, nn.Module]],
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


# -- the counting pass -----------------------------------------------------------------------------
class _Timeline:
    """The layer whose interval is running; calls ``on_leave(segment)`` at every boundary."""

    def __init__(self, on_leave: Callable[[int], None]) -> None:
        self.current = 0
        self.on_leave = on_leave

    def switch(self, segment: int) -> None:
        self.on_leave(self.current)
        self.current = segment


@dataclass
class _Counts:
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

    def __init__(self, watched: set[int], timeline: _Timeline) -> None:
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


def _count_pass(module: nn.Module, batch: Any, block_list: list[tuple[str, nn.Module]]) -> _Counts:
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

    timeline = _Timeline(on_leave)
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

    handles = []
    try:
        for i, (_, block) in enumerate(block_list):
            handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post_hook(i), with_kwargs=True))
        with torch.enable_grad(), counter, watcher, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = _call(module, batch)
            timeline.switch(n + 1)
        out_bytes[n + 1] = _nbytes(output)
        del output
    finally:
        for h in handles:
            h.remove()
    _check_block_calls(called, block_list)
    return _Counts(flops=flops, saved_bytes=saved, output_bytes=out_bytes, first_use=watcher.first_use)


def _check_block_calls(called: list[int], block_list: list[tuple[str, nn.Module]]) -> None:
    for i, (bname, _) in enumerate(block_list):
        if i not in called:
            raise field_error(f"blocks[{i}]", bname, "run during the model's forward",
                              "list only blocks the forward pass calls")
    if called != sorted(called):
        order = [block_list[i][0] for i in called]
        raise field_error("blocks", [b for b, _ in block_list], f"be listed in the order the forward runs them ({order})",
                          "pass blocks=[...] in execution order")


# -- the timed passes ------------------------------------------------------------------------------
def _time_passes(module: nn.Module, batch: Any, block_list: list[tuple[str, nn.Module]], device: torch.device,
                 repeats: int, warmup: int) -> tuple[list[float], list[float]]:
    """Median forward and backward seconds per segment over ``repeats`` timed passes."""
    n = len(block_list)
    sync = _synchronizer(device)
    acc: list[list[float]] = [[0.0] * (n + 2)]
    last = [0.0]
    phase = ["idle"]
    bwd_seen: set[int] = set()

    def on_leave(seg: int) -> None:
        sync()
        now = time.perf_counter()
        acc[0][seg] += now - last[0]
        last[0] = now

    timeline = _Timeline(on_leave)

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
    handles = []
    params = list(module.parameters())
    try:
        for i, (_, block) in enumerate(block_list):
            handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post_hook(i), with_kwargs=True))
        with torch.enable_grad():
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
                loss = _loss(_call(module, batch))
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
    finally:
        for h in handles:
            h.remove()
    fwd_med = [statistics.median(r[s] for r in fwd_runs) for s in range(n + 2)]
    bwd_med = [statistics.median(r[s] for r in bwd_runs) for s in range(n + 2)]
    return fwd_med, bwd_med


def _adam_update_s(params: list[nn.Parameter], repeats: int, warmup: int, device: torch.device) -> float:
    """Median seconds of one Adam step on detached copies of ``params`` (0 for none)."""
    if not params:
        return 0.0
    sync = _synchronizer(device)
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


# -- small helpers ---------------------------------------------------------------------------------
def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _local_device_type(device: torch.device) -> str:
    """``CPU`` on the CPU; a CUDA device's catalog name where one matches, else its reported name."""
    if device.type == "cpu":
        return "CPU"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return catalog_device_name(props.name, props.total_memory / 2**30)
    return device.type.upper()


def _words(text: str) -> list[str]:
    return re.split(r"[\s\-_/()]+", text.upper().strip())


def _check_module_dtype(params: list[nn.Parameter], dtype: str) -> None:
    floating = next((p.dtype for p in params if p.is_floating_point()), None)
    actual = _TORCH_DTYPE_NAMES.get(floating) if floating is not None else None
    if actual is not None and actual != dtype:
        raise field_error("dtype", dtype, f"match the module's parameter dtype ({actual})",
                          f"pass dtype={actual!r}, or cast the module first, e.g. module.to(torch.bfloat16)")


def _nbytes(obj: Any) -> int:
    """Bytes of the distinct tensors in ``obj``."""
    seen: set[int] = set()
    total = 0
    for t in tensors_in(obj):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _call(module: nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)


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
