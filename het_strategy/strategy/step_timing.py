"""Per-rank step records: how long this rank's own work on a batch took, without waiting for others.

A batch's compute runs from its start to the moment its last gradient bucket
is ready (the comm hook's timestamp), less the time spent inside collectives
during the step (``sync_dist`` logging waits for slower ranks: that is not
compute).  On an emulated device the compute is at least its emulated time.
When DDP skips the sync (gradient accumulation) no hook runs: the whole
backward is then this rank's own compute.

``StepPacing`` is the ``hetero`` strategy's part that owns this rank's
``StepClock`` and, on an emulated cluster, the ``BatchPadding`` that pads
each training batch to its emulated device's time.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.workload import WorkloadSpec
from het_strategy.emulation.padding import BatchPadding
from het_strategy.emulation.speeds import cluster_is_emulated

__all__ = ["StepRecord", "StepClock", "StepPacing"]


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


class StepPacing:
    """This rank's step clock and emulated padding of each training batch."""

    def __init__(self) -> None:
        self.clock = StepClock()
        self.padding: BatchPadding | None = None
        """The batch padding on an emulated cluster (once a training plan exists), else None."""

    def emulate(self, cluster: ClusterSpec, rank: int, workload: WorkloadSpec, dtype: str,
                experts: bool) -> BatchPadding | None:
        """Pad this rank's batches to its emulated device (when the cluster is emulated); ``experts=True``: the
        batch padding covers the dense part only (HeteroMoE layers pad their experts themselves)."""
        if not cluster_is_emulated(cluster):
            self.padding = None
            return None
        self.padding = BatchPadding.for_device(cluster, cluster.devices[rank].name, workload, dtype,
                                               experts=not experts)
        self.padding.warn = rank == 0  # rank 0 says it once if its emulated time is far below the real one
        return self.padding

    def begin(self, batch_idx: int, samples: int | None, global_step: int) -> None:
        """A training batch of ``samples`` (None: not a split loader) starts at optimizer step ``global_step``."""
        self.clock.begin(batch_idx)
        if self.padding is not None and samples is not None:
            self.padding.begin(samples, global_step)

    def finish_padding(self, samples: int | None) -> None:
        """Pad the current training batch to its emulated time (once; the later calls do nothing)."""
        if self.padding is not None and samples is not None:
            self.padding.finish()

    def after_backward(self, samples: int) -> StepRecord:
        """The current training batch's record, once its backward is done."""
        pad = self.padding
        return self.clock.record(samples, pad.pad_s if pad else 0.0, pad.target_s if pad else None)
