"""The Lightning runtime: the ``hetero`` strategy and what it needs.

- ``hetero.py``      ``HeteroLogic``: the Lightning hooks (setup, steps, checkpoints)
- ``planned_run.py`` the plan a run holds: planning and broadcast, applying a new plan at a step boundary
- ``loaders.py``     the DataLoader rebuild and what a batch holds
- ``sampler.py``     ``HeteroBatchSampler``: one global order, per-rank slices by shares
- ``step_timing.py`` per-rank step records and the weighted ``reduce``
- ``protocol.py``    ``HeteroRuntime``: what callbacks may read and call on the strategy
- ``registry.py``    the classes on each Lightning package, and their registration

``HeteroStrategy`` / ``HeteroStrategyPL`` are built on first access (Lightning is
imported then, not when this package is).
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["HeteroStrategy", "HeteroStrategyPL"]


def __getattr__(name: str) -> object:
    registry = importlib.import_module("het_strategy.strategy.registry")
    if name == "HeteroStrategy":
        return registry.strategy_class("lightning.pytorch")
    if name == "HeteroStrategyPL":
        return registry.strategy_class("pytorch_lightning")
    if name in ("EmulatedDeviceCallback", "EmulatedDeviceCallbackPL"):
        warnings.warn(f"het_strategy.strategy.{name} moved to het_strategy.callbacks.emulation.{name}; the old "
                      "path goes away in the next release", DeprecationWarning, stacklevel=2)
        value = globals()[name] = getattr(importlib.import_module("het_strategy.callbacks.emulation"), name)
        return value  # warned once: later lookups find it in the module
    raise AttributeError(f"module 'het_strategy.strategy' has no attribute {name!r}")
