"""The callbacks the ``hetero`` strategy brings to a Trainer: its ``rebalance`` callback and, by default, telemetry.

``Trainer(strategy=HeteroStrategy(...))`` with no callbacks of its own still
shows the run in its loggers: with ``telemetry=True`` (the default) and at
least one logger, the strategy calls ``attach_callbacks`` at fit setup, on
every rank, which adds

1. ``RunReport`` — the plan in the run config, the plan table and picture,
   the bytes on the wire, every straggler and compression decision as a
   table row (``run_report.py``);
2. ``StepTelemetry`` — per-rank compute, communication, data time and bytes
   per step — unless a ``StepTelemetry`` (a ``StragglerMitigation`` is one)
   is already among the Trainer's callbacks;
3. ``CompressionMonitor`` when the strategy compresses gradients.

A callback of a type already present (``het-train`` adds its own) is not
added again.  Every rank adds the same ones: ``StepTelemetry`` runs a
collective every few steps, so all ranks must have it or none.

Lightning calls the callbacks' ``setup`` and restores their checkpointed state
before the strategy's ``setup``; a callback added here gets both from this
module: its ``setup`` call, and its ``load_state_dict`` with its entry of the
checkpoint's ``callbacks`` (which the strategy keeps from its own
``load_checkpoint``).

This module is where the strategy attaches callbacks: ``strategy/`` imports
``callbacks/`` (this module and nothing else), and the callbacks reach the
strategy only through ``runtime.HeteroRuntime``, so the dependency points one way.
"""

from __future__ import annotations

from typing import Any

from het_strategy.callbacks.compression import CompressionMonitor
from het_strategy.callbacks.run_report import RunReport
from het_strategy.callbacks.runtime import HeteroRuntime
from het_strategy.callbacks.telemetry import StepTelemetry
from het_strategy.core.log import rank_debug

__all__ = ["attach_callbacks"]


def attach_callbacks(runtime: HeteroRuntime, trainer: Any, rank: int, rebalance: Any, telemetry: bool,
                     saved_states: dict[str, Any] | None) -> list[Any]:
    """Add ``rebalance`` (when given) and, with ``telemetry``, the telemetry callbacks; returns those added.

    ``saved_states``: the ``callbacks`` entry of the checkpoint being resumed (state key -> state), or None.
    """
    added = []
    if rebalance is not None and rebalance not in trainer.callbacks:
        added.append(rebalance)
    stage = str(getattr(trainer.state.fn, "value", trainer.state.fn))
    fitting = stage == "fit"
    if telemetry and fitting and trainer.loggers:
        added += _telemetry_callbacks(runtime, [*trainer.callbacks, *added])
    elif telemetry and fitting:
        rank_debug(rank, "telemetry: the Trainer has no logger; no telemetry callback added")
    for callback in added:
        trainer.callbacks.append(callback)
        callback.setup(trainer, trainer.lightning_module, stage=stage)
        state = (saved_states or {}).get(callback.state_key)
        if state:
            callback.load_state_dict(state)
    if added:
        rank_debug(rank, "callbacks added: %s", [type(c).__name__ for c in added])
    return added


def _telemetry_callbacks(runtime: HeteroRuntime, present: list[Any]) -> list[Any]:
    wanted: list[Any] = []
    if not any(isinstance(c, RunReport) for c in present):
        wanted.append(RunReport())
    if not any(isinstance(c, StepTelemetry) for c in present):
        wanted.append(StepTelemetry())
    if runtime.compression_state is not None and not any(isinstance(c, CompressionMonitor) for c in present):
        wanted.append(CompressionMonitor())
    return wanted
