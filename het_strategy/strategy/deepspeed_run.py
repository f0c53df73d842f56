"""``DeepSpeedRun``: the ``hetero_deepspeed`` strategy's behaviour, a heterogeneous Plan run by DeepSpeed.

Lightning's DDP strategy launches the processes and sets up the process group (gloo on CPU); DeepSpeed wraps
that group; ``PlanRunner`` (``ds_runtime/engine.py``) runs this rank's part of the plan: forward, backward and
optimizer step of the whole global batch, this rank's micro-batches cut from it.  Lightning's own
``DeepSpeedStrategy`` is not used: it refuses CPU, per-rank gradient accumulation and pipelines.

Collaborators: ``DeepSpeedPlanHolder`` (the cluster and the plan: given and checked at construction, or rank 0's
search broadcast at setup), ``GlobalBatches`` (every rank loads the whole global batch), ``PlanRunner`` (built in
``setup_optimizers``), ``deepspeed_checkpoint`` (checkpoint directories carrying the plan), ``RunLifecycle``.

The LightningModule gives ``pipeline_layers()`` (the whole model as an ordered list of modules it owns),
``pipeline_loss(outputs, labels)`` and one optimizer over ``self.parameters()``, or holds a Hugging Face causal LM
that gives them (``hf.lightning_adapter``); ``training_step`` and
``validation_step`` must exist but are not called.  The user guide (docs/guide/hetero-deepspeed.md) says what is
supported and what is refused.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import torch
from typing_extensions import override

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import rank_debug, rank_zero_info
from het_strategy.core.plan import Plan
from het_strategy.core.workload import WorkloadSpec
from het_strategy.hf.lightning_adapter import expert_layout_note, pipeline_of
from het_strategy.planning.request import PlanMode
from het_strategy.strategy.constructor_args import RECORDING
from het_strategy.strategy.deepspeed_checkpoint import load_plan_checkpoint, save_plan_checkpoint
from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder, ZeroStage
from het_strategy.strategy.global_batches import SAMPLER_KWARGS, GlobalBatches, batch_pair
from het_strategy.strategy.liveness import HEARTBEAT_TIMEOUT_S
from het_strategy.strategy.loss_tokens import LossWeighting, check_weighting, resolve_weighting
from het_strategy.strategy.strategy_run import Parent, StrategyRun

__all__ = ["DeepSpeedRun"]


class DeepSpeedRun(StrategyRun):
    """A heterogeneous Plan trained by DeepSpeed (``PlanRunner``) in Lightning's fit loop.

    Args:
        cluster: a shipped cluster name, a YAML path, a mapping or a ``ClusterSpec`` holding every device the plan
            names.
        plan: the ``Plan`` (or its JSON path) to run; ``None``: rank 0 plans at setup.
        zero_stage: ``None`` keeps the plan's (0 when planning); 0 to 3 overrides it (ZeRO 2 and 3 run one-stage
            replicas only).
        gradient_clipping: the largest global gradient norm (0 = off).
        workload: the model's layers for the planner (a ``WorkloadSpec``, a shipped model name or a mapping;
            needed with ``plan=None``); also prices emulated stages (default: the module's ``workload_config()``).
        global_batch_size: with ``plan=None``: samples per optimizer step.
        planner_mode: with ``plan=None``: ``auto``, ``dp``, ``pipeline`` or ``hybrid`` (``PlanMode``).
        max_tp: with ``plan=None``: the largest tensor-parallel degree the planner may use (within a node); a
            stage at tp > 1 splits the layers that have a ``tensor_parallel_plan()``.
        emulation: honour the cluster's ``emulated_speed``s (plan with them, pad each stage to its device's time);
            ``False`` drops them.
        loss_weighting: what each micro-batch's loss is weighted by (``strategy.loss_tokens.LossWeighting``):
            ``"samples"``, ``"tokens"`` (its counted label tokens: exact for padded batches) or ``"auto"`` (tokens
            for a Hugging Face causal LM, whose pipeline loss shifts its labels; samples otherwise).
        seq_len: the tokens per sample a Hugging Face model the LightningModule holds is planned and priced at (its
            workload then comes from its config; ``workload=`` not needed).
        pretrained: a local ``save_pretrained`` directory that Hugging Face model starts from: each rank loads only
            the layers the plan gives it (``hf.checkpoints.load_rank_units``), in ``setup``, and a rank of a tp
            stage only its shards of them (read once the runner has split the layers); build the model with
            ``hf.checkpoints.empty_causal_lm(dir)`` (on the meta device) so no rank holds the whole model.
        heartbeat_timeout_s: a rank without a heartbeat for this long is gone: the others end, naming it in one
            line; ``None``: off.  Each collective's timeout is Lightning's ``timeout=``.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``timeout``, ...).
    """

    def __init__(self, cluster: str | Path | ClusterSpec | dict | None = None, plan: str | Path | Plan | None = None,
                 zero_stage: ZeroStage | None = None, gradient_clipping: float = 0.0, *,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 planner_mode: PlanMode | str = PlanMode.auto, max_tp: int = 8, emulation: bool = True,
                 seq_len: int | None = None, loss_weighting: LossWeighting | str = LossWeighting.auto,
                 heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S, pretrained: str | Path | None = None,
                 **ddp_kwargs: Any) -> None:
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
                                         max_tp=max_tp, emulation=emulation, seq_len=seq_len)
        """The cluster, the workload and the Plan of the run."""
        self.batches = GlobalBatches()
        """The loaders' check and the training loader's position."""
        self.gradient_clipping = float(gradient_clipping)
        """The largest global gradient norm (0 = off)."""
        if pretrained is not None:
            from het_strategy.hf.checkpoint_files import PretrainedDirectory

            PretrainedDirectory(pretrained, "pretrained")  # a directory without config or weights is refused here
        self.pretrained = None if pretrained is None else Path(pretrained)
        """The ``save_pretrained`` directory the Hugging Face model starts from (None: as the module built it)."""
        self.pretrained_load: Any = None
        """This rank's reads from ``pretrained`` (``hf.checkpoints.ShardLoad``: a tp stage's shards are read once the
        runner has split its layers; ``bytes_read``), set in ``setup``; None without ``pretrained``."""
        self.loss_weighting = check_weighting(loss_weighting)
        """The ``loss_weighting`` option as given (``auto`` is resolved when the runner is built)."""
        super().__init__(heartbeat_timeout_s, ddp_kwargs)
        self.runner: Any = None
        """This rank's ``PlanRunner`` (built in ``setup_optimizers``); ``runner.named_parameters()``: this rank's
        parameters by their name in the full layer list."""
        self.last_loss: float | None = None
        """The global-batch mean loss of the last training step, unrounded (the same on every rank)."""

    # -- what users and callbacks read ------------------------------------------------------------
    @property
    @override
    def cluster(self) -> ClusterSpec:
        """The run's cluster."""
        return self.plans.cluster

    @property
    @override
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

    # -- what Lightning attaches --------------------------------------------------------------------
    @override
    def precision_attached(self, plugin: Any) -> None:
        """A plan in another dtype, or a precision DeepSpeed does not run, is refused in ``Trainer(...)``."""
        self.plans.use_precision(plugin.precision)

    @override
    def checkpoint_io_attached(self, io: Any) -> None:
        """A ``CheckpointIO`` plugin (e.g. ``AsyncCheckpointIO``) is refused in ``Trainer(...)``: DeepSpeed writes
        every rank's checkpoint files itself, so the plugin would be passed over without a word."""
        # by name: the pytorch_lightning strategy meets lightning_fabric's class of the same name
        if type(io).__name__ != "TorchCheckpointIO":
            raise field_error("Trainer.plugins", type(io).__name__, "hold no CheckpointIO plugin with "
                              "hetero_deepspeed (DeepSpeed writes every rank's checkpoint files itself, "
                              "synchronously)")

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_environment(self, strategy: Any, parent: Parent) -> None:
        from het_strategy.ds_runtime.engine import init_deepspeed_distributed

        parent()  # Lightning's process group (gloo on CPU); DeepSpeed wraps it
        init_deepspeed_distributed()
        rank, world = strategy.global_rank, strategy.world_size
        # under torchrun's elastic agent each rank names its device: the cluster is the devices present
        self.plans.use_devices_present(self.lifecycle.devices_present(world))
        self.lifecycle.start(rank, world, self.cluster.devices)
        planning = self.plans.plan is None
        if planning:
            self.plans.use_module(strategy.lightning_module)
            why = self.plans.limit_tp_to(strategy.lightning_module)
            if why is not None:
                rank_zero_info(rank, "hetero_deepspeed: %s", why)
        plan = self.plans.ensure(rank, world)
        if planning:
            rank_zero_info(rank, "hetero_deepspeed planned %d device(s), %d replica(s): %s",
                           len(plan.used_devices), plan.num_pipelines, self.plan_summary)

    @override
    def setup(self, strategy: Any, parent: Parent, trainer: Any) -> None:
        fn = getattr(trainer.state.fn, "value", trainer.state.fn)
        if fn == "validate" and self.runner is not None:
            # trainer.validate after fit, same Trainer: the trained engine evaluates (validation_step below).
            # Not DDPStrategy.setup: outside fit it broadcasts rank 0's module states to every rank, which
            # would overwrite each stage's trained layers with rank 0's copies of them.
            strategy.accelerator.setup(trainer)
            strategy.model_to_device()
            strategy.setup_precision_plugin()
            return
        if fn != "fit":
            raise field_error("trainer function", fn, "be fit, or validate after fit on the same Trainer "
                              "(hetero_deepspeed has no test/predict, and validate needs the trained engine)")
        self.plans.use_precision(strategy.precision_plugin.precision)  # set when the Trainer attached it; re-checked
        _check_module(trainer)
        if self.pretrained is not None:  # before Lightning moves the module: the other ranks' layers are released
            from het_strategy.ds_runtime.replicas import replica_layout
            from het_strategy.hf.checkpoints import load_rank_units

            layout = replica_layout(self.plan)
            layers = layout.layers_of(strategy.global_rank)
            split = len(layout.group_of(strategy.global_rank)) > 1  # a tp stage: its shards read after the split
            self.pretrained_load = load_rank_units(strategy.lightning_module, self.pretrained, layers, split=split)
            rank_debug(strategy.global_rank, "hetero_deepspeed: pipeline units [%d, %d) loaded from %s", *layers,
                       self.pretrained)
        parent(trainer)

    @override
    def configure_ddp(self, strategy: Any, parent: Parent) -> None:
        """Replaces DDPStrategy's: no DDP wrapper; DeepSpeed reduces the gradients (the runner is built with the
        optimizer, in ``setup_optimizers``)."""

    @override
    def setup_optimizers(self, strategy: Any, parent: Parent, trainer: Any) -> None:
        from het_strategy.ds_runtime.engine import PlanRunner

        parent(trainer)
        if len(strategy.optimizers) != 1:
            raise field_error("configure_optimizers", f"{len(strategy.optimizers)} optimizers", "return exactly one")
        module = strategy.lightning_module
        optimizer = strategy.optimizers[0]
        cluster, workload = self.plans.stage_padding(module)
        layers, loss = pipeline_of(module)
        note = expert_layout_note(module)
        if note is not None:
            rank_zero_info(strategy.global_rank, "hetero_deepspeed: %s", note)
        tokens = resolve_weighting(self.loss_weighting, causal_lm=bool(getattr(loss, "shifts_labels", False)),
                                   rank=strategy.global_rank, runtime="hetero_deepspeed")
        self.runner = PlanRunner(self.plan, layers, loss,
                                 lambda params: _keep_only(optimizer, params), gradient_clipping=self.gradient_clipping,
                                 emulated_cluster=cluster, workload=workload, loss_tokens=tokens,
                                 load_layers=self.pretrained_load)

    def _running(self) -> Any:
        """The plan's runner, built in ``setup``."""
        if self.runner is None:
            raise ConfigError("the hetero_deepspeed strategy has no runner yet: it is built in setup (Trainer.fit, "
                              "validate or test)")
        return self.runner

    @override
    def distributed_sampler_kwargs(self, strategy: Any, parent: dict[str, Any]) -> dict[str, Any]:
        """Replaces DDPStrategy's: every rank iterates the whole dataset in one order (PlanRunner slices).  The
        loader Lightning builds next records its constructor's arguments (``constructor_args``)."""
        RECORDING.open()
        return dict(SAMPLER_KWARGS)

    @override
    def process_dataloader(self, strategy: Any, parent: Parent, dataloader: Any) -> Any:
        """Check the global batch; the training loader becomes one whose position a checkpoint saves mid-epoch."""
        dataloader = parent(dataloader)
        RECORDING.close()
        if self.plan is None:  # before the ranks are launched: every rank will load the whole global batch
            return dataloader
        training = getattr(strategy.lightning_module.trainer.state.stage, "value", None) in ("train", None)
        return self.batches.process(dataloader, self.plan.global_batch_size, training)

    # -- steps ------------------------------------------------------------------------------------
    @override
    def training_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.training_step: PlanRunner runs forward, backward and step of the global batch."""
        inputs, labels = batch_pair(args[0] if args else kwargs["batch"], "training batch")
        self.batches.record(args, kwargs)
        self.last_loss = self._running().train_step(inputs, labels)
        loss = torch.tensor(self.last_loss)
        strategy.lightning_module.log("train_loss", loss, on_step=True, on_epoch=False, prog_bar=True,
                                      batch_size=self.plans.plan.global_batch_size)
        return loss

    @override
    def backward(self, strategy: Any, parent: Parent, closure_loss: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> Any:
        """Replaces Strategy.backward: the backward already ran inside ``training_step``."""
        return closure_loss

    @override
    def optimizer_step(self, strategy: Any, parent: Parent, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """Replaces DDPStrategy.optimizer_step: the closure runs ``training_step``, which makes the DeepSpeed step."""
        return closure()

    @override
    def validation_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Replaces Strategy.validation_step: ``PlanRunner.eval_step`` on the global batch (the module is partial)."""
        inputs, labels = batch_pair(args[0] if args else kwargs["batch"], "validation batch")
        loss = torch.tensor(self._running().eval_step(inputs, labels))
        # the same value on every rank: no sync_dist needed
        strategy.lightning_module.log("val_loss", loss, on_step=False, on_epoch=True, prog_bar=True,
                                      batch_size=self.plans.plan.global_batch_size, sync_dist=False)
        return loss

    # -- checkpoints ------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self, strategy: Any, parent: Parent) -> dict[str, Any]:
        """Replaces Strategy's: the module's state is partial here; DeepSpeed saves each stage's layers."""
        return {}

    @override
    def optimizer_state(self, strategy: Any, parent: Parent, optimizer: Any) -> dict[str, Any]:
        """Replaces Strategy's: DeepSpeed saves the optimizer state (partitioned under ZeRO 1)."""
        return {}

    @override
    def save_checkpoint(self, strategy: Any, parent: Parent, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Replaces DDPStrategy's (rank 0 writes one file): every rank saves its share, through DeepSpeed, into
        the directory ``filepath``; Lightning's own entries ride as client state."""
        if storage_options is not None:
            raise field_error("storage_options", type(storage_options).__name__,
                              "be None (DeepSpeed writes the checkpoint directory itself)")
        with self.lifecycle.writing():  # a peer found gone meanwhile ends this rank after its files are complete
            save_plan_checkpoint(self._running(), self.plan, checkpoint, filepath)

    @override
    def restore_checkpoint_after_setup(self, parent: bool) -> bool:
        """Lightning loads ``fit(ckpt_path=...)`` after ``setup``: the DeepSpeed engine that reads it is built in
        ``setup_optimizers`` (as Lightning's own DeepSpeedStrategy does)."""
        return True

    @override
    def lightning_restore_optimizer(self, parent: bool) -> bool:
        """DeepSpeed restores the optimizer state in ``load_checkpoint`` (LR schedulers are still Lightning's)."""
        return False

    @override
    def load_checkpoint(self, strategy: Any, parent: Parent, checkpoint_path: Any, *args: Any,
                        **kwargs: Any) -> dict[str, Any]:
        """Replaces Strategy's: DeepSpeed restores this rank's stage (layers and optimizer state) from the directory
        ``save_checkpoint`` wrote; returns the client state (Lightning's loops, callbacks, schedulers, ...).  A
        checkpoint of another plan is refused before anything is loaded."""
        if self.runner is None:
            raise field_error("ckpt_path", str(checkpoint_path), "be given to trainer.fit (hetero_deepspeed "
                              "resumes only into the DeepSpeed engine that fit builds)")
        strict = getattr(strategy.lightning_module, "strict_loading", True)
        return load_plan_checkpoint(self.runner, self.plan, checkpoint_path, strict=strict)

    @override
    def load_model_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any, strict: bool = True) -> None:
        """Replaces Strategy's: nothing to do, DeepSpeed loaded the stage's layers in ``load_checkpoint``."""

    @override
    def load_optimizer_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any) -> None:
        """Replaces Strategy's: nothing to do, DeepSpeed loaded the optimizer state in ``load_checkpoint``."""


def _check_module(trainer: Any) -> None:
    """What the strategy's own step needs of the Trainer and the LightningModule (refused before fit starts)."""
    module = trainer.lightning_module
    if not module.automatic_optimization:
        raise field_error("automatic_optimization", False, "be true (the strategy makes the step)")
    if trainer.gradient_clip_val:
        raise field_error("Trainer.gradient_clip_val", trainer.gradient_clip_val, "be unset",
                          "pass HeteroDeepSpeedStrategy(gradient_clipping=...)")
    if trainer.accumulate_grad_batches != 1:
        raise field_error("Trainer.accumulate_grad_batches", trainer.accumulate_grad_batches,
                          "be 1 (the plan's micro-batches are the accumulation)")
    if pipeline_of(module) is None:
        hook = next(h for h in ("pipeline_layers", "pipeline_loss") if not callable(getattr(module, h, None)))
        raise field_error(f"LightningModule.{hook}", None, "be defined, or the module hold a Hugging Face causal LM "
                          "(see docs/guide/hetero-deepspeed.md)")


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
