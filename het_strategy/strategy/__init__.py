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

_CLASSES = {"HeteroStrategy": "lightning.pytorch", "HeteroStrategyPL": "pytorch_lightning"}
_DEEPSPEED_CLASSES = {"HeteroDeepSpeedStrategy": "lightning.pytorch", "HeteroDeepSpeedStrategyPL": "pytorch_lightning"}


def __getattr__(name: str) -> object:
    if name in _CLASSES:
        return importlib.import_module("het_strategy.strategy.registry").strategy_class(_CLASSES[name])
    if name in _DEEPSPEED_CLASSES:
        registry = importlib.import_module("het_strategy.strategy.registry")
        return registry.deepspeed_strategy_class(_DEEPSPEED_CLASSES[name])
    if name in ("EmulatedDeviceCallback", "EmulatedDeviceCallbackPL"):
        return moved_name("het_strategy.callbacks", name, ("emulation",), old_package=__name__)
    return moved_name(__name__, name, ("step_timing", "loaders", "registry"))
