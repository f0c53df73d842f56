"""``hetero_deepspeed``: a heterogeneous Plan (given, or planned on rank 0) run by DeepSpeed in Lightning's fit loop.

``HeteroDeepSpeedLogic`` is mixed into each Lightning package's own
``DDPStrategy`` by ``het_strategy.strategy.registry`` (``HeteroDeepSpeedStrategy``
on ``lightning.pytorch``, ``HeteroDeepSpeedStrategyPL`` on ``pytorch_lightning``;
``Trainer(strategy="hetero_deepspeed")`` after ``import het_strategy``).  Lightning's
DDP strategy launches the processes and sets up the process group (gloo on CPU);
DeepSpeed wraps that group; ``PlanRunner`` (``ds_runtime/engine.py``) then runs
this rank's part of the plan.  Lightning's own ``DeepSpeedStrategy`` is not
used: it refuses CPU, rejects per-rank gradient accumulation in the config and
has no pipeline path.

User contract (the LightningModule):

- ``pipeline_layers()`` -> the whole model as an ordered list of ``nn.Module``
  that the module owns (e.g. held in an ``nn.ModuleList``), identical on every
  rank.  The plan's stage boundaries index this list.
- ``pipeline_loss(outputs, labels)`` -> the mean loss over one micro-batch.
- ``configure_optimizers()`` returns exactly one optimizer, built over
  ``self.parameters()`` as usual (LR schedulers may come with it).  The strategy
  then keeps in its param groups only the parameters of this rank's stage (the
  same ``Parameter`` objects: DeepSpeed's pipeline module holds the user's
  layers), dropping groups left empty, and hands that optimizer to DeepSpeed.
- ``training_step`` must exist (Lightning requires it) but is NOT called: the
  strategy runs forward, backward and the optimizer step of the whole global
  batch itself (``PlanRunner.train_step``).
- Every training batch is ``(inputs, labels)`` holding the WHOLE global batch
  (DataLoader ``batch_size`` = the plan's ``global_batch_size``, checked);
  every rank gets the same batch and ``PlanRunner`` cuts out this rank's
  micro-batches.  Lightning's injected DistributedSampler is made a
  one-replica sampler: the whole dataset on every rank, in one order; as
  always under Lightning's DDP the training set is then shuffled (seed
  ``PL_GLOBAL_SEED`` / ``seed_everything``, else 0, and the epoch).  With
  ``Trainer(use_distributed_sampler=False)`` the loader is used as given
  (it must then yield the same batches on every rank).

Per training batch the strategy logs ``train_loss`` (the global-batch mean loss,
identical on every rank, so no ``sync_dist``) and keeps it unrounded in
``last_loss``; ``trainer.global_step`` advances by one.  Validation during fit
(val loaders with the same ``batch_size``; the sanity check included) runs
``PlanRunner.eval_step`` per batch and logs ``val_loss`` (epoch mean).  As
with ``training_step``, the module must define ``validation_step`` (Lightning
runs no validation loop otherwise), but it is not called.  ``runner`` is the
``PlanRunner`` (``runner.named_parameters()``: this rank's parameters by their
name in the full layer list).

Checkpoints: ``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) make
``path`` a DeepSpeed checkpoint directory; ``fit(ckpt_path=path)`` resumes
exactly, mid-epoch too (see ``deepspeed_checkpoint``).

Planning: ``plan=`` (a ``Plan`` or its JSON path) runs that plan; with
``plan=None`` rank 0 searches one (``planner.runtime=deepspeed``: only plans
this runtime runs) from ``cluster``, ``workload`` and ``global_batch_size``
(``planner_mode`` auto | dp | pipeline | hybrid) in ``setup_environment`` and
broadcasts it, so all ranks run the same plan; ``plan_summary`` says how it
compares with the unconstrained best.  On a cluster with ``emulated_speed``s
each stage's forward and backward are padded to its device's time
(``emulation.stage_padding``; ``emulate=False`` turns it off).

Supported: ``trainer.fit`` and ``trainer.validate`` after it (same Trainer);
plans of any shape with tp = 1 (``check_runnable``): aligned replicas on
DeepSpeed's own grid at ZeRO 0 or 1, asymmetric replicas (different lengths
and boundaries, ``ds_runtime.replica_engine``) at ZeRO 0; fp32
(``precision="32-true"``; DeepSpeed's CPU allreduce is fp32-only); automatic
optimization; gradient clipping by the global norm (``gradient_clipping=``;
DeepSpeed's own at ZeRO 1, the runtime's after the reduction otherwise, see
``ds_runtime/clipping.py``).

Not supported yet (refused with ``ConfigError``): ``test`` and ``predict``,
``validate`` on a fresh Trainer, a short last training batch (use
``drop_last=True``), ``trainer.gradient_clip_val``, ``accumulate_grad_batches``
> 1, manual optimization, mixed precision, live re-planning.  The non-local
layers stay (untrained) in the LightningModule of each rank: its
``state_dict`` is not the trained model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_zero_info
from het_strategy.core.plan import Plan
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec
from het_strategy.ds_runtime.engine import PlanRunner, check_runnable, init_deepspeed_distributed
from het_strategy.strategy.deepspeed_checkpoint import (CHECKPOINT_TAG, PLAN_KEY, load_plan_checkpoint,
                                                        save_plan_checkpoint)
from het_strategy.strategy.loaders import HeteroDataLoader, batch_index, check_splittable, split_loader

__all__ = ["HeteroDeepSpeedLogic", "CHECKPOINT_TAG", "PLAN_KEY"]

if TYPE_CHECKING:  # at run time the registry mixes this into each Lightning package's own DDPStrategy
    from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy
else:
    _DDPStrategy = object

def __getattr__(name: str) -> object:
    """``HeteroDeepSpeedStrategy`` / ``...PL`` built on first access (the classes' ``__module__`` is this one)."""
    if name.startswith("HeteroDeepSpeedStrategy"):
        from het_strategy.strategy.registry import CLASS_NAMES, class_named

        if name in CLASS_NAMES:
            return class_named(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_plan(plan: Any) -> Plan:
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise field_error("plan", type(plan).__name__, "be a Plan, a plan JSON path, or None (plan at setup)")


class HeteroDeepSpeedLogic(_DDPStrategy):
    """A given heterogeneous Plan trained by DeepSpeed (``PlanRunner``) in Lightning's fit loop.

    Args:
        cluster: a shipped cluster name, a YAML path, a mapping or a ``ClusterSpec``
            holding every device the plan names.
        plan: the ``Plan`` (or its JSON path) to run; ``None``: rank 0 plans at setup.
        zero_stage: ``None`` keeps the plan's (0 when planning); 0 or 1 overrides it.
        gradient_clipping: the largest global gradient norm (0 = off).
        workload: with ``plan=None``: the model's layers for the planner (a ``WorkloadSpec``, a
            shipped model name or a mapping); also prices emulated stages (default: the module's
            ``workload_config()``).
        global_batch_size: with ``plan=None``: samples per optimizer step.
        planner_mode: with ``plan=None``: auto, dp, pipeline or hybrid.
        emulate: pad stages to the cluster's ``emulated_speed``s (when it has any).
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``timeout``, ...).

    See the module docstring for what the LightningModule provides and what is supported.
    """

    strategy_name = "hetero_deepspeed"

    def __init__(self, cluster: str | Path | ClusterSpec | dict | None = None, plan: str | Path | Plan | None = None,
                 zero_stage: int | None = None, gradient_clipping: float = 0.0, *, workload: Any = None,
                 global_batch_size: int | None = None, planner_mode: str = "auto", emulate: bool = True,
                 **ddp_kwargs: Any) -> None:
        if cluster is None:
            raise field_error("cluster", None, "be a shipped cluster name, a YAML path, a mapping or a ClusterSpec")
        spec = load_cluster(cluster)
        if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in (0, 1)):
            raise field_error("zero_stage", zero_stage, "be 0, 1 or None (the plan's)")
        if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
                or not gradient_clipping >= 0 or gradient_clipping == float("inf"):
            raise field_error("gradient_clipping", gradient_clipping, "be a finite number >= 0 (0 = off)")
        self.workload: WorkloadSpec | None = None if workload is None else _load_workload(workload)
        self._planning: TrainSettings | None = None
        loaded: Plan | None = None
        if plan is None:
            from het_strategy.planning import MODES

            if self.workload is None:
                raise field_error("workload", None, "be given when plan is None (the planner prices its layers)",
                                  "pass workload= (a WorkloadSpec, a shipped model name or mapping) or plan=")
            if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
                raise field_error("global_batch_size", global_batch_size, "be an integer >= 1 when plan is None")
            if planner_mode not in MODES:
                raise field_error("planner_mode", planner_mode, f"be one of {', '.join(MODES)}")
            self._planning = TrainSettings(global_batch_size=global_batch_size, dtype="fp32",
                                           zero_stage=zero_stage or 0)
        else:
            loaded = _load_plan(plan)
            if zero_stage is not None:
                loaded = dataclasses.replace(loaded, zero_stage=zero_stage)
            self._check_plan(loaded, spec, float(gradient_clipping))
        self.planner_mode = planner_mode
        self.emulate = bool(emulate)
        super().__init__(**ddp_kwargs)
        self.cluster: ClusterSpec = spec
        self.plan: Plan | None = loaded
        """The plan run (``None`` until ``setup_environment`` when the strategy plans)."""
        self.plan_summary: str | None = None
        """With planning at setup: how the best runnable plan compares with the unconstrained best."""
        self.gradient_clipping = float(gradient_clipping)
        self.runner: PlanRunner | None = None
        self.last_loss: float | None = None
        self._batch_idx = -1

    @staticmethod
    def _check_plan(plan: Plan, cluster: ClusterSpec, gradient_clipping: float) -> None:
        if plan.zero_stage not in (0, 1):
            raise field_error("plan.zero_stage", plan.zero_stage, "be 0 or 1 in this version",
                              "pass zero_stage=0 or 1")
        if plan.dtype != "fp32":
            raise field_error("plan.dtype", plan.dtype, "be fp32 in this version (DeepSpeed's CPU allreduce "
                              "is fp32-only; mixed precision is not wired up yet)")
        names = {d.name for d in cluster.devices}
        missing = [d for d in plan.used_devices if d not in names]
        if missing:
            raise field_error("plan.cluster_devices", missing, f"name devices of cluster `{cluster.name}`",
                              "pass the cluster the plan was made for")
        check_runnable(plan)

    def _plan_on_rank_zero(self) -> Plan:
        """Rank 0 searches (``planner.runtime=deepspeed``) and broadcasts one Plan; an error stops every rank."""
        import torch.distributed as dist

        from het_strategy.core.errors import ConfigError
        from het_strategy.planning.runtimes import plan_for_runtime

        assert self._planning is not None and self.workload is not None
        payload: list[Any] = [None]
        if self.global_rank == 0:
            try:
                choice = plan_for_runtime(self.cluster, self.workload, self._planning, mode=self.planner_mode,
                                          runtime="deepspeed")
                payload[0] = ("plan", choice.plan.to_json(), choice.summary())
            except ConfigError as exc:
                payload[0] = ("error", str(exc), None)
        if dist.is_available() and dist.is_initialized() and self.world_size > 1:
            dist.broadcast_object_list(payload, src=0)
        kind, value, summary = payload[0]
        if kind == "error":
            raise ConfigError(value)
        self.plan_summary = summary
        return Plan.from_dict(json.loads(value))

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's process group (gloo on CPU); DeepSpeed wraps it
        init_deepspeed_distributed()
        if self.plan is None:
            self.plan = self._plan_on_rank_zero()
            self._check_plan(self.plan, self.cluster, self.gradient_clipping)
            rank_zero_info(self.global_rank, "hetero_deepspeed planned %d device(s), %d replica(s): %s",
                           len(self.plan.used_devices), self.plan.num_pipelines, self.plan_summary)
        used = len(self.plan.used_devices)
        if used != self.world_size:
            raise field_error("devices", self.world_size, f"equal the number of devices the plan uses ({used} of "
                              f"cluster `{self.cluster.name}`'s {self.cluster.num_devices})",
                              f"launch {used} processes, or plan for a cluster of {self.world_size} devices")
        check_runnable(self.plan, self.world_size)

    @override
    def setup(self, trainer: Any) -> None:
        fn = getattr(trainer.state.fn, "value", trainer.state.fn)
        if fn == "validate" and self.runner is not None:
            # trainer.validate after fit, same Trainer: the trained engine evaluates (validation_step below).
            # Not DDPStrategy.setup: outside fit it broadcasts rank 0's module states to every rank, which
            # would overwrite each stage's trained layers with rank 0's copies of them.
            self.accelerator.setup(trainer)
            self.model_to_device()
            self.setup_precision_plugin()
            return
        if fn != "fit":
            raise field_error("trainer function", fn, "be fit, or validate after fit on the same Trainer "
                              "(hetero_deepspeed has no test/predict, and validate needs the trained engine)")
        precision = self.precision_plugin.precision
        if precision != "32-true":
            raise field_error("precision", precision, "be 32-true (fp32) in this version")
        module = trainer.lightning_module
        if not module.automatic_optimization:
            raise field_error("automatic_optimization", False, "be true (the strategy makes the step)")
        if trainer.gradient_clip_val:
            raise field_error("Trainer.gradient_clip_val", trainer.gradient_clip_val, "be unset",
                              "pass HeteroDeepSpeedStrategy(gradient_clipping=...)")
        if trainer.accumulate_grad_batches != 1:
            raise field_error("Trainer.accumulate_grad_batches", trainer.accumulate_grad_batches,
                              "be 1 (the plan's micro-batches are the accumulation)")
        for hook in ("pipeline_layers", "pipeline_loss"):
            if not callable(getattr(module, hook, None)):
                raise field_error(f"LightningModule.{hook}", None, "be defined (see het_strategy.strategy.hetero_deepspeed)")
        super().setup(trainer)

    @override
    def configure_ddp(self) -> None:
        """Replaces DDPStrategy's: no DDP wrapper; DeepSpeed reduces the gradients (the runner is built with the
        optimizer, in ``setup_optimizers``)."""

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise field_error("configure_optimizers", f"{len(self.optimizers)} optimizers", "return exactly one")
        module = self.lightning_module
        layers = list(module.pipeline_layers())
        optimizer = self.optimizers[0]
        from het_strategy.emulation.speeds import cluster_is_emulated

        emulated = self.emulate and cluster_is_emulated(self.cluster)
        workload = self.workload
        if emulated and workload is None:
            workload = _module_workload(module)
        self.runner = PlanRunner(self.plan, layers, module.pipeline_loss, lambda params: _keep_only(optimizer, params),
                                 gradient_clipping=self.gradient_clipping,
                                 emulated_cluster=self.cluster if emulated else None, workload=workload)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replaces DDPStrategy's: every rank iterates the whole dataset in one order (PlanRunner slices)."""
        return {"num_replicas": 1, "rank": 0}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Check the global batch; the training loader becomes a ``HeteroDataLoader`` of one share (the whole
        global batch, in the order Lightning's sampler gives), whose position a checkpoint saves mid-epoch."""
        dataloader = super().process_dataloader(dataloader)
        if isinstance(dataloader, HeteroDataLoader):
            return dataloader
        batch_size = getattr(dataloader, "batch_size", None)
        global_batch = self.plan.global_batch_size
        if batch_size is not None and batch_size != global_batch:
            raise field_error("DataLoader.batch_size", batch_size,
                              f"equal the plan's global_batch_size ({global_batch}): every rank "
                              "loads the whole global batch")
        trainer = self.lightning_module.trainer
        if not isinstance(dataloader, DataLoader) or getattr(trainer.state.stage, "value", None) != "train":
            return dataloader
        check_splittable(dataloader)
        size = len(dataloader.dataset)  # type: ignore[arg-type]
        if size % global_batch and not dataloader.drop_last:
            raise field_error("DataLoader.drop_last", False, f"be True when the dataset size ({size}) is not a "
                              f"multiple of the global batch ({global_batch}): a short last batch cannot be cut "
                              "into the plan's micro-batches")
        return split_loader(dataloader, global_batch, [global_batch], 0, lambda: self._batch_idx + 1)

    @property
    def current_local_samples(self) -> int | None:
        """Samples of the global batch this rank's replica takes, counted on its first stage only (so a sum over
        ranks is the global batch; ``ThroughputMonitor`` reads it)."""
        if self.runner is None:
            return None
        return self.runner.batch.samples if self.runner.assignment.stage == 0 else 0

    # -- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.training_step: PlanRunner runs forward, backward and step of the global batch."""
        assert self.runner is not None
        inputs, labels = _pair(args[0] if args else kwargs["batch"], "training batch")
        self._batch_idx = batch_index(args, kwargs)  # the loader's saved position is the next one
        self.last_loss = self.runner.train_step(inputs, labels)
        loss = torch.tensor(self.last_loss)
        self.lightning_module.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True,
                                  batch_size=self.plan.global_batch_size)
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.backward: the backward already ran inside ``training_step``."""
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Replaces DDPStrategy.optimizer_step: the closure runs ``training_step``, which makes the DeepSpeed step."""
        return closure()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.validation_step: ``PlanRunner.eval_step`` on the global batch (the module is partial)."""
        assert self.runner is not None
        inputs, labels = _pair(args[0] if args else kwargs["batch"], "validation batch")
        loss = torch.tensor(self.runner.eval_step(inputs, labels))
        # the same value on every rank: no sync_dist needed
        self.lightning_module.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                                  batch_size=self.plan.global_batch_size, sync_dist=False)
        return loss

    # -- checkpoints ------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Replaces Strategy's: the module's state is partial here; DeepSpeed saves each stage's layers."""
        return {}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Replaces Strategy's: DeepSpeed saves the optimizer state (partitioned under ZeRO 1)."""
        return {}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Replaces DDPStrategy's (rank 0 writes one file): every rank saves its share, through DeepSpeed, into
        the directory ``filepath`` (tag ``CHECKPOINT_TAG``); Lightning's own entries ride as client state."""
        if storage_options is not None:
            raise field_error("storage_options", type(storage_options).__name__,
                              "be None (DeepSpeed writes the checkpoint directory itself)")
        assert self.runner is not None
        save_plan_checkpoint(self.runner, self.plan, checkpoint, filepath)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Lightning loads ``fit(ckpt_path=...)`` after ``setup``: the DeepSpeed engine that reads it is built in
        ``setup_optimizers`` (as Lightning's own DeepSpeedStrategy does)."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """DeepSpeed restores the optimizer state in ``load_checkpoint`` (LR schedulers are still Lightning's)."""
        return False

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Replaces Strategy's: DeepSpeed restores this rank's stage (layers and optimizer state) from the directory
        ``checkpoint_path`` that ``save_checkpoint`` wrote; returns the client state (Lightning's loops, callbacks,
        schedulers, ...).  A checkpoint of another plan is refused before anything is loaded."""
        if self.runner is None:
            raise field_error("ckpt_path", str(checkpoint_path), "be given to trainer.fit (hetero_deepspeed "
                              "resumes only into the DeepSpeed engine that fit builds)")
        strict = getattr(self.lightning_module, "strict_loading", True)
        return load_plan_checkpoint(self.runner, self.plan, checkpoint_path, strict=strict)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Replaces Strategy's: nothing to do, DeepSpeed loaded the stage's layers in ``load_checkpoint``."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Replaces Strategy's: nothing to do, DeepSpeed loaded the optimizer state in ``load_checkpoint``."""


def _load_workload(workload: Any) -> WorkloadSpec:
    from het_strategy.core.workload import load_workload

    return load_workload(workload, dtype="fp32")


def _module_workload(module: Any) -> WorkloadSpec:
    """The workload an emulated run prices stages with: the module's ``workload_config()`` (as CharGPT has)."""
    if not callable(getattr(module, "workload_config", None)):
        raise field_error("workload", None, "be given for an emulated cluster (it prices each stage), or the "
                          "LightningModule must define workload_config()", "pass workload= to the strategy")
    from het_strategy.core.workload import transformer_workload

    return transformer_workload(module.workload_config(), dtype="fp32")


def _pair(batch: Any, where: str) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise field_error(where, type(batch).__name__, "be (inputs, labels)")
    return batch[0], batch[1]


def _keep_only(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """``optimizer`` with only ``params`` (this rank's) left in its param groups, in place (schedulers keep it)."""
    local = list(params)
    ids = {id(p) for p in local}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not ids <= held:
        raise field_error("configure_optimizers", "an optimizer without some of this rank's parameters",
                          "build the optimizer over self.parameters(), which must own pipeline_layers()")
    if optimizer.state:
        raise field_error("configure_optimizers", "an optimizer with state", "return a fresh optimizer")
    groups = []
    for g in optimizer.param_groups:
        g["params"] = [p for p in g["params"] if id(p) in ids]
        if g["params"]:
            groups.append(g)
    optimizer.param_groups = groups
    return optimizer
