"""``HeteroDeepSpeedStrategy``: a heterogeneous Plan (given, or planned on rank 0) run by DeepSpeed in Lightning's fit loop.

``Trainer(strategy="hetero_deepspeed")`` (after ``import het_strategy``) or
``Trainer(strategy=HeteroDeepSpeedStrategy(...))``.  The class is written on
``lightning.pytorch``'s ``DDPStrategy``; its ``pytorch_lightning`` twin is
``HeteroDeepSpeedStrategyPL`` (``pytorch_lightning_classes.py``), so method
bodies reach Lightning only through ``self`` and their arguments.  Lightning's
DDP strategy launches the processes and sets up the process group (gloo on CPU);
DeepSpeed wraps that group; ``PlanRunner`` (``ds_runtime/engine.py``) then runs
this rank's part of the plan.  Lightning's own ``DeepSpeedStrategy`` is not
used: it refuses CPU, rejects per-rank gradient accumulation in the config and
has no pipeline path.

Constructor: ``HeteroDeepSpeedStrategy(cluster, plan=None, zero_stage=None,
gradient_clipping=0.0, *, workload=None, global_batch_size=None,
planner_mode="auto", emulation=True, **ddp_kwargs)`` (see the class).

The class owns one collaborator per concern and calls them:

1. **Cluster and plan** (``DeepSpeedPlanHolder``, ``deepspeed_plan.py``): the
   given plan checked at construction, or rank 0's search broadcast at setup;
   the plan against the launched world; what each emulated stage is padded with.
2. **Batches** (``GlobalBatches``, ``global_batches.py``): every rank loads the
   whole global batch; the training loader's position for checkpoints.
3. **The step** (``PlanRunner``, ``ds_runtime/engine.py``, built in
   ``setup_optimizers``): forward, backward and optimizer step of the global
   batch, this rank's micro-batches cut from it; emulated stage padding.
4. **Checkpoints** (``deepspeed_checkpoint.py``): DeepSpeed checkpoint
   directories carrying the plan.

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
(``emulation.stage_padding``); ``emulation=False`` drops the emulated speeds
(the run plans and runs at the devices' real speeds).

Supported: ``trainer.fit`` and ``trainer.validate`` after it (same Trainer);
every plan the ``deepspeed`` rule table of ``core.runtime_rules`` accepts
(tp = 1; aligned replicas on DeepSpeed's own grid, at ZeRO 0 or 1 when they
pipeline and at any ZeRO stage as one-stage replicas; asymmetric replicas,
of different lengths and boundaries, ``ds_runtime.replica_engine``, at ZeRO
0); ``Trainer(precision=...)`` ``32-true`` (fp32), ``bf16-mixed`` (DeepSpeed's
bf16) or ``16-mixed`` (its fp16 with dynamic loss scaling; at ZeRO 0 per replica), or
``plugins=[PerDevicePrecision()]`` (each rank in its device's dtype, per replica), with
fp32 master weights, checked against the plan's dtype when the Trainer is
built (without a plan, rank 0 plans in that dtype; on CPU Lightning turns
``16-mixed`` into ``bf16-mixed``); automatic optimization; gradient clipping
by the global norm (``gradient_clipping=``; DeepSpeed's own, except for fp32
aligned pipelines at ZeRO 0 and fp32 asymmetric plans, which the runtime
clips after its own reduction, see ``ds_runtime/clipping.py``).

Refused with ``ConfigError``: ``test`` and ``predict``,
``validate`` on a fresh Trainer, a short last training batch (use
``drop_last=True``), ``trainer.gradient_clip_val``, ``accumulate_grad_batches``
> 1, manual optimization, the ``-true`` and 64-bit precisions, live
re-planning.  The non-local layers stay (untrained) in the LightningModule of
each rank: its ``state_dict`` is not the trained model.
"""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import rank_zero_info
from het_strategy.core.plan import Plan
from het_strategy.core.workload import WorkloadSpec
from het_strategy.ds_runtime.engine import PlanRunner, init_deepspeed_distributed
from het_strategy.planning.request import PlanMode
from het_strategy.strategy.arguments import check_timeouts
from het_strategy.strategy.deepspeed_checkpoint import (CHECKPOINT_TAG, PLAN_KEY, load_plan_checkpoint,
                                                        save_plan_checkpoint)
