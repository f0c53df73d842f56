"""The adaptive controller at run time: ``AdaptiveController`` measures layers, times the link, solves, agrees.

An ``adaptive`` ``CompressionState`` owns one (``state.controller``).  On a
measuring step (``controller.measuring(step)``) the state hands it each
bucket's eligible layers (``measure``), then, after the last bucket, calls
``end_step``, which solves (the steps are in ``AdaptiveController``'s
docstring) and returns the new per-layer choice as a ``Solution``.
``time_link`` fits the link's latency and bandwidth from two timed
allreduces; ``format_decisions`` renders a solve's log rows.

Invariants:

- every rank runs the same collectives for every bucket, so the choice is
  rank 0's, broadcast, and the schedule (which steps measure and re-solve)
  only ever follows figures every rank shares;
- the controller decides and the state records: what the controller needs from
  the state (the step, the current choice, error-feedback residuals, the rank's
  random generator) comes in as arguments, and it never reaches into the state.
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist

from het_strategy.compression.torch_codecs import round_trip, wire_bytes
from het_strategy.compression.config import CompressionConfig
from het_strategy.compression.controller import LayerOption, LinkModel, fit_link, predicted_exchange_s, \
    solve_layer_methods
from het_strategy.core.codecs import Codec
from het_strategy.core.log import logger
from het_strategy.core.network import ring_allreduce_bytes
from het_strategy.profiling.torch_device import DTYPE_NAMES

__all__ = ["AdaptiveController", "Solution", "time_link", "format_decisions"]

_CODEC_FACTOR = 2.0  # the hook encodes and decodes about twice what one round trip on the layer does
_CALIBRATION_ELEMENTS = (16 * 1024, 256 * 1024)  # 64 KiB and 1 MiB of fp32: latency and bandwidth


class Solution(NamedTuple):
    """What a solve decided: the per-layer choice (name -> method token) and its log rows."""

    choices: dict[str, str]
    rows: list[dict[str, Any]]


class AdaptiveController:
    """The per-layer choice's schedule and measurements (the ``adaptive`` method).

    A solve (``end_step`` on a measuring step):

    1. every rank records, per eligible layer and candidate method, the squared
       error the method would add to its gradient (error feedback included) and
       the seconds its encode/decode round trip takes (``measure``);
    2. the ranks pool the figures (mean error; the slowest rank's codec time) and
       time fp32 allreduces of two sizes to fit the link's latency and bandwidth
       (or take ``link_mbit``);
    3. rank 0 solves the dynamic program (``controller.py``), keeps its choice only
       if the predicted exchange falls by ``min_saving``, and broadcasts it: every
       rank must run the same collectives for every bucket;
    4. the choice and its log rows (per layer: method, bits per element, bytes per
       rank) go back to the state, which keeps them; the next re-solve comes
       ``resolve_every`` steps later, twice as late (up to 8x) each time the choice
       holds.

    While compression is off, ``maybe_keep_off`` runs before a re-solve is due: one
    timing of the link decides whether even the cheapest codec could pay, and if
    not the per-layer measuring is skipped.

    Args:
        config: the state's ``CompressionConfig`` (candidates, budget, link, schedule).

    Distributed invariant: ``next_solve`` and ``interval`` decide on which step the hook measures and runs the
    solve's collectives, so they must be equal on every rank.  They only ever change from figures every rank
    shares (the step count, the pooled statistics, rank 0's broadcast), and they are checkpointed per rank and
    restored together.  ``link`` and ``stats`` may differ between ranks: only rank 0's link feeds the
    solve, and every rank's statistics are pooled before it.
    """

    __slots__ = (
        # what was asked (shared with the state; frozen)
        "config",
        # the schedule (equal on every rank; saved): the step of the next measuring step and re-solve, and the
        # gap between re-solves (``resolve_every``, doubled up to 8x each time the choice holds)
        "next_solve", "interval",
        # the link fitted at the last solve or keep-off timing (saved; rank 0's is the one that decides)
        "link",
        # this rank's measurements of the current measuring step (not saved; emptied after every step):
        # layer name -> {"shape", "dtype", "tokens", "errors", "seconds", "bucket"}
        "stats",
        # from the last full solve, pooled so equal on every rank (not saved): (least codec seconds any
        # compression needs, uncompressed wire bytes, buckets, elements); ``None`` until a solve has run
        "profile",
    )

    def __init__(self, config: CompressionConfig) -> None:
        self.config = config
        self.next_solve: int = config.warmup_steps
        self.interval: int = config.resolve_every
        self.link: LinkModel | None = None
        self.stats: dict[str, dict[str, Any]] = {}
        self.profile: tuple[float, int, int, int] | None = None

    def measuring(self, step: int) -> bool:
        """Whether ``step`` is a measuring step (the same answer on every rank: see the class docstring)."""
        return step >= self.next_solve

    # -- checkpoints: flat keys of the state's dict (``CompressionState.state_dict``) -------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"next_solve": self.next_solve, "interval": self.interval,
                "link": None if self.link is None else [self.link.latency_s, self.link.bytes_per_s]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.next_solve = int(state["next_solve"])
        self.interval = int(state["interval"])
        self.link = None if state.get("link") is None else LinkModel(*state["link"])

    # -- one measuring step -----------------------------------------------------------------------------------
    def measure(self, names: list[str], grads: list[torch.Tensor], bucket_index: int,
                residuals: Mapping[str, torch.Tensor], generator: torch.Generator) -> None:
        """Record, per layer (the caller passes eligible ones only) and candidate, the error it would add and its
        codec time on this rank.  ``residuals``: the state's error feedback, added first as the hook will;
        ``generator``: this rank's, for stochastic rounding and PowerSGD's random start."""
        cfg = self.config
        tokens = list(dict.fromkeys([*cfg.candidates, cfg.budget_codec]))  # the budget's codec is always measured
        for name, grad in zip(names, grads):
            x = grad.reshape(-1).to(torch.float32)
            if name in residuals:
                x = x + residuals[name].to(x.device)
            errors, seconds = [], []
            for token in tokens:
                start = time.perf_counter()
                got = round_trip(token, x, grad.shape, cfg, generator)
                if got.is_cuda:  # kernels run asynchronously: time their completion, not their launch
                    torch.cuda.synchronize(got.device)
                seconds.append(time.perf_counter() - start)
                errors.append(float((got - x).square().sum()))
            self.stats[name] = {"shape": list(grad.shape), "dtype": DTYPE_NAMES.get(grad.dtype, "fp32"),
                                "tokens": tokens, "errors": errors, "seconds": seconds, "bucket": bucket_index}

    def end_step(self, step: int, choices: Mapping[str, str], group: dist.ProcessGroup, world: int,
                 device: torch.device) -> Solution | None:
        """After the last bucket of ``step``: solve on a measuring step, or time the link before a re-solve is
        due with compression off.  Returns the new choice when one was solved (the state keeps it)."""
        solution = None
        if self.measuring(step):
            if self.stats:
                solution = self.solve(step, choices, group, world, device)
            else:  # nothing eligible was measured (the same on every rank): look again later
                self.next_solve = step + 1 + self.interval
        elif step + 1 == self.next_solve:
            self.maybe_keep_off(step, choices, group, world, device)
        self.stats = {}
        return solution

    def maybe_keep_off(self, step: int, choices: Mapping[str, str], group: dist.ProcessGroup, world: int,
                       device: torch.device) -> None:
        """Before a re-solve with compression off: if the link is still so fast that even the cheapest codec
        could not pay, stay off and skip the per-layer measuring (the cost of being adaptive on a fast link is
        then one timing of the link).  Rank 0 decides, all follow: the schedule must stay equal on every rank."""
        cfg = self.config
        if cfg.link_mbit or self.profile is None or any(t != Codec.NONE for t in choices.values()):
            return
        codec_floor_s, plain_bytes, buckets, elements = self.profile
        link = time_link(group, world, elements, device)
        plain_s = link.transfer_s(plain_bytes) + link.latency_s * buckets
        best_s = codec_floor_s + link.latency_s * (buckets + 2)  # a compressed exchange costs at least this
        keep = torch.tensor([int(best_s > (1 - cfg.min_saving) * plain_s)], device=device)
        dist.broadcast(keep, src=dist.get_global_rank(group, 0), group=group)
        if int(keep.item()):
            self.link = link
            self.interval = min(self.interval * 2, 8 * cfg.resolve_every)
            self.next_solve = step + 1 + self.interval

    def solve(self, step: int, choices: Mapping[str, str], group: dist.ProcessGroup, world: int,
              device: torch.device) -> Solution:
        """Pool every rank's statistics, solve on rank 0, broadcast the choice (all ranks must agree: they run
        the collectives the choice implies for every bucket).  ``choices``: the current one, to tell a change."""
        cfg, stats = self.config, self.stats
        names = sorted(stats)
        tokens = stats[names[0]]["tokens"]
        # collectives need tensors where the backend lives (CUDA for NCCL); the solve itself runs on the CPU
        errors = torch.tensor([stats[n]["errors"] for n in names], dtype=torch.float64, device=device)
        seconds = torch.tensor([stats[n]["seconds"] for n in names], dtype=torch.float64, device=device)
        dist.all_reduce(errors, group=group)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)  # the slowest rank's codec sets the pace
        errors, seconds = errors.cpu() / world, seconds.cpu()  # the mean per-rank error: same scale as the budget
        largest = sum(math.prod(stats[n]["shape"]) for n in names)
        link = LinkModel(0.0, cfg.link_mbit * 1e6 / 8) if cfg.link_mbit else time_link(group, world, largest, device)
        self.link = link
        candidates = list(cfg.candidates)
        budget = cfg.error_budget * float(errors[:, tokens.index(cfg.budget_codec)].sum())
        # every rank prices the options with its own link (for the log's reasons); rank 0's decide
        options = []
        for li, name in enumerate(names):
            shape, dtype = stats[name]["shape"], stats[name]["dtype"]
            row = []
            for token in candidates:
                ti = tokens.index(token)
                codec_s = 0.0 if token == Codec.NONE else _CODEC_FACTOR * float(seconds[li, ti])
                row.append(LayerOption(token, link.transfer_s(wire_bytes(token, shape, world, cfg, dtype)) + codec_s,
                                       float(errors[li, ti])))
            options.append(row)
        choice = torch.zeros(len(names), dtype=torch.int64, device=device)
        if dist.get_rank(group) == 0:
            chosen = solve_layer_methods(options, budget)
            if Codec.NONE in candidates:  # is it worth it at all? latency per collective and a margin decide
                plain = [candidates.index(Codec.NONE)] * len(names)
                buckets = [stats[n]["bucket"] for n in names]
                compressed_s = predicted_exchange_s(options, chosen, buckets, link.latency_s)
                plain_s = predicted_exchange_s(options, plain, buckets, link.latency_s)
                if compressed_s > (1 - cfg.min_saving) * plain_s:
                    chosen = plain
            choice = torch.tensor(chosen, dtype=torch.int64, device=device)
        dist.broadcast(choice, src=dist.get_global_rank(group, 0), group=group)
        choice = choice.cpu()
        # what the cheapest codec alone would cost, for maybe_keep_off; from pooled figures, so equal on all ranks
        codecs = [ti for ti, t in enumerate(tokens) if t in candidates and t != Codec.NONE]
        if codecs:
            self.profile = (_CODEC_FACTOR * float(seconds[:, codecs].min(dim=1).values.sum()),
                            sum(wire_bytes(Codec.NONE, stats[n]["shape"], world, cfg, stats[n]["dtype"])
                                for n in names),
                            len({stats[n]["bucket"] for n in names}), largest)
        new = {name: candidates[int(i)] for name, i in zip(names, choice)}
        changed = new != dict(choices)
        # the schedule only follows the broadcast choice and the step: equal on every rank
        self.interval = cfg.resolve_every if changed else min(self.interval * 2, 8 * cfg.resolve_every)
        self.next_solve = step + self.interval
        rows = []
        for li, name in enumerate(names):
            token = new[name]
            shape = stats[name]["shape"]
            sent = wire_bytes(token, shape, world, cfg, stats[name]["dtype"])
            # bits per element as an allreduce would carry them: 32 for fp32 uncompressed
            rows.append({"step": step, "layer": name, "method": str(token),
                         "bits_per_element": round(32 * sent / ring_allreduce_bytes(4 * math.prod(shape), world), 3),
                         "bytes_per_rank": sent, "error": float(errors[li, tokens.index(token)]),
                         "budget": budget, "reason": _reason(options[li], candidates.index(token), link, budget)})
        if changed and cfg.verbose and dist.get_rank() == 0:
            logger.info("%s", format_decisions(rows, link, budget))  # a line of its own, above a progress bar
        return Solution(new, rows)


def _reason(options: list[LayerOption], chosen: int, link: LinkModel, budget: float) -> str:
    """Why a layer got its method: the link, its predicted time against the uncompressed one, its error."""
    pick = options[chosen]
    text = (f"link {link.bytes_per_s * 8 / 1e6:.0f} Mbit/s, {link.latency_s * 1e3:.2f} ms latency: "
            f"{pick.token} {pick.time_s * 1e3:.3g} ms")
    plain = next((o for o in options if o.token == Codec.NONE), None)
    if plain is not None and pick.token != Codec.NONE:
        text += f" vs {plain.time_s * 1e3:.3g} ms uncompressed"
    elif plain is not None:
        fastest = min(options, key=lambda o: o.time_s)
        if fastest.token != Codec.NONE:  # compressing this layer would have been faster alone: the budget or margin
            text += (f" (fastest {fastest.token} {fastest.time_s * 1e3:.3g} ms; the error budget or min_saving "
                     "kept it uncompressed)")
    return text + f"; error {pick.error:.3g} of a budget of {budget:.3g} for all layers"


def time_link(group: dist.ProcessGroup, world: int, largest: int, device: torch.device) -> LinkModel:
    """Time fp32 allreduces of two sizes (best of two each) and fit latency and bandwidth.  Collective: every
    rank of ``group`` calls it at the same point (a barrier precedes each timed allreduce)."""
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
        sent.append(ring_allreduce_bytes(4 * n, world))  # fp32
        seconds.append(best)
    return fit_link(sent, seconds)


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
