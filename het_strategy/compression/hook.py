"""The DDP comm hook: per-layer compression with checkpointable state.

Usage on any DDP model (CPU/gloo or CUDA/NCCL)::

    state = CompressionState(ddp_model, CompressionConfig(method="adaptive"))
    ddp_model.register_comm_hook(state, compression_hook)

or ``Trainer(strategy=HeteroStrategy(compression="adaptive"))``.

What one call does, for one gradient bucket:

1. Name each gradient by its parameter (names are stable across restarts and
   DDP's bucket rebuilds, so error-feedback buffers and choices key by them).
2. Give each a method token: ``none`` during warm-up and for small or 1-D
   tensors; afterwards the configured method, or the controller's per-layer
   choice (``adaptive``).
3. If the whole bucket is ``none``, launch one asynchronous allreduce, exactly
   what DDP does without a hook.  Otherwise add each layer's error-feedback
   residual, exchange each method's group of layers (``exchange.py``, in a
   fixed order so every rank issues the same collectives), write the means into
   the bucket and keep the new residuals.
4. On the last bucket of a step, count the step; on an ``adaptive`` measuring
   step, gather the per-layer statistics, time the link, solve the dynamic
   program (``controller.py``) on rank 0 and broadcast the choice, so every rank
   compresses every layer the same way.
"""

import math
import time
import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.config import CompressionConfig, compression_config, quantizer_for
from het_strategy.compression.controller import LayerOption, LinkModel, fit_link, predicted_exchange_s, \
    solve_layer_methods, wire_bytes
from het_strategy.compression.exchange import allreduce_mean, half_precision_mean, quantized_mean, topk_mean
from het_strategy.compression.quantize import dequantize, pack_codes, quantize, unpack_codes
from het_strategy.errors import field_error

__all__ = ["CompressionState", "compression_hook", "STATE_VERSION"]

STATE_VERSION = 1
_HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
_ORDER = ("none", "fp16", "bf16", "q8", "q7", "q6", "q5", "q4", "q3", "q2", "topk", "powersgd")
_CODEC_FACTOR = 2.0  # the hook encodes and decodes about twice what one round trip on the layer does
_CALIBRATION_ELEMENTS = (16 * 1024, 256 * 1024)  # 64 KiB and 1 MiB of fp32: latency and bandwidth


