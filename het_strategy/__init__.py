"""het_strategy: heterogeneity-aware planning and training for Lightning and DeepSpeed.

``import het_strategy`` registers the ``hetero``, ``hetero_spawn``, ``hetero_deepspeed`` and ``hetero_diloco``
strategies in the StrategyRegistry of ``lightning.pytorch`` and of ``pytorch_lightning`` (each where installed):
Lightning has no entry point for strategies, so the import is what makes ``Trainer(strategy="hetero")`` work.
It imports neither package itself: one imported already is registered now, one imported later as soon as its
import finishes (``strategy/registry.py``).  ``HeteroStrategy`` is the ``lightning.pytorch`` class
(``_target_: het_strategy.HeteroStrategy`` in Hydra), ``HeteroStrategyPL`` the ``pytorch_lightning`` one; both
are imported on first access, and raise ``ImportError`` naming what to install when a package is missing.

The folders follow the flow (imports point down this list, never up): ``cli/`` (het-plan, het-train),
``strategy/`` (the Lightning runtime), ``callbacks/``, ``ds_runtime/`` (the DeepSpeed form of a Plan),
``diloco/``, ``compression/``, ``emulation/``, ``profiling/``, ``report/``, ``demo/``, ``tensor_parallel/``,
``moe/``, ``reference/`` (other projects' measured data and simulators), ``planning/`` and ``core/`` (cluster,
workload, cost model, Plan, errors).  ``core/`` and ``planning/`` load neither torch nor Lightning nor DeepSpeed.
"""

import importlib as _importlib

_registry = _importlib.import_module("het_strategy.strategy.registry")

__version__ = "0.3.0"

from het_strategy.tensor_parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan  # noqa: E402  (pure Python)

__all__ = ["HeteroStrategy", "HeteroStrategyPL", "HeteroDeepSpeedStrategy", "HeteroDeepSpeedStrategyPL",
           "HeteroDiLoCoStrategy", "HeteroDiLoCoStrategyPL", "HeteroFSDPStrategy", "HeteroFSDPStrategyPL",
           "PerDevicePrecision", "PerDevicePrecisionPL", "TensorParallelPlan", "Colwise", "Rowwise", "__version__"]

_registry.register_when_imported()
_importlib.import_module("het_strategy.core.log").quiet_known_warnings()
_importlib.import_module("het_strategy.core.log").install_handler()


def __getattr__(name: str) -> type:
    """The strategy and plugin classes (``HeteroStrategy``, ``PerDevicePrecisionPL``, ...), imported on first
    access; ImportError naming what to install when torch or that Lightning package is not installed."""
    if name not in _registry.CLASS_NAMES:
        raise AttributeError(f"module 'het_strategy' has no attribute {name!r}")
    return _registry.class_named(name)
