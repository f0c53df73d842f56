"""het_strategy: heterogeneity-aware planning and training for Lightning and DeepSpeed.

``import het_strategy`` registers the ``hetero``, ``hetero_spawn``, ``hetero_deepspeed`` and ``hetero_diloco``
strategies in the StrategyRegistry of ``lightning.pytorch`` and of ``pytorch_lightning``
(each where installed) — Lightning has no entry point for strategies, so the import
is what makes ``Trainer(strategy="hetero")`` work — without importing either:
a namespace already imported is registered now, one imported later the moment
its import finishes (``strategy/registry.py``).  ``HeteroStrategy`` is the
``lightning.pytorch`` class (``_target_: het_strategy.HeteroStrategy`` in
Hydra), ``HeteroStrategyPL`` the ``pytorch_lightning`` one; both are imported on
first access, and raise ``ImportError`` naming what to install when torch or that
Lightning package is missing.

The folders follow the flow (imports point down this list, never up):

- ``cli/``          het-plan, het-train
- ``strategy/``     the Lightning runtime: strategy, loaders and sampler, registry
- ``callbacks/``    Lightning callbacks (straggler mitigation, telemetry) and what they read on the strategy
- ``diloco/``       hetero_diloco's groups, outer exchange and outer loop
- ``ds_runtime/``   the DeepSpeed form of a Plan
- ``compression/``  DDP comm hooks, their state, the adaptive controller
- ``emulation/``    emulated device speeds and padding, shaped networks, local ranks
- ``profiling/``    probes of devices and links, per-block timing of a module
- ``report/``       the plan table and picture
- ``demo/``         the main job's char GPT and its text
- ``tensor_parallel/`` a layer's tensor-parallel plan (the user contract) and its Megatron split
- ``planning/``     the planners, re-planning, the plan of a run
- ``core/``         cluster, workload, cost model, Plan, errors (no torch)

``core/`` and ``planning/`` load neither torch nor Lightning nor DeepSpeed nor
matplotlib.
"""

import importlib as _importlib

_registry = _importlib.import_module("het_strategy.strategy.registry")

__version__ = "0.2.0"

from het_strategy.tensor_parallel.plan import Colwise, Rowwise, TensorParallelPlan  # noqa: E402  (pure Python)

__all__ = ["HeteroStrategy", "HeteroStrategyPL", "HeteroDeepSpeedStrategy", "HeteroDeepSpeedStrategyPL",
           "HeteroDiLoCoStrategy", "HeteroDiLoCoStrategyPL",
           "PerDevicePrecision", "PerDevicePrecisionPL", "TensorParallelPlan", "Colwise", "Rowwise", "__version__"]

_PLUGINS = {"PerDevicePrecision": "het_strategy.strategy.per_device_precision",
            "PerDevicePrecisionPL": "het_strategy.strategy.pytorch_lightning_classes"}
"""Precision plugins (``Trainer(plugins=[...])``), per Lightning namespace: the module that holds each."""

_registry.register_when_imported()
_importlib.import_module("het_strategy.core.log").quiet_known_warnings()
_importlib.import_module("het_strategy.core.log").install_handler()


def __getattr__(name: str) -> type:
    """``HeteroStrategy``, ``HeteroDeepSpeedStrategy``, ``HeteroDiLoCoStrategy``, ``PerDevicePrecision`` (and
    their ``...PL``), imported on
    first access; ImportError naming what to install when torch or that Lightning package is not installed."""
    if name in _PLUGINS:
        return getattr(_importlib.import_module(_PLUGINS[name]), name)
    if name not in _registry.CLASS_NAMES:
        raise AttributeError(f"module 'het_strategy' has no attribute {name!r}")
    return _registry.class_named(name)
