"""Per-rank step telemetry: compute, data loading and communication time, gathered every N steps.

On every rank and training step ``StepTelemetry`` records ``compute_s`` (the
batch's start to its last gradient bucket ready, as the ``hetero`` strategy's
comm hook timestamps it: own forward, backward and emulated padding, no
waiting); ``comm_s`` (then to backward's end: the collectives' tail plus
waiting for slower ranks); ``data_s`` (the previous step's end to this batch's
start: fetching it and the loop's bookkeeping); ``step_s`` (step end to step
end); ``samples`` (really used; 0 for a filler); ``share`` (of a full global
batch in the plan run); ``raw_bytes`` / ``wire_bytes`` (the gradient bytes a
plain ring allreduce of the step's buckets sends, and what went on the wire,
both counted in the hook by ``compression/wire_count.py``; 0 in a step DDP did
not sync; ``wire_bytes`` left out for a hook that does not count its bytes).

Every ``every_n_steps`` steps the rows of all ranks are exchanged in one
tensor all-gather (no collective in the other steps), handed to ``on_window``
(the straggler callback decides there), logged on rank 0 to the Trainer's
loggers as ``telemetry/rank{r}/<field>``, and added on every rank to running
sums: ``measured_step_times`` gives each rank's mean step split as the cost
model predicts it — compute, sync (the step's smallest ``comm_s``: the last
rank ready waits for nobody), idle (the rest of its ``comm_s``), update
(backward's end to the step's end: optimizer and loop), data.  The sums
restart at each fit after ``warmup_steps`` and when the shares change.
"""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from typing_extensions import override

from het_strategy.callbacks.runtime import HeteroRuntime, runtime_of
from het_strategy.core.errors import field_error, require_int
from het_strategy.core.plan_score import DeviceStepTimes

__all__ = ["StepTelemetry", "FIELDS"]

FIELDS = ("step", "samples", "compute_s", "comm_s", "data_s", "step_s", "share", "raw_bytes", "wire_bytes")


