"""Per-rank step records: how long this rank's own work on a batch took, without waiting for others.

A batch's compute runs from its start to the moment its last gradient bucket
is ready (the comm hook's timestamp), less the time spent inside collectives
during the step (``sync_dist`` logging waits for slower ranks: that is not
compute).  On an emulated device the compute is at least its emulated time.
When DDP skips the sync (gradient accumulation) no hook runs: the whole
backward is then this rank's own compute.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

__all__ = ["StepRecord", "StepClock"]


@dataclass
class StepRecord:
    """One training batch on this rank."""

    step: int
    samples: int
    forward_s: float
    pad_s: float
    compute_s: float
    """Batch start to the last gradient bucket ready, less time inside collectives: this rank's own work
    (on an emulated device, at least its emulated time)."""


class StepClock:
    """Times each training batch of this rank; ``records`` keeps the last 10 000."""

    def __init__(self) -> None:
        self.records: deque[StepRecord] = deque(maxlen=10_000)
        self.step = -1
        self._t0 = 0.0
        self._forward_s = 0.0
        self._grad_ready = 0.0
        self.collective_s = 0.0
        """Time the current batch spent inside collectives (waiting, not compute)."""

    def begin(self, step: int) -> None:
        self.step, self._t0, self.collective_s = step, time.perf_counter(), 0.0

    def forward_done(self) -> None:
        self._forward_s = time.perf_counter() - self._t0

    def gradients_ready(self) -> None:
        """A gradient bucket is ready (called from the comm hook, after any padding)."""
        self._grad_ready = time.perf_counter()

    def add_collective(self, seconds: float) -> None:
        self.collective_s += seconds

    def record(self, samples: int, pad_s: float, emulated_s: float | None) -> StepRecord:
        """After backward: the batch's record (``emulated_s``: its emulated time, None when not emulated)."""
        synced = self._grad_ready >= self._t0
        end = self._grad_ready if synced else time.perf_counter()
        measured = max(end - self._t0 - self.collective_s, 0.0)
        compute = measured if emulated_s is None else max(measured, emulated_s)
        row = StepRecord(step=self.step, samples=samples, forward_s=self._forward_s - self.collective_s,
                         pad_s=pad_s, compute_s=compute)
        self.records.append(row)
        return row
