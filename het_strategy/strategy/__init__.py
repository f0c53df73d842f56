"""The Lightning runtime: the ``hetero`` strategy and what it needs.

- ``hetero.py``      ``HeteroLogic``: the Lightning hooks (setup, steps, checkpoints)
- ``planned_run.py`` the plan a run holds: planning and broadcast, applying a new plan at a step boundary
- ``loaders.py``     the DataLoader rebuild and its checks
- ``sampler.py``     ``HeteroBatchSampler``: one global order, per-rank slices by shares
- ``step_timing.py`` per-rank step records
- ``checkpoint.py``  what a checkpoint carries for the strategy
- ``protocol.py``    ``HeteroRuntime``: what callbacks may read and call on the strategy
- ``registry.py``    the classes on each Lightning package, and their registration

``HeteroStrategy`` / ``HeteroStrategyPL`` are built on first access (Lightning is
imported then, not when this package is).  0.1.0's ``het_strategy.strategy``
module names (``StepRecord``, ``HeteroDataLoader``, ``EmulatedDeviceCallback``,
``build_strategy_class``, ``register_strategies``) still resolve, with a
DeprecationWarning naming their new home.
"""

from __future__ import annotations

import importlib

from het_strategy._moved_modules import moved_name

__all__ = ["HeteroStrategy", "HeteroStrategyPL", "HeteroDeepSpeedStrategy", "HeteroDeepSpeedStrategyPL"]


def __getattr__(name: str) -> object:
    registry = importlib.import_module("het_strategy.strategy.registry")
    if name in registry.CLASS_NAMES:
        return registry.class_named(name)
    if name in ("EmulatedDeviceCallback", "EmulatedDeviceCallbackPL"):
        return moved_name("het_strategy.callbacks", name, ("emulation",), old_package=__name__)
    return moved_name(__name__, name, ("step_timing", "loaders", "registry"))
