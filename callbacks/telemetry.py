"""Per-rank step telemetry: compute, data loading and communication time, gathered every N steps.

On every rank and training step ``StepTelemetry`` records

* ``compute_s`` — from the batch's start to the moment its last gradient bucket
  was ready (the ``hetero`` strategy timestamps that in its comm hook): the
  rank's own forward, backward (and emulated padding), without waiting;
* ``comm_s`` — from then to the end of backward: the gradient collectives'
  tail plus waiting for slower ranks;
* ``data_s`` — from the end of the previous step to this batch's start:
  fetching the batch (and the loop's own bookkeeping);
* ``step_s`` — end of the previous step to the end of this one;
* ``samples`` — the samples the rank really used (0 for a filler);
* ``share`` — the rank's share of a full global batch in the plan being run;
* ``raw_bytes`` / ``wire_bytes`` — the gradient bytes this rank's comm hook
  handled in the step: what a plain ring allreduce of its buckets sends, and
  what really went on the wire (compression; ``compression/wire_count.py``
  counts both in the hook).  0 in a step DDP did not sync (accumulation);
  ``wire_bytes`` is left out for a user's hook that does not count its bytes.

Every ``every_n_steps`` steps the rows of all ranks are exchanged in one
tensor all-gather (no collective in the other steps), handed to ``on_window`` —
which subclasses (the straggler callback) use to decide — and logged on rank 0
to the Trainer's loggers (wandb, CSV) as ``telemetry/rank{r}/<field>``.
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

__all__ = ["StepTelemetry", "FIELDS"]

FIELDS = ("step", "samples", "compute_s", "comm_s", "data_s", "step_s", "share", "raw_bytes", "wire_bytes")


class StepTelemetry(pl.Callback):
    """Records per-rank step timings and exchanges them every ``every_n_steps`` steps.

    Args:
        every_n_steps: steps per exchange (one small ``all_gather``).
        log: log the gathered figures to the Trainer's loggers on rank 0.
    """

    def __init__(self, every_n_steps: int = 2, log: bool = True) -> None:
        self.every_n_steps = require_int(every_n_steps, "every_n_steps", minimum=1)
        self.log = log
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
