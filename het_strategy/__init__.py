"""het_strategy: heterogeneity-aware planning and training for Lightning and DeepSpeed.

``import het_strategy`` registers the ``hetero`` and ``hetero_deepspeed`` strategies in the
StrategyRegistry of ``lightning.pytorch`` and of ``pytorch_lightning`` (each
where installed) — Lightning has no entry point for strategies, so the import
is what makes ``Trainer(strategy="hetero")`` work — without importing either:
a namespace already imported is registered now, one imported later the moment
its import finishes (``strategy/registry.py``).  ``HeteroStrategy`` is the
``lightning.pytorch`` class (``_target_: het_strategy.HeteroStrategy`` in
Hydra), ``HeteroStrategyPL`` the ``pytorch_lightning`` one; both are built on
first use.

The folders follow the flow (imports point down this list, never up):

- ``cli/``          het-plan, het-train
- ``strategy/``     the Lightning runtime: strategy, loaders and sampler, registry
- ``ds_runtime/``   the DeepSpeed form of a Plan
- ``compression/``  DDP comm hooks, their state, the adaptive controller
- ``emulation/``    emulated device speeds and padding, shaped networks, local ranks
- ``profiling/``    probes of devices and links, per-block timing of a module
- ``report/``       the plan table and picture
- ``planning/``     the planners, re-planning, the plan of a run
- ``core/``         cluster, workload, cost model, Plan, errors (no torch)

``core/`` and ``planning/`` load neither torch nor Lightning nor DeepSpeed nor
matplotlib.
"""

import importlib as _importlib
import importlib.util

from het_strategy import _moved_modules

_registry = _importlib.import_module("het_strategy.strategy.registry")

__version__ = "0.1.0"

__all__ = ["HeteroStrategy", "HeteroStrategyPL", "HeteroDeepSpeedStrategy", "HeteroDeepSpeedStrategyPL", "__version__"]

_moved_modules.install()
_registry.register_when_imported()
_importlib.import_module("het_strategy.core.log").quiet_known_warnings()
_importlib.import_module("het_strategy.core.log").install_handler()


def __getattr__(name: str) -> object:
    """``HeteroStrategy``, ``HeteroDeepSpeedStrategy`` (and their ``...PL``): built (and registered) on first
    access; None where torch or that Lightning package is not installed (the planning core works without them)."""
    if name not in _registry.CLASS_NAMES:
        raise AttributeError(f"module 'het_strategy' has no attribute {name!r}")
    namespace = _registry.CLASS_NAMES[name][1]
    if not (_installed("torch") and _installed(namespace.split(".")[0])):
        return None
    return _registry.class_named(name)


def _installed(package: str) -> bool:
    try:
        return _importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[package] is None (import blocked)
        return False