class CompressionState:
    """Everything the hook remembers between steps; checkpointed (process group dropped).

    Args:
        module: the model (the DDP wrapper or its module): names the parameters.
        config: a ``CompressionConfig``, a method name or a mapping of its fields.
        process_group: the group to exchange over; ``None``: the default group.
    """

    __slots__ = (
        # what was asked, and over which group (the group is not saved)
        "config", "process_group",
        # parameter identity in this process: id(parameter) -> name (rebuilt, not saved)
        "_names",
        # progress: optimizer steps seen; the per-layer choice and when to re-solve it
        "step", "choices", "next_solve", "interval",
        # error feedback: per-layer residual of what compression left out last time, and per quantized group
        # this rank's residual of re-quantizing its chunk of the mean (keyed by the group's layer names)
        "residuals", "chunk_residuals",
        # torch's PowerSGD state for the layers that use it (its own error feedback and warm start)
        "powersgd",
        # measurements: per-layer statistics of the measuring step, the fitted link, the log
        "_stats", "link", "decisions", "bytes_sent", "bytes_fp32",
        # bookkeeping
        "_eligible_seen", "_steps_here", "_generator", "_chunk_keys_used",
        # from the last full solve: (least codec seconds any compression needs, fp32 wire bytes, buckets, elements)
        "_profile",
    )

    def __init__(self, module: torch.nn.Module, config: Any = "adaptive",
                 process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise field_error("module", type(module).__name__,
                              "be the torch.nn.Module (or its DDP wrapper) whose gradients are exchanged")
        cfg = compression_config(config)
        if cfg is None:
            raise field_error("config", None, "be a CompressionConfig, a method name or a mapping")
        self.config: CompressionConfig = cfg
        self.process_group = process_group
        self._names = {id(p): name for name, p in module.named_parameters()}
        self.step = 0
        self.choices: dict[str, str] = {}
        self.next_solve = cfg.warmup_steps
        self.interval = cfg.resolve_every
        self.residuals: dict[str, torch.Tensor] = {}
        self.chunk_residuals: dict[str, torch.Tensor] = {}
        self.powersgd: Any = None
        self._stats: dict[str, dict[str, Any]] = {}
        self.link: LinkModel | None = None
        self.decisions: list[dict[str, Any]] = []
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self._eligible_seen = False
        self._steps_here = 0  # steps this process has exchanged (a resumed run starts at 0 with step > 0)
        self._generator = torch.Generator()
        self._generator.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
        self._chunk_keys_used: set[str] = set()
        self._profile: tuple[float, int, int, int] | None = None

    # -- what each layer gets ---------------------------------------------------------------------
    def eligible(self, grad: torch.Tensor) -> bool:
        """Small and 1-D tensors are never compressed: the saving is nil and they are often sensitive."""
        return grad.dim() >= 2 and grad.numel() >= self.config.min_numel

    def token_for(self, name: str, grad: torch.Tensor) -> str:
        if not self.eligible(grad) or self.step < self.config.warmup_steps:
            return "none"
        if self.config.method == "adaptive":
            return self.choices.get(name, "none")
        return self.config.uniform_token

    @property
    def wire_ratio(self) -> float:
        """fp32-allreduce bytes over the bytes actually sent, so far."""
        return self.bytes_fp32 / self.bytes_sent if self.bytes_sent else 1.0

    def measuring(self) -> bool:
        return self.config.method == "adaptive" and self.step >= self.next_solve

    def uncompressed_step(self) -> bool:
        """True when every layer of every bucket goes uncompressed this step and no residual is pending: the
        hook then needs no per-layer work at all (looking up a bucket's gradients and parameters costs about a
        millisecond a step on a small GPT)."""
        if self.residuals or self.measuring():
            return False
        cfg = self.config
        if cfg.method == "none" or self.step < cfg.warmup_steps:
            return True
        return cfg.method == "adaptive" and all(t == "none" for t in self.choices.values())

    def _name(self, param: torch.Tensor, bucket_index: int, position: int) -> str:
        return self._names.get(id(param), f"bucket{bucket_index}.{position}")

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        powersgd = None
        if self.powersgd is not None:
            powersgd = self.powersgd.__getstate__()  # torch's own: drops the process group
        return {"version": STATE_VERSION, "config": self.config.to_dict(), "step": self.step,
                "choices": dict(self.choices), "next_solve": self.next_solve, "interval": self.interval,
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()},
                "chunk_residuals": {k: v.detach().clone() for k, v in self.chunk_residuals.items()},
                "powersgd": powersgd,
                "link": None if self.link is None else [self.link.latency_s, self.link.bytes_per_s],
                "decisions": list(self.decisions[-1000:]), "bytes_sent": self.bytes_sent,
                "bytes_fp32": self.bytes_fp32}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise field_error("compression state.version", state.get("version"), f"be {STATE_VERSION}",
                              "the checkpoint was written by another het_strategy")
        saved = compression_config(state["config"])
        if saved != self.config:
            warnings.warn(f"resuming with compression {self.config.to_dict()} instead of the checkpoint's "
                          f"{saved.to_dict() if saved else None}; its residuals and choices are kept")
        self.step = int(state["step"])
        self.choices = dict(state["choices"])
        self.next_solve = int(state["next_solve"])
        self.interval = int(state["interval"])
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.chunk_residuals = {k: v.clone() for k, v in state.get("chunk_residuals", {}).items()}
        if state.get("powersgd") is not None:
            self._powersgd_state().__setstate__(dict(state["powersgd"]))
            self.powersgd.process_group = self.process_group
        self.link = None if state.get("link") is None else LinkModel(*state["link"])
        self.decisions = list(state.get("decisions", []))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.bytes_fp32 = int(state.get("bytes_fp32", 0))

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = compression_config(state["config"])  # type: ignore[assignment]
        self.process_group = None
        self._names = {}
        self.powersgd = None
        self._stats = {}
        self._eligible_seen = False
        self._steps_here = 0
        self._generator = torch.Generator()
        self._generator.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
        self._chunk_keys_used = set()
        self._profile = None
        self.residuals, self.chunk_residuals = {}, {}
        self.load_state_dict(state)

    def _powersgd_state(self) -> Any:
        if self.powersgd is None:
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            # start_powerSGD_iter must be > 1 with error feedback; our own warm-up decides when it runs
            self.powersgd = PowerSGDState(process_group=self.process_group,
                                          matrix_approximation_rank=self.config.rank,
                                          start_powerSGD_iter=2, min_compression_rate=1.0,
                                          use_error_feedback=self.config.error_feedback, warm_start=True)
            self.powersgd.iter = 2
        return self.powersgd