from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder, ZeroStage
from het_strategy.strategy.elastic import check_agent_store, gather_device_names
from het_strategy.strategy.global_batches import SAMPLER_KWARGS, GlobalBatches, batch_pair
from het_strategy.strategy.liveness import COLLECTIVE_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, LivenessGuard
from het_strategy.strategy.process_exit import destroy_groups_at_exit, mark_failed

__all__ = ["HeteroDeepSpeedStrategy", "CHECKPOINT_TAG", "PLAN_KEY"]


class HeteroDeepSpeedStrategy(DDPStrategy):
    """A heterogeneous Plan trained by DeepSpeed (``PlanRunner``) in Lightning's fit loop.

    Args:
        cluster: a shipped cluster name, a YAML path, a mapping or a ``ClusterSpec``
            holding every device the plan names.
        plan: the ``Plan`` (or its JSON path) to run; ``None``: rank 0 plans at setup.
        zero_stage: ``None`` keeps the plan's (0 when planning); 0 to 3 overrides it (ZeRO 2 and 3 run
            one-stage replicas only).
        gradient_clipping: the largest global gradient norm (0 = off).
        workload: the model's layers for the planner (a ``WorkloadSpec``, a shipped model name or a
            mapping; needed with ``plan=None``); also prices emulated stages (default: the module's
            ``workload_config()``).
        global_batch_size: with ``plan=None``: samples per optimizer step.
        planner_mode: with ``plan=None``: ``auto``, ``dp``, ``pipeline`` or ``hybrid`` (``PlanMode``).
        max_tp: with ``plan=None``: the largest tensor-parallel degree the planner may use (1, 2, 4 or 8; within
            a node); a stage at tp > 1 splits the layers that have a ``tensor_parallel_plan()``
            (``TensorParallelPlan``); a model none of whose layers has one is planned at tp 1.
        emulation: honour the cluster's ``emulated_speed``s (plan with them, pad each stage to its device's
            time); ``False`` drops them.
        heartbeat_timeout_s: a rank without a heartbeat for this long is gone: the others end, naming it in one
            line (``strategy/liveness.py``); ``None``: off.  Each collective's timeout is Lightning's ``timeout=``,
            ``COLLECTIVE_TIMEOUT_S`` unless given.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``timeout``, ...).

    See the module docstring for what the LightningModule provides and what is supported.
    """

    strategy_name = "hetero_deepspeed"

    def __init__(self, cluster: str | Path | ClusterSpec | dict | None = None, plan: str | Path | Plan | None = None,
                 zero_stage: ZeroStage | None = None, gradient_clipping: float = 0.0, *,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 planner_mode: PlanMode | str = PlanMode.auto, max_tp: int = 8, emulation: bool = True,
                 heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S, **ddp_kwargs: Any) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError("HeteroDeepSpeedStrategy needs DeepSpeed, which is not installed: "
                              "pip install 'het_strategy[deepspeed]'")
        if cluster is None:
            raise field_error("cluster", None, "be a shipped cluster name, a YAML path, a mapping or a ClusterSpec")
        if isinstance(gradient_clipping, bool) or not isinstance(gradient_clipping, (int, float)) \
                or not gradient_clipping >= 0 or gradient_clipping == float("inf"):
            raise field_error("gradient_clipping", gradient_clipping, "be a finite number >= 0 (0 = off)")
        # bad input fails here, in the user's script, before any rank starts
        self.plans = DeepSpeedPlanHolder(load_cluster(cluster), plan, zero_stage=zero_stage, workload=workload,
                                         global_batch_size=global_batch_size, planner_mode=planner_mode,
                                         max_tp=max_tp, emulation=emulation)
        """The cluster, the workload and the Plan of the run."""
        self.batches = GlobalBatches()
        """The loaders' check and the training loader's position."""
        self.gradient_clipping = float(gradient_clipping)
        """The largest global gradient norm (0 = off)."""
        check_timeouts(heartbeat_timeout_s, ddp_kwargs.get("timeout"))
        check_agent_store()  # ranks that name their devices run under an agent that keeps its store
        ddp_kwargs.setdefault("timeout", timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        self.liveness = LivenessGuard(heartbeat_timeout_s)
        """This rank's heartbeat and watchdog (from ``setup_environment``, with more than one rank)."""
        super().__init__(**ddp_kwargs)
        self.runner: PlanRunner | None = None
        """This rank's ``PlanRunner`` (built in ``setup_optimizers``); ``runner.named_parameters()``: this rank's
        parameters by their name in the full layer list."""
        self.last_loss: float | None = None
        """The global-batch mean loss of the last training step, unrounded (the same on every rank)."""

    # -- what users and callbacks read ------------------------------------------------------------
    @property
    def cluster(self) -> ClusterSpec:
        """The run's cluster."""
        return self.plans.cluster

    @property
    def plan(self) -> Plan | None:
        """The plan run (``None`` until ``setup_environment`` when the strategy plans)."""
        return self.plans.plan

    @property
    def plan_summary(self) -> str | None:
        """With planning at setup: how the best runnable plan compares with the unconstrained best."""
        return self.plans.plan_summary

    @property
    def current_local_samples(self) -> int | None:
        """Samples of the global batch this rank's replica takes, counted on its first stage only (so a sum over
        ranks is the global batch; ``ThroughputMonitor`` reads it)."""
        if self.runner is None:
            return None
        return self.runner.batch.samples if self.runner.assignment.stage == 0 else 0

    # -- precision --------------------------------------------------------------------------------
    @property
    @override
    def precision_plugin(self) -> Any:
        """Lightning's precision plugin; the run trains in its dtype (``DeepSpeedPlanHolder.use_precision``)."""
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        """Lightning attaches the Trainer's precision here, in ``Trainer(...)``: a plan in another dtype, or a
        precision DeepSpeed does not run, is refused there, before any rank starts."""
        _inherited_property(type(self), __class__, "precision_plugin").fset(self, plugin)
        if plugin is not None:
            self.plans.use_precision(plugin.precision)

    @property
    @override
    def checkpoint_io(self) -> Any:
        """Lightning's ``TorchCheckpointIO``, which this strategy does not write through (``save_checkpoint``)."""
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        """A ``CheckpointIO`` plugin (e.g. ``AsyncCheckpointIO``) is refused in ``Trainer(...)``: DeepSpeed writes
        every rank's checkpoint files itself, so the plugin would be passed over without a word."""
        # by name: the pytorch_lightning twin meets lightning_fabric's class of the same name
        if io is not None and type(io).__name__ != "TorchCheckpointIO":
            raise field_error("Trainer.plugins", type(io).__name__, "hold no CheckpointIO plugin with "
                              "hetero_deepspeed (DeepSpeed writes every rank's checkpoint files itself, "
                              "synchronously)")
        _inherited_property(type(self), __class__, "checkpoint_io").fset(self, io)

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # Lightning's process group (gloo on CPU); DeepSpeed wraps it
        init_deepspeed_distributed()
        # under torchrun's elastic agent each rank names its device: the cluster is the devices present
        self.plans.use_devices_present(gather_device_names(self.world_size))
        self.liveness.start(self.global_rank, self.world_size, self.cluster.devices)
        destroy_groups_at_exit()
        planning = self.plans.plan is None
        if planning:
            why = self.plans.limit_tp_to(self.lightning_module)
            if why is not None:
                rank_zero_info(self.global_rank, "hetero_deepspeed: %s", why)
        plan = self.plans.ensure(self.global_rank, self.world_size)
        if planning:
            rank_zero_info(self.global_rank, "hetero_deepspeed planned %d device(s), %d replica(s): %s",
                           len(plan.used_devices), plan.num_pipelines, self.plan_summary)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A collective that failed because a rank is gone ends with the watchdog's one line (``LivenessGuard``)."""
        super().on_exception(exception)
        mark_failed()
        self.liveness.after(exception)

    @override
    def teardown(self) -> None:
        self.liveness.stop()
        super().teardown()

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
        self.plans.use_precision(self.precision_plugin.precision)  # set when the Trainer attached it; re-checked
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
        optimizer = self.optimizers[0]
        cluster, workload = self.plans.stage_padding(module)
        self.runner = PlanRunner(self.plan, list(module.pipeline_layers()), module.pipeline_loss,
                                 lambda params: _keep_only(optimizer, params), gradient_clipping=self.gradient_clipping,
                                 emulated_cluster=cluster, workload=workload)

    def _running(self) -> PlanRunner:
        """The plan's runner, built in ``setup``."""
        if self.runner is None:
            raise ConfigError("the hetero_deepspeed strategy has no runner yet: it is built in setup (Trainer.fit, "
                              "validate or test)")
        return self.runner

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replaces DDPStrategy's: every rank iterates the whole dataset in one order (PlanRunner slices)."""
        return dict(SAMPLER_KWARGS)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Check the global batch; the training loader becomes one whose position a checkpoint saves mid-epoch."""
        dataloader = super().process_dataloader(dataloader)
        if self.plan is None:  # before the ranks are launched: every rank will load the whole global batch
            return dataloader
        training = getattr(self.lightning_module.trainer.state.stage, "value", None) in ("train", None)
        return self.batches.process(dataloader, self.plan.global_batch_size, training)

    # -- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.training_step: PlanRunner runs forward, backward and step of the global batch."""
        inputs, labels = batch_pair(args[0] if args else kwargs["batch"], "training batch")
        self.batches.record(args, kwargs)
        self.last_loss = self._running().train_step(inputs, labels)
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
        inputs, labels = batch_pair(args[0] if args else kwargs["batch"], "validation batch")
        loss = torch.tensor(self._running().eval_step(inputs, labels))
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
        with self.liveness.writing():  # a peer found gone meanwhile ends this rank after its files are complete
            save_plan_checkpoint(self._running(), self.plan, checkpoint, filepath)

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


def _inherited_property(cls: type, owner: type, name: str) -> property:
    """The property ``name`` that ``owner`` overrides, found after ``owner`` in ``cls``'s MRO (a property setter
    cannot be reached through ``super()``)."""
    mro = cls.__mro__
    for klass in mro[mro.index(owner) + 1:]:
        if isinstance(vars(klass).get(name), property):
            return vars(klass)[name]
    raise AttributeError(name)  # invariant: Lightning's Strategy defines every property the strategy overrides


def _keep_only(optimizer: torch.optim.Optimizer, params: Any) -> torch.optim.Optimizer:
    """``optimizer`` with only ``params`` (this rank's) left in its param groups, in place (schedulers keep it); a
    tensor-parallel shard takes the place of the whole parameter it was cut from (``tensor_parallel.layers.SOURCE``)."""
    from het_strategy.tensor_parallel.layers import SOURCE

    local = {id(getattr(p, SOURCE, p)): p for p in params}
    ids = set(local)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not ids <= held:
        raise field_error("configure_optimizers", "an optimizer without some of this rank's parameters",
                          "build the optimizer over self.parameters(), which must own pipeline_layers()")
    if optimizer.state:
        raise field_error("configure_optimizers", "an optimizer with state", "return a fresh optimizer")
    groups = []
    for g in optimizer.param_groups:
        g["params"] = [local[id(p)] for p in g["params"] if id(p) in ids]
        if g["params"]:
            groups.append(g)
    optimizer.param_groups = groups
    return optimizer
