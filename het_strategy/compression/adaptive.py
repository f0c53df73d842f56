"""The adaptive controller's runtime side: measure layers, time the link, solve, agree.

On a measuring step (``CompressionState.measuring()``) the hook calls
``measure_layers`` for each bucket, then ``solve`` after the last one:

1. every rank records, per eligible layer and candidate method, the squared
   error the method would add to its gradient (error feedback included) and
   the seconds its encode/decode round trip takes;
2. the ranks pool the figures (mean error; the slowest rank's codec time) and
   time fp32 allreduces of two sizes to fit the link's latency and bandwidth
   (or take ``link_mbit``);
3. rank 0 solves the dynamic program (``controller.py``), keeps its choice only
   if the predicted exchange falls by ``min_saving``, and broadcasts it: every
   rank must run the same collectives for every bucket;
4. the choice is logged (per layer: method, bits per element, bytes per rank);
   the next re-solve comes ``resolve_every`` steps later, twice as late (up to
   8x) each time the choice holds.

While compression is off, ``maybe_keep_off`` runs before a re-solve is due: one
timing of the link decides whether even the cheapest codec could pay, and if
not the per-layer measuring is skipped.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from het_strategy.compression.config import quantizer_for
from het_strategy.compression.controller import LayerOption, LinkModel, fit_link, predicted_exchange_s, \
    solve_layer_methods, wire_bytes
from het_strategy.compression.exchange import HALF_DTYPES
from het_strategy.compression.quantize import dequantize, pack_codes, quantize, unpack_codes

if TYPE_CHECKING:
    from het_strategy.compression.hook import CompressionState

__all__ = ["measure_layers", "solve", "maybe_keep_off", "time_link", "format_decisions"]

_CODEC_FACTOR = 2.0  # the hook encodes and decodes about twice what one round trip on the layer does
_CALIBRATION_ELEMENTS = (16 * 1024, 256 * 1024)  # 64 KiB and 1 MiB of fp32: latency and bandwidth
_DECISIONS_KEPT = 10_000  # per-layer decision rows kept in memory (and the last 1000 in checkpoints)


def measure_layers(state: CompressionState, names: list[str], grads: list[torch.Tensor], bucket_index: int) -> None:
    """Record, per eligible layer and candidate, the error it would add and its codec time (this rank)."""
    cfg = state.config
    tokens = list(dict.fromkeys([*cfg.candidates, f"q{cfg.bits}"]))  # the default is always measured
    for name, grad in zip(names, grads):
        if not state.eligible(grad):
            continue
        x = grad.reshape(-1).to(torch.float32)
        if name in state.residuals:
            x = x + state.residuals[name].to(x.device)
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
    if token in HALF_DTYPES:
        return x.to(HALF_DTYPES[token]).to(torch.float32)
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


def maybe_keep_off(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
    """Before a re-solve with compression off: if the link is still so fast that even the cheapest codec could
    not pay, stay off and skip the per-layer measuring (the cost of being adaptive on a fast link is then one
    timing of the link).  Rank 0 decides, all follow."""
    cfg = state.config
    if cfg.method != "adaptive" or cfg.link_mbit or state._profile is None \
            or any(t != "none" for t in state.choices.values()):
        return
    codec_floor_s, fp32_bytes, buckets, elements = state._profile
    link = time_link(group, world, elements, device)
    plain_s = link.transfer_s(fp32_bytes) + link.latency_s * buckets
    best_s = codec_floor_s + link.latency_s * (buckets + 2)  # a compressed exchange costs at least this
    keep = torch.tensor([int(best_s > (1 - cfg.min_saving) * plain_s)], device=device)
    dist.broadcast(keep, src=dist.get_global_rank(group, 0), group=group)
    if int(keep.item()):
        state.link = link
        state.interval = min(state.interval * 2, 8 * cfg.resolve_every)
        state.next_solve = state.step + 1 + state.interval


def time_link(group: dist.ProcessGroup, world: int, largest: int, device: torch.device) -> LinkModel:
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


def solve(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
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
        time_link(group, world, largest, device)
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
    # what the cheapest codec alone would cost, for maybe_keep_off; from pooled figures, so equal on all ranks
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
    state.decisions = (state.decisions + rows)[-max(_DECISIONS_KEPT, len(rows)):]  # bounded over long runs
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
