"""het_strategy: heterogeneity-aware planning and training for Lightning and DeepSpeed.

``import het_strategy`` registers the ``hetero`` strategy in the
StrategyRegistry of ``lightning.pytorch`` and of ``pytorch_lightning`` (each
where installed): Lightning has no entry point for strategies, so the import is
what makes ``Trainer(strategy="hetero")`` work.  ``HeteroStrategy`` is the
``lightning.pytorch`` class (``_target_: het_strategy.HeteroStrategy`` in Hydra),
``HeteroStrategyPL`` the ``pytorch_lightning`` one.

The planning core — ``cluster``, ``workload``, ``cost_model``, ``plan``,
``planning`` — imports neither torch nor Lightning nor DeepSpeed; the runtime
modules (``strategy``, ``sampler``, ``emulation``, ``probe``, ``profiling``)
import them.
"""

__version__ = "0.1.0"

try:
    import torch as _torch  # noqa: F401
except ImportError:  # the planning core still works without torch
    HeteroStrategy = HeteroStrategyPL = None
else:
    from het_strategy.strategy import HeteroStrategy, HeteroStrategyPL  # registers "hetero"

__all__ = ["HeteroStrategy", "HeteroStrategyPL", "__version__"]