class StepTelemetry(pl.Callback):
    """Records per-rank step timings and exchanges them every ``every_n_steps`` steps.

    Args:
        every_n_steps: steps per exchange (one small ``all_gather``).
        log: log the gathered figures to the Trainer's loggers on rank 0.
        warmup_steps: first steps of a fit left out of ``measured_step_times``.
    """

    def __init__(self, every_n_steps: int = 2, log: bool = True, warmup_steps: int = 1) -> None:
        self.every_n_steps = require_int(every_n_steps, "every_n_steps", minimum=1)
        self.log = log
        self.warmup_steps = require_int(warmup_steps, "warmup_steps", minimum=0)
        self._sums: torch.Tensor | None = None  # [world, 6] sums of the step split since the shares changed
        self._summed_steps = 0
        self._summed_shares: torch.Tensor | None = None
        self._first_step = 0
        self.steps_seen = 0
        self._rows: list[list[float]] = []
        self._last_end: float | None = None
        self._start = 0.0
        self._after_backward = 0.0
        self._wire_seen: tuple[int, int | None] = (0, 0)  # the comm hook's byte totals at the last step's end
        self.runtime: HeteroRuntime | None = None
        """The strategy, seen through what callbacks may use of it (set at setup)."""

    # -- recording ------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.runtime = runtime_of(trainer.strategy)
        if self.runtime is None and stage == "fit":
            raise field_error("strategy", type(trainer.strategy).__name__,
                              "be `hetero` (it timestamps each rank's compute in its comm hook)")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wire = getattr(self.runtime, "wire", None)
        if wire is not None:  # bytes of an earlier fit with the same strategy are not this run's
            self._wire_seen = wire.reading()
        self._sums, self._summed_steps, self._summed_shares = None, 0, None
        self._first_step = self.steps_seen

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._after_backward = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        end = time.perf_counter()
        assert self.runtime is not None
        record = self.runtime.records[-1]
        data_s = self._start - self._last_end if self._last_end is not None else 0.0
        step_s = end - self._last_end if self._last_end is not None else end - self._start
        comm_s = max(self._after_backward - self._start - record.compute_s, 0.0)
        raw, sent = self._wire_step()
        share = float(self.runtime.current_shares()[trainer.global_rank])
        self._rows.append([float(self.steps_seen), float(record.samples), record.compute_s, comm_s, data_s, step_s,
                           share, raw, sent])
        self._last_end = end
        self.steps_seen += 1
        if self.steps_seen % self.every_n_steps == 0:
            window = self._exchange(trainer, pl_module)
            self._add_to_sums(window)
            if self.log and trainer.global_rank == 0:
                self._log(trainer, window)
            self.on_window(trainer, pl_module, window, batch_idx)

    def _wire_step(self) -> tuple[float, float]:
        """This step's (raw, wire) gradient bytes from the strategy's counter (NaN where unknown)."""
        wire = getattr(self.runtime, "wire", None)  # the hetero strategy's WireBytes; not part of HeteroRuntime
        if wire is None:
            return math.nan, math.nan
        raw, sent = wire.reading()
        last_raw, last_sent = self._wire_seen
        self._wire_seen = (raw, sent)
        step_sent = math.nan if sent is None or last_sent is None else float(sent - last_sent)
        return float(raw - last_raw), step_sent

    def _exchange(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.Tensor:
        """[world, steps, len(FIELDS)] on every rank (float64, CPU)."""
        mine = torch.tensor(self._rows, dtype=torch.float64, device=pl_module.device)
        self._rows = []
        if not (dist.is_available() and dist.is_initialized()) or trainer.world_size == 1:
            return mine.unsqueeze(0).cpu()
        # every rank has the same number of rows: all reach this exchange at the same step
        gathered = torch.empty((trainer.world_size * mine.shape[0], mine.shape[1]), dtype=mine.dtype,
                               device=mine.device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, mine)
        return gathered.view(trainer.world_size, *mine.shape).cpu()

    def _log(self, trainer: pl.Trainer, window: torch.Tensor) -> None:
        for s in range(window.shape[1]):
            step = int(window[0, s, 0])
            metrics = {f"telemetry/rank{r}/{name}": float(window[r, s, i])
                       for r in range(window.shape[0]) for i, name in enumerate(FIELDS)
                       if name != "step" and not math.isnan(float(window[r, s, i]))}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    # -- the measured step split ---------------------------------------------------------------
    def _add_to_sums(self, window: torch.Tensor) -> None:
        """Add each step of ``window`` after the warm-up to the sums, restarting them where the shares change."""
        col = {name: i for i, name in enumerate(FIELDS)}
        for s in range(window.shape[1]):
            rows = window[:, s]
            if rows[0, col["step"]] < self._first_step + self.warmup_steps:
                continue
            shares = rows[:, col["share"]]
            if self._summed_shares is None or not torch.equal(shares, self._summed_shares):
                self._sums, self._summed_steps, self._summed_shares = None, 0, shares.clone()
            comm, data, compute = rows[:, col["comm_s"]], rows[:, col["data_s"]], rows[:, col["compute_s"]]
            sync = comm.min().expand_as(comm)  # the last rank to be ready waits for nobody: its comm is the sync
            after_backward = rows[:, col["step_s"]] - data - compute - comm
            split = torch.stack([rows[:, col["samples"]], compute, sync, after_backward, data,
                                 rows[:, col["step_s"]]], dim=1)
            self._sums = split if self._sums is None else self._sums + split
            self._summed_steps += 1

    def measured_step_times(self) -> list[DeviceStepTimes] | None:
        """Each rank's mean step split over the gathered steps since the shares last changed (after the warm-up),
        in rank order; None before any such step.  The same on every rank (every rank sums the same windows)."""
        if self._sums is None or not self._summed_steps:
            return None
        means = (self._sums / self._summed_steps).tolist()
        cluster = self.runtime.cluster if self.runtime is not None else None
        names = [d.name for d in cluster.devices] if cluster is not None else [f"rank{r}" for r in range(len(means))]
        return [DeviceStepTimes(name, samples, compute, sync, after, step, data_s=data)
                for name, (samples, compute, sync, after, data, step) in zip(names, means)]

    def on_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: torch.Tensor,
                  batch_idx: int) -> None:
        """Called on every rank with the same gathered window; subclasses act on it."""

    # -- checkpoints ----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"steps_seen": self.steps_seen, "rows": [list(r) for r in self._rows]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_seen = int(state_dict["steps_seen"])
        # rows saved before the share and byte fields existed get NaN for them
        self._rows = [list(r) + [math.nan] * (len(FIELDS) - len(r)) for r in state_dict["rows"]]