class _SubBucket:
    """A bucket of only the layers routed to PowerSGD, in the shape torch's hook expects."""

    def __init__(self, key: int, grads: list[torch.Tensor]) -> None:
        self._key = key
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views, start = [], 0
        for g in grads:
            self._views.append(self._buffer[start:start + g.numel()].view_as(g))
            start += g.numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return self._key

    def is_last(self) -> bool:
        return False  # our state counts steps; torch's stays past its warm-up

    def parameters(self) -> list[torch.Tensor]:
        return self._views

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compress each layer of the bucket as ``state`` says (module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    state.bytes_fp32 += int(2 * (world - 1) * 4 * bucket.buffer().numel() / world)
    if state._steps_here == 0 and any(state.eligible(g) for g in bucket.gradients()):
        state._eligible_seen = True
    tokens: list[str] = []
    if not state.uncompressed_step():
        grads = bucket.gradients()
        names = [state._name(p, bucket.index(), i) for i, p in enumerate(bucket.parameters())]
        if state.measuring():
            _measure(state, names, grads, bucket.index())
        tokens = [state.token_for(n, g) for n, g in zip(names, grads)]
        if all(t == "none" for t in tokens) and not any(n in state.residuals for n in names):
            tokens = []
    if not tokens:
        # the common fast path: one asynchronous allreduce of the whole bucket, like DDP's default
        buffer = bucket.buffer()
        buffer.div_(world)
        state.bytes_sent += int(2 * (world - 1) * 4 * buffer.numel() / world)
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        result = fut.then(lambda f: f.value()[0])
    else:
        _exchange_mixed(state, names, grads, tokens, group)
        result = torch.futures.Future()
        result.set_result(bucket.buffer())

    if bucket.is_last():
        _end_step(state, group, world, bucket.buffer().device)
    return result


def _exchange_mixed(state: CompressionState, names: list[str], grads: list[torch.Tensor], tokens: list[str],
                    group: dist.ProcessGroup) -> None:
    """Exchange each method's layers of this bucket, in the fixed ``_ORDER`` (same collectives on every rank)."""
    cfg = state.config
    inputs: list[torch.Tensor] = []
    for name, grad in zip(names, grads):
        flat = grad.reshape(-1).to(torch.float32)
        residual = state.residuals.pop(name, None)
        inputs.append(flat + residual if residual is not None else flat)
    by_token: dict[str, list[int]] = {}
    for i, token in enumerate(tokens):
        by_token.setdefault(token, []).append(i)
    for token in sorted(by_token, key=_ORDER.index):
        # by name, not bucket position: DDP's bucket rebuild after the first step reorders a bucket, and a
        # resumed run starts before it; the group's layout (and its saved residuals) must not depend on that
        members = sorted(by_token[token], key=names.__getitem__)
        if token == "powersgd":
            _powersgd_exchange(state, [names[i] for i in members], [grads[i] for i in members],
                               [inputs[i] for i in members])
            continue
        if token == "topk":
            means, delivered, sent = topk_mean([inputs[i] for i in members], cfg.topk_ratio, group)
            for i, mean, got in zip(members, means, delivered):
                grads[i].copy_(mean.view_as(grads[i]))
                if cfg.error_feedback:
                    state.residuals[names[i]] = inputs[i] - got
            state.bytes_sent += sent
            continue
        flat = torch.cat([inputs[i] for i in members])
        if token == "none":
            out = allreduce_mean(flat, group)
        elif token in _HALF:
            out = half_precision_mean(flat, _HALF[token], group)
        else:
            key = f"{token}:" + "|".join(names[i] for i in members)
            out = quantized_mean(flat, quantizer_for(token, cfg), group, state._generator,
                                 state.chunk_residuals.pop(key, None))
            if cfg.error_feedback and out.chunk_residual is not None:
                state.chunk_residuals[key] = out.chunk_residual
                state._chunk_keys_used.add(key)
        state.bytes_sent += out.bytes_sent
        start = 0
        for i in members:
            n = inputs[i].numel()
            grads[i].copy_(out.mean[start:start + n].view_as(grads[i]))
            if token.startswith("q") and cfg.error_feedback:
                state.residuals[names[i]] = inputs[i] - out.delivered[start:start + n]
            start += n


def _powersgd_exchange(state: CompressionState, names: list[str], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor]) -> None:
    """torch's ``powerSGD_hook`` on a bucket of only these layers (its state keyed by their names)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    psgd = state._powersgd_state()
    key = zlib.crc32("|".join(names).encode())
    sub = _SubBucket(key, [x.view_as(g) for x, g in zip(inputs, grads)])
    world = (state.process_group or dist.group.WORLD).size()
    # wait here: torch's hook launches its later allreduces from callbacks (see exchange.py on ordering)
    mean = powerSGD_hook(psgd, sub).wait()
    start = 0
    for grad in grads:
        grad.copy_(mean[start:start + grad.numel()].view_as(grad))
        start += grad.numel()
        state.bytes_sent += wire_bytes("powersgd", list(grad.shape), world, state.config)


# -- the adaptive controller's measuring step -------------------------------------------------------

def _measure(state: CompressionState, names: list[str], grads: list[torch.Tensor], bucket_index: int) -> None:
    """Record, per eligible layer and candidate, the error it would add and its codec time (this rank)."""
    cfg = state.config
    tokens = list(dict.fromkeys([*cfg.candidates, f"q{cfg.bits}"]))  # the default is always measured
    for name, grad in zip(names, grads):
        if not state.eligible(grad):
            continue
        x = grad.reshape(-1).to(torch.float32)
        if name in state.residuals:
            x = x + state.residuals[name]
        errors, seconds = [], []
        for token in tokens:
            start = time.perf_counter()
            got = _round_trip(token, x, grad.shape, state)
            if got.is_cuda:  # kernels run asynchronously: time their completion, not their launch
                torch.cuda.synchronize(got.device)
            seconds.append(time.perf_counter() - start)
            errors.append(float((got - x).square().sum()))
        state._stats[name] = {"shape": list(grad.shape), "tokens": tokens, "errors": errors, "seconds": seconds,
                              "bucket": bucket_index}


def _round_trip(token: str, x: torch.Tensor, shape: torch.Size, state: CompressionState) -> torch.Tensor:
    """What one rank's gradient becomes through ``token``'s encoding (no communication)."""
    cfg = state.config
    if token == "none":
        return x
    if token in _HALF:
        return x.to(_HALF[token]).to(torch.float32)
    if token.startswith("q"):
        spec = quantizer_for(token, cfg)
        padded = torch.zeros(math.ceil(x.numel() / spec.bucket_size) * spec.bucket_size, device=x.device)
        padded[:x.numel()] = x
        q = quantize(padded, spec, state._generator)
        q.codes = unpack_codes(pack_codes(q.codes, spec.bits), spec.bits)
        return dequantize(q, spec)[:x.numel()]
    if token == "topk":
        k = max(1, math.ceil(cfg.topk_ratio * x.numel()))
        top = x.abs().topk(k, sorted=False).indices
        out = torch.zeros_like(x)
        out[top] = x[top]
        return out
    if token == "powersgd":  # one power iteration from a seeded random start, as PowerSGD's first step
        m = x.view(shape[0], -1)
        rank = min(m.shape[0], m.shape[1], cfg.rank)
        q = torch.randn(m.shape[1], rank, generator=state._generator).to(m.device)
        p = torch.linalg.qr(m @ q).Q
        return (p @ (m.T @ p).T).reshape(-1)
    raise ValueError(token)


def _end_step(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
    """After the last bucket: count the step; warn once if nothing is eligible; re-solve when due."""
    if state._steps_here == 0 and not state._eligible_seen:
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn("gradient compression: no parameter is eligible (every tensor is 1-D or has fewer "
                          f"than min_numel={state.config.min_numel} elements); gradients use plain allreduce")
    if state.measuring() and state._stats:
        _solve(state, group, world, device)
    elif state.step + 1 == state.next_solve:
        _maybe_keep_off(state, group, world, device)
    state._stats = {}
    # a group whose layers changed (new choice, DDP's bucket rebuild) leaves its chunk residual behind: drop it
    for key in set(state.chunk_residuals) - state._chunk_keys_used:
        del state.chunk_residuals[key]
    state._chunk_keys_used = set()
    state.step += 1
    state._steps_here += 1


def _maybe_keep_off(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
    """Before a re-solve with compression off: if the link is still so fast that even the cheapest codec could
    not pay, stay off and skip the per-layer measuring (the cost of being adaptive on a fast link is then one
    timing of the link).  Rank 0 decides, all follow."""
    cfg = state.config
    if cfg.method != "adaptive" or cfg.link_mbit or state._profile is None \
            or any(t != "none" for t in state.choices.values()):
        return
    codec_floor_s, fp32_bytes, buckets, elements = state._profile
    link = _time_link(group, world, elements, device)
    plain_s = link.transfer_s(fp32_bytes) + link.latency_s * buckets
    best_s = codec_floor_s + link.latency_s * (buckets + 2)  # a compressed exchange costs at least this
    keep = torch.tensor([int(best_s > (1 - cfg.min_saving) * plain_s)], device=device)
    dist.broadcast(keep, src=dist.get_global_rank(group, 0), group=group)
    if int(keep.item()):
        state.link = link
        state.interval = min(state.interval * 2, 8 * cfg.resolve_every)
        state.next_solve = state.step + 1 + state.interval


def _time_link(group: dist.ProcessGroup, world: int, largest: int, device: torch.device) -> LinkModel:
    """Time fp32 allreduces of two sizes (best of two each) and fit latency and bandwidth."""
    sizes = sorted({min(n, max(largest, _CALIBRATION_ELEMENTS[0])) for n in _CALIBRATION_ELEMENTS})
    if len(sizes) == 1:
        sizes = [max(1, sizes[0] // 16), sizes[0]]
    sent, seconds = [], []
    for n in sizes:
        buf = torch.zeros(n, device=device)
        best = float("inf")
        for _ in range(2):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        sent.append(2 * (world - 1) * 4 * n / world)
        seconds.append(best)
    return fit_link(sent, seconds)


def _solve(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
    """Pool every rank's statistics, solve on rank 0, broadcast the choice (all ranks must agree)."""
    cfg = state.config
    names = sorted(state._stats)
    tokens = state._stats[names[0]]["tokens"]
    # collectives need tensors where the backend lives (CUDA for NCCL); the solve itself runs on the CPU
    errors = torch.tensor([state._stats[n]["errors"] for n in names], dtype=torch.float64, device=device)
    seconds = torch.tensor([state._stats[n]["seconds"] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(errors, group=group)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's codec sets the pace
    errors, seconds = errors.cpu() / world, seconds.cpu()  # the mean per-rank error: same scale as the budget
    largest = sum(math.prod(state._stats[n]["shape"]) for n in names)
    state.link = LinkModel(0.0, cfg.link_mbit * 1e6 / 8) if cfg.link_mbit else \
        _time_link(group, world, largest, device)
    candidates = list(cfg.candidates)
    default = tokens.index(f"q{cfg.bits}")
    budget = cfg.error_budget * float(errors[:, default].sum())
    choice = torch.zeros(len(names), dtype=torch.int64, device=device)
    if dist.get_rank(group) == 0:
        options = []
        for li, name in enumerate(names):
            shape = state._stats[name]["shape"]
            row = []
            for token in candidates:
                ti = tokens.index(token)
                codec = 0.0 if token == "none" else _CODEC_FACTOR * float(seconds[li, ti])
                row.append(LayerOption(token, state.link.transfer_s(wire_bytes(token, shape, world, cfg)) + codec,
                                       float(errors[li, ti])))
            options.append(row)
        chosen = solve_layer_methods(options, budget)
        if "none" in candidates:  # is it worth it at all? latency per collective and a margin decide
            plain = [candidates.index("none")] * len(names)
            buckets = [state._stats[n]["bucket"] for n in names]
            compressed_s = predicted_exchange_s(options, chosen, buckets, state.link.latency_s)
            plain_s = predicted_exchange_s(options, plain, buckets, state.link.latency_s)
            if compressed_s > (1 - cfg.min_saving) * plain_s:
                chosen = plain
        choice = torch.tensor(chosen, dtype=torch.int64, device=device)
    dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
    choice = choice.cpu()
    # what the cheapest codec alone would cost, for _maybe_keep_off; from pooled figures, so equal on all ranks
    codecs = [ti for ti, t in enumerate(tokens) if t in candidates and t != "none"]
    if codecs:
        state._profile = (_CODEC_FACTOR * float(seconds[:, codecs].min(dim=1).values.sum()),
                          sum(wire_bytes("none", state._stats[n]["shape"], world, cfg) for n in names),
                          len({state._stats[n]["bucket"] for n in names}), largest)
    new = {name: candidates[int(i)] for name, i in zip(names, choice)}
    changed = new != state.choices
    state.choices = new
    state.interval = cfg.resolve_every if changed else min(state.interval * 2, 8 * cfg.resolve_every)
    state.next_solve = state.step + state.interval
    rows = []
    for li, name in enumerate(names):
        token = new[name]
        shape = state._stats[name]["shape"]
        numel = math.prod(shape)
        sent = wire_bytes(token, shape, world, cfg)
        rows.append({"step": state.step, "layer": name, "method": token,
                     "bits_per_element": round(8 * sent / (2 * (world - 1) / world) / numel, 3),
                     "bytes_per_rank": sent, "error": float(errors[li, tokens.index(token)]),
                     "budget": budget})
    state.decisions.extend(rows)
    if changed and cfg.verbose and dist.get_rank() == 0:
        print(format_decisions(rows, state.link, budget), flush=True)


def format_decisions(rows: list[dict[str, Any]], link: LinkModel | None, budget: float) -> str:
    """The per-layer decision table printed when the choice changes."""
    lines = []
    if rows:
        head = f"[het_strategy] compression choice at step {rows[0]['step']}"
        if link is not None:
            head += (f" (link {link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, latency {link.latency_s * 1e3:.2f} ms; "
                     f"error budget {budget:.3g})")
        lines.append(head)
        total = sum(r["bytes_per_rank"] for r in rows)
        for r in rows:
            lines.append(f"  {r['layer']:<40} {r['method']:<9} {r['bits_per_element']:>6.2f} bits/elt "
                         f"{r['bytes_per_rank']:>11,d} B/rank")
        lines.append(f"  {'total':<40} {'':<9} {'':>15} {total:>11,d} B/rank")
    return "\n".join(lines)
