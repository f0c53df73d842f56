"""The callbacks the ``hetero`` strategy brings to a Trainer: its ``rebalance`` callback and, by default, telemetry.

With ``telemetry=True`` (the default) and at least one logger, the strategy calls ``attach_callbacks`` at fit
setup, on every rank, which adds ``RunReport`` (the plan, its table and picture, the bytes on the wire, every
decision as a table row), ``StepTelemetry`` (per-rank compute, communication, data time and bytes per step)
unless one is there already (a ``StragglerMitigation`` is one), and ``CompressionMonitor`` when the strategy
compresses.

Invariants: a callback of a type already present is not added again; every rank adds the same ones
(``StepTelemetry`` runs a collective every few steps); a callback added here gets the ``setup`` call and the
checkpointed state (``load_state_dict``) Lightning gave the others before the strategy's ``setup``.  This is the
one module of ``callbacks/`` that ``strategy/`` imports, and callbacks reach the strategy only through
``runtime.runtime_of``, so the dependency points one way.
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
