"""Measured throughput of a run: step time, samples/s, and each rank's own compute rate.

``ThroughputMonitor`` timestamps every training step on every rank.  At the
end of training it gathers, from every rank, the samples per step and — under
the ``hetero`` strategy, which timestamps the moment a rank's last gradient is
ready — the compute seconds per step without waiting for others.  Rank 0 gets
a summary (``.summary``, optionally a JSON file, added to a ``WandbLogger``'s
run as a file) and a printed table, and logs its step time, samples/s and
estimated speed-up as ``throughput/<figure>`` to every logger:

* ``samples_per_s``: global batch / mean wall time of a step (after warm-up);
* ``step_durations_s``: rank 0's wall time of every step (step i at index i);
* per rank: samples per step, compute seconds per step, compute samples/s;
* ``equal_split_step_s`` (estimated): what a step would take with the global
  batch split evenly, from each rank's measured compute rate plus the measured
  non-compute part of a step; ``speedup_vs_equal`` is its ratio to the real step.

One collective (an object gather) at the end of training; none per step.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from typing_extensions import override

from het_strategy.callbacks.runtime import runtime_of
from het_strategy.core.atomic_file import write_atomic
from het_strategy.core.errors import field_error
from het_strategy.profiling.batch_contents import batch_length
from het_strategy.report.wandb_view import save_file

__all__ = ["ThroughputMonitor"]

_LOGGED = ("step_s", "samples_per_s", "equal_split_step_s", "speedup_vs_equal")
"""Summary figures logged as ``throughput/<name>`` to every logger at the end of training."""


class ThroughputMonitor(pl.Callback):
    """Step times and per-rank compute rates of a training run (see the module docstring).

    Args:
        warmup_steps: first steps left out of the means (compilation, allocator, caches).
        summary_path: rank 0 writes the summary there as JSON when given.
        verbose: rank 0 prints the table.
    """

    def __init__(self, warmup_steps: int = 3, summary_path: str | Path | None = None, verbose: bool = True) -> None:
        if not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise field_error("warmup_steps", warmup_steps, "be an integer >= 0")
        self.warmup_steps = warmup_steps
        self.summary_path = Path(summary_path) if summary_path is not None else None
        self.verbose = verbose
        self.summary: dict[str, Any] | None = None
        self._ends: list[float] = []
        self._samples: list[int] = []
        self._start = 0.0

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ends, self._samples = [], []
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._ends.append(time.perf_counter())
        # hetero (HeteroRuntime) and hetero_deepspeed both say how many samples this rank really uses
        runtime = runtime_of(trainer.strategy)
        local = (runtime.current_local_samples if runtime is not None
                 else getattr(getattr(trainer.strategy, "run", None), "current_local_samples", None))
        self._samples.append(int(local) if local is not None else batch_length(batch))

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        mine = self._rank_stats(trainer)
        gathered: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered = [None] * trainer.world_size
            dist.all_gather_object(gathered, mine)
        if trainer.global_rank != 0:
            return
        self.summary = self._summarise(trainer, gathered)
        if self.verbose:
            print(format_summary(self.summary), flush=True)
        scalars = {f"throughput/{k}": float(self.summary[k]) for k in _LOGGED if self.summary.get(k) is not None}
        for logger in trainer.loggers:
            logger.log_metrics(scalars, step=trainer.global_step)
        if self.summary_path is not None:
            write_atomic(self.summary_path, json.dumps(self.summary, indent=2))
            save_file(trainer.loggers, self.summary_path)  # a WandbLogger's run gets the file itself

    def _rank_stats(self, trainer: pl.Trainer) -> dict[str, Any]:
        w = self.warmup_steps
        ends = self._ends
        steps = [b - a for a, b in zip(ends[w:], ends[w + 1:])]
        stats: dict[str, Any] = {"rank": trainer.global_rank, "steps": len(steps),
                                 "step_s": statistics.fmean(steps) if steps else None,
                                 "samples_per_step": statistics.fmean(self._samples[w + 1:]) if steps else None}
        runtime = runtime_of(trainer.strategy)
        records = list(runtime.records)[w + 1:] if runtime is not None else []
        if records:
            stats["compute_s"] = statistics.fmean(r.compute_s for r in records)
            stats["pad_s"] = statistics.fmean(r.pad_s for r in records)
            stats["compute_samples"] = statistics.fmean(r.samples for r in records)
        cluster = runtime.cluster if runtime is not None else None
        if cluster is not None:
            device = cluster.devices[trainer.global_rank]
            stats["device"], stats["emulated_speed"] = device.name, device.emulated_speed
        return stats

    def _summarise(self, trainer: pl.Trainer, ranks: list[dict[str, Any]]) -> dict[str, Any]:
        step_s = ranks[0]["step_s"]
        global_batch = sum(r["samples_per_step"] or 0 for r in ranks)
        ends = [self._start] + self._ends
        out: dict[str, Any] = {"strategy": type(trainer.strategy).__name__, "world_size": trainer.world_size,
                               "steps_measured": ranks[0]["steps"], "global_batch": global_batch,
                               "step_s": step_s, "samples_per_s": global_batch / step_s if step_s else None,
                               "ranks": ranks,
                               "step_durations_s": [b - a for a, b in zip(ends, ends[1:])]}
        if step_s and all("compute_s" in r and r["compute_samples"] for r in ranks):
            per_sample = [r["compute_s"] / r["compute_samples"] for r in ranks]
            for r, t in zip(ranks, per_sample):
                r["compute_samples_per_s"] = 1.0 / t
            overhead = max(step_s - max(r["compute_s"] for r in ranks), 0.0)
            equal = global_batch / len(ranks)
            out["equal_split_step_s"] = max(equal * t for t in per_sample) + overhead
            out["speedup_vs_equal"] = out["equal_split_step_s"] / step_s
        return out


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a small table."""
    lines = [f"throughput ({summary['strategy']}, {summary['world_size']} ranks, "
             f"{summary['steps_measured']} steps after warm-up): global batch {summary['global_batch']:g}, "
             f"{_fmt(summary['step_s'], '.3f')} s/step, {_fmt(summary['samples_per_s'], '.1f')} samples/s"]
    lines.append(f"  {'rank':<5}{'device':<10}{'speed':>6}{'samples/step':>14}{'compute s':>11}{'compute samples/s':>19}")
    for r in summary["ranks"]:
        lines.append(f"  {r['rank']:<5}{str(r.get('device', '-')):<10}{_fmt(r.get('emulated_speed'), 'g'):>6}"
                     f"{_fmt(r['samples_per_step'], '.1f'):>14}{_fmt(r.get('compute_s'), '.3f'):>11}"
                     f"{_fmt(r.get('compute_samples_per_s'), '.1f'):>19}")
    if "speedup_vs_equal" in summary:
        lines.append(f"  equal split (estimated from the measured per-rank rates): "
                     f"{summary['equal_split_step_s']:.3f} s/step -> speed-up {summary['speedup_vs_equal']:.2f}x")
    return "\n".join(lines)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)
