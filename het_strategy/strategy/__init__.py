"""The Lightning runtime: the ``hetero`` strategy and what it needs.

- ``hetero.py``         ``HeteroStrategy``: the Lightning hooks, each handed to one collaborator
- ``plan_holder.py``    ``PlanHolder``: the cluster, workload and Plan of a run, broadcast, ``apply_plan``
- ``loaders.py``        ``BatchSplitter``: the DataLoader rebuild and its checks
- ``sampler.py``        ``HeteroBatchSampler``: one global order, per-rank slices by shares
- ``step_timing.py``    ``StepPacing``: per-rank step records and emulated padding
- ``compression_run.py`` ``CommHookBuilder``: the comm hook and the compression state
- ``experts.py``        ``ExpertPlacer``: where the HeteroMoE layers' experts live
- ``rank_context.py``   ``RankContext``: rank, world size, device and dtype handed to the collaborators
- ``checkpoint.py``     what a checkpoint carries for the strategy, and its format
- ``arguments.py``      the constructor's checks
- ``hetero_deepspeed.py`` ``HeteroDeepSpeedStrategy``, with ``deepspeed_plan.py`` (its plan),
  ``global_batches.py`` (its loaders) and ``deepspeed_checkpoint.py`` (its checkpoints)
- ``pytorch_lightning_classes.py``  the ``pytorch_lightning`` twins of the strategies
- ``registry.py``       the classes by name, and their registration in both Lightning packages

Importing this package imports neither torch nor Lightning; ``het_strategy.HeteroStrategy``
(and the other public class names) import them on first access.
"""
