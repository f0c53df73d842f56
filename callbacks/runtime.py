"""What callbacks may read and call on the ``hetero`` strategy: ``HeteroRuntime``.

The straggler, telemetry and emulation callbacks talk to the strategy through
this Protocol only (``runtime_of(trainer.strategy)``), never through its
internals; a test can stand in for the strategy with any object that has these
members.  It lives with the callbacks, which read it: the
strategy satisfies it without importing it, so the callbacks import nothing
from ``strategy/``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from het_strategy.compression.state import CompressionState
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan import Plan

__all__ = ["HeteroRuntime", "StepTiming", "runtime_of"]


class StepTiming(Protocol):
    """One training batch on this rank, as the strategy timed it (``strategy.step_timing.StepRecord``)."""

    step: int
    samples: int
    forward_s: float
    pad_s: float
    compute_s: float
    """This rank's own work on the batch: its start to the last gradient bucket ready, less time in collectives."""


@runtime_checkable
class HeteroRuntime(Protocol):
    """A runtime that runs a data-parallel Plan and can switch to another one at a step boundary."""

    @property
    def cluster(self) -> ClusterSpec | None:
        """The cluster; rank r plays ``cluster.devices[r]``."""

    @property
    def plan(self) -> Plan | None:
        """The plan being run (after ``apply_plan``, the applied one)."""

    @property
    def current_local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a weight-0 filler), if known."""

    @property
    def compression_state(self) -> CompressionState | None:
        """The gradient compression state, when the strategy compresses."""

    @property
    def records(self) -> Sequence[StepTiming]:
        """This rank's timing of each training batch."""
    def current_shares(self) -> list[int]:
        """Samples per rank of a full global batch, in rank order."""

    def next_safe_step(self) -> int:
        """The first step of the epoch no rank has produced yet (a collective)."""

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        """Run ``plan`` from step ``first_step`` of this epoch on (every rank, same arguments)."""


def runtime_of(strategy: object) -> HeteroRuntime | None:
    """The ``HeteroRuntime`` a Trainer's strategy runs (its ``run``), or None for a strategy that runs none."""
    run = getattr(strategy, "run", None)
    return run if isinstance(run, HeteroRuntime) else None
