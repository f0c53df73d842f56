"""The Lightning runtime: the strategies, each one package-neutral run and a thin class per Lightning package.

- ``strategy_run.py``   ``StrategyRun``: a strategy's behaviour behind Lightning's hooks, written once
- ``lightning_classes.py`` / ``pytorch_lightning_classes.py``  the written-out classes of each Lightning package,
  whose hooks hand themselves to a run; each module registers its strategies when imported
- ``registry.py``       the public classes by name, and when each package's class module is imported
- ``hetero_run.py``     ``HeteroRun`` (``hetero``): uneven DDP, each concern a collaborator:
  ``plan_holder.py`` (cluster, workload, Plan), ``loaders.py`` / ``sampler.py`` (the split loaders),
  ``step_timing.py`` (pacing), ``compression_run.py`` (the comm hook), ``expert_placer.py`` (HeteroMoE placement),
  ``checkpoint.py`` (what a checkpoint carries), ``arguments.py`` (the constructor's checks)
- ``dp_extension.py``   what an algorithm on top of uneven DP changes; ``diloco_run.py`` is ``hetero_diloco``'s
- ``deepspeed_run.py``  ``DeepSpeedRun`` (``hetero_deepspeed``), with ``deepspeed_plan.py``, ``global_batches.py``
  and ``deepspeed_checkpoint.py``
- ``lifecycle.py``      ``RunLifecycle``: heartbeat (``liveness.py``), elastic restarts (``elastic.py``), the end of
  the process (``process_exit.py``), the same for every strategy
- ``per_device_scaling.py``  what the ``PerDevicePrecision`` plugin does

Importing this package imports neither torch nor Lightning; ``het_strategy.HeteroStrategy`` (and the other
public class names) import them on first access.
"""

__all__: list[str] = []  # the package's modules are imported one by one
