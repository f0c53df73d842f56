"""``HeteroRun``: the ``hetero`` strategy's behaviour, DDP with uneven, planned per-rank batches.

``Trainer(strategy="hetero")`` runs Lightning's DDP, plus, each part owned by one collaborator:

1. **Cluster and plan** (``PlanHolder``): the cluster is loaded or probed at setup; when the training loader
   arrives rank 0 plans the uneven split of the global batch and broadcasts it; ``apply_plan`` switches plans.
2. **Batches** (``BatchSplitter``): the training loader Lightning gave a distributed sampler is rebuilt so rank r
   gets ``shares[r]`` samples of every global batch; one Lightning left alone runs as given; evaluation loaders
   are Lightning's DDP loaders, unchanged.
3. **Exact update**: each rank's loss is weighted (``DataParallelExtension.loss_weight``) by its samples, or its
   counted label tokens (``loss_weighting``, ``loss_tokens.py``), so DDP's average is the gradient of the mean loss
   over the whole global batch; ``sync_dist`` logging in a step is weighted the same way.
4. **One comm hook on every device type** (``CommHookBuilder``): compression, the user's hook or allreduce,
   wrapped to pad an emulated device and timestamp the last gradient bucket (``StepPacing``).
5. **Checkpoints** carry the plan being run, the loader position and the compression state (``checkpoint.py``).
6. **Experts** of ``HeteroMoE`` layers are placed at setup (``ExpertPlacer``); **callbacks** are attached at fit
   setup; the process's **lifecycle** is ``RunLifecycle``'s.

An ``extension`` changes what an algorithm on top of uneven DP changes (``dp_extension.py``).  The rank, world
size and device are known once Lightning launched the ranks (``setup_environment``): ``rank_context``.
"""

from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from typing_extensions import override

from het_strategy.compression import CompressionState, WireBytes, compression_config
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.dtypes import precision_dtype
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger, rank_debug
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.strategy import checkpoint as ckpt
from het_strategy.strategy.arguments import ProbeMode, check_cluster_source, check_options, check_plan_source, \
    check_workload_source, planned_compression
from het_strategy.strategy.compression_run import CommHookBuilder
from het_strategy.strategy.dp_extension import DataParallelExtension
from het_strategy.strategy.expert_placer import ExpertPlacer, ExpertRun, PlacementOption, check_resumable
from het_strategy.strategy.liveness import HEARTBEAT_TIMEOUT_S
from het_strategy.strategy.loaders import BatchSplitter, LoaderMode, batch_index, is_split
from het_strategy.strategy.loss_tokens import LossWeighting, RankLossCounts
from het_strategy.strategy.per_device_scaling import PER_DEVICE
from het_strategy.strategy.plan_holder import PlanHolder
from het_strategy.strategy.rank_context import RankContext
from het_strategy.strategy.sampler import split_by_shares
from het_strategy.strategy.step_timing import StepPacing
from het_strategy.strategy.strategy_run import Parent, StrategyRun

__all__ = ["HeteroRun", "wrap_in_ddp"]


class HeteroRun(StrategyRun):
    """DDP with uneven per-rank batches planned for a heterogeneous cluster (the ``hetero`` strategy's arguments).

    Args:
        cluster: a shipped cluster name, a YAML path, a mapping, a ``ClusterSpec``, or ``"auto"`` to probe the
            devices and links at setup (cached per host and device).  Rank r plays the cluster's r-th device.
        plan: a pure data-parallel plan (JSON path or ``Plan``, e.g. from ``het-plan planner.mode=dp``) checked
            against cluster, model and global batch; ``None`` plans at setup.
        workload: the model's costs for the planner (shipped model name, YAML, mapping, ``WorkloadSpec``);
            ``None`` estimates them from the module (2 x parameters x tokens FLOPs per sample).
        global_batch_size: samples per optimizer step over all ranks; ``None`` takes the training DataLoader's
            ``batch_size x world size``.
        compression: gradient compression on every device type: a method name (``"adaptive"``, ``"q4"``,
            ``"powersgd"``, ``"topk"``, ``"fp16"``, ``"bf16"``, ``"none"``; ``"planned"``: the given plan's
            inter-node choice), a mapping of ``CompressionConfig`` fields or a ``CompressionConfig``; or any DDP
            comm hook ``(state, bucket) -> Future``, with ``compression_state`` the state DDP hands it.
        compression_state: the state of a ``compression`` hook of the user's (None when ``compression`` names a
            method: the strategy builds the state).
        rebalance: a callback (straggler mitigation) added to the Trainer's.
        emulation: honour the cluster's emulated speeds (pad compute); ``False`` drops them.
        probe_cache_dir: where ``cluster="auto"`` caches its measurements.
        profile_input: with ``cluster="auto"``, what the model's ``forward`` takes from a batch (e.g.
            ``lambda batch: batch[0]``): every rank then times the model per block on its device.
        verbose: log the plan (and emulation) table on rank 0.
        moe_placement: ``HeteroMoE`` experts: ``"planned"``, ``"uniform"``, or one placement per layer.
        probe: with ``cluster="auto"``: ``"cached"`` reuses this host's measurements, ``"refresh"`` measures again.
        telemetry: log the plan, per-rank step times, bytes and decisions to the Trainer's loggers.
        heartbeat_timeout_s: a rank that gives no heartbeat for this long is gone: every other rank ends, the
            lowest of them naming it in one line; ``None`` turns the heartbeat off.  The collectives' own timeout
            is Lightning's ``timeout=``, ``liveness.COLLECTIVE_TIMEOUT_S`` unless given.
        extension: what an algorithm on top of uneven DP changes (``hetero_diloco``'s); None: plain uneven DP.
        loss_weighting: what each rank's loss is weighted by (``LossWeighting``): ``"samples"``, ``"tokens"`` (its
            labels' tokens ``!= -100``: exact for a loss averaged over them, as ``model(**batch).loss`` is, with
            padded batches; one small all-reduce per step), or ``"auto"``: ``tokens`` when the LightningModule holds
            a Hugging Face causal LM (its labels counted shifted, ``labels[..., 1:]``), else ``samples``.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``find_unused_parameters``,
            ``timeout``, ``ddp_comm_wrapper``, ...).
    """

    def __init__(self, cluster: str | Path | ClusterSpec | dict = "auto", plan: str | Path | Plan | None = None,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 compression: Any = None, compression_state: Any = None, rebalance: Any = None,
                 emulation: bool = True, probe_cache_dir: str | Path | None = None,
                 profile_input: Callable[[Any], Any] | None = None, verbose: bool = True,
                 moe_placement: PlacementOption = "planned", probe: ProbeMode = "cached", telemetry: bool = True,
                 heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S,
                 extension: DataParallelExtension | None = None,
                 loss_weighting: LossWeighting | str = LossWeighting.auto, **ddp_kwargs: Any) -> None:
        self.extension = extension if extension is not None else DataParallelExtension()
        """What an algorithm on top of uneven data parallelism changes (``dp_extension.py``)."""
        cluster = check_cluster_source(cluster)  # bad input fails here, in the user's script, before any rank starts
        workload_spec = check_workload_source(workload)  # setup builds it again in the run's dtype
        plan = check_plan_source(plan, cluster, workload_spec, self.extension.runtime)
        check_options(cluster, global_batch_size, emulation, profile_input, probe, telemetry)
        self.loss_counts = RankLossCounts(loss_weighting, self.extension.runtime)
        """What this rank's loss is weighted by in each batch: its samples or its counted tokens."""
        self.extension.check_sources(cluster, plan)
        for key in ("ddp_comm_hook", "ddp_comm_state"):
            if key in ddp_kwargs:
                raise field_error(key, type(ddp_kwargs[key]).__name__, "not be given to the hetero strategy",
                                  "pass the hook as compression= and its state as compression_state=")
        hook = compression if callable(compression) else None
        config = None if hook is not None else compression_config(planned_compression(compression, plan))
        self.comm = CommHookBuilder(config, hook, compression_state, ddp_kwargs.pop("ddp_comm_wrapper", None))
        """The comm hook and the compression state."""
        # Lightning registers no hook without ``ddp_comm_hook``; it still reads the state (post-localSGD averaging)
        super().__init__(heartbeat_timeout_s, {**ddp_kwargs,
                                               "ddp_comm_state": compression_state if hook is not None else None})
        self.ddp_kwargs = ddp_module_kwargs(ddp_kwargs)
        """What ``DistributedDataParallel`` is built with: the arguments given to Lightning that are DDP's."""
        self.plans = PlanHolder(cluster, plan, workload, emulation=emulation, probe_cache_dir=probe_cache_dir,
                                probe_refresh=probe == "refresh", profile_input=profile_input, verbose=verbose,
                                planner=self.extension.make_plan)
        """The cluster, workload and Plan of the run."""
        self.batches = BatchSplitter(global_batch_size)
        """The split loaders and the current batch's sample counts."""
        self.pacing = StepPacing()
        """This rank's step clock and emulated padding."""
        self.placer = ExpertPlacer(moe_placement, workload, plan, verbose)
        """Where the HeteroMoE layers' experts live."""
        self.rebalance, self.telemetry, self.verbose = rebalance, telemetry, verbose
        self.restored: dict[str, Any] | None = None
        """The strategy's part of the checkpoint being resumed from (``checkpoint.restored_state``)."""
        self.precision = "32-true"
        """The Trainer's precision (Lightning's string; ``per_device`` for ``PerDevicePrecision``)."""
        self.ctx: RankContext | None = None
        """This rank, the world size and the device (from ``setup_environment``)."""
        self._saved_callback_states: dict[str, Any] | None = None
        self._in_step = False

    # -- what callbacks read (callbacks/runtime.py HeteroRuntime) -----------------------------------
    @property
    @override
    def cluster(self) -> ClusterSpec | None:
        """The cluster (from ``setup_environment`` on); rank r plays ``cluster.devices[r]``."""
        return self.plans.cluster

    @property
    @override
    def plan(self) -> Plan | None:
        """The training plan being run (after ``apply_plan``, the applied one)."""
        return self.plans.plan

    @property
    def workload(self) -> WorkloadSpec | None:
        """The model's costs the plan was made for."""
        return self.plans.workload

    @property
    def profile(self) -> MeasuredProfile | None:
        """The model's measured per-block times, when it was profiled (``profile_input``)."""
        return self.plans.profile

    @property
    def compression_state(self) -> CompressionState | None:
        """This rank's compression state when the strategy compresses (from setup on)."""
        return self.comm.compression_state

    @property
    def wire(self) -> WireBytes:
        """This rank's gradient bytes, uncompressed and on the wire."""
        return self.comm.wire

    @property
    def records(self) -> Any:
        """This rank's ``StepRecord`` per training batch (the last 10 000)."""
        return self.pacing.clock.records

    @property
    def experts(self) -> ExpertRun | None:
        """The HeteroMoE layers and their placements (None without any)."""
        return self.placer.run

    @property
    def current_local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a filler), if known."""
        return self.batches.local_samples

    @property
    def dtype(self) -> str:
        """The training dtype as the cost model names it."""
        return precision_dtype(self.precision)

    def rank_context(self) -> RankContext:
        """This rank, the world size, the device and the dtype (once Lightning launched the ranks)."""
        if self.ctx is None:
            raise ConfigError("the hetero strategy's ranks are not launched yet (setup_environment comes first)")
        return RankContext(self.ctx.rank, self.ctx.world, self.ctx.device, self.dtype)

    def current_shares(self) -> list[int]:
        """Samples per rank of a full training global batch, in rank order."""
        return self.plans.current_shares(self.batches.train_shares())

    def next_safe_step(self) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        return self.batches.next_safe_step(self.rank_context().device)

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        """Run ``plan`` from step ``first_step`` of this epoch on (every rank, same arguments): the plan is
        checked, and the training loader takes its shares from that step."""
        if self.batches.train_shares() is None:
            raise ConfigError("apply_plan: " + self.batches.not_rebalanceable())
        shares = self.plans.apply_plan(plan, self.batches.train_global_batch(), self.dtype)
        self.batches.set_train_shares(shares, first_step)

    @override
    def precision_attached(self, plugin: Any) -> None:
        self.precision = str(plugin.precision)
        self.extension.check_precision(self.precision)

    # -- environment and setup ----------------------------------------------------------------------
    @override
    def setup_environment(self, strategy: Any, parent: Parent) -> None:
        parent()
        self.ctx = RankContext(strategy.global_rank, strategy.world_size, strategy.root_device, self.dtype)
        ctx = self.ctx
        # under torchrun's elastic agent each rank names its device: the cluster is the devices present
        cluster = self.plans.resolve_cluster(ctx, self.lifecycle.devices_present(ctx.world))
        rank_debug(ctx.rank, "setup_environment: cluster %s", cluster.name)
        self.lifecycle.start(ctx.rank, ctx.world, cluster.devices)
        self.extension.environment_ready(strategy, cluster, self.plans.plan_source, self.lifecycle.timeout)

    @override
    def teardown(self, strategy: Any, parent: Parent) -> None:
        super().teardown(strategy, parent)
        self.extension.teardown()

    @override
    def setup(self, strategy: Any, parent: Parent, trainer: Any) -> None:
        from het_strategy.callbacks.attach import attach_callbacks

        ctx = self.rank_context()
        # the experts are placed before DDP wraps the model and the optimizer is built
        self.placer.place(strategy.lightning_module, self.plans.require_cluster(), ctx.dtype, ctx.rank, ctx.world)
        self.loss_counts.resolve(strategy.lightning_module, ctx.rank)
        parent(trainer)
        attach_callbacks(self, trainer, ctx.rank, self.rebalance, self.telemetry, self._saved_callback_states)
        self.extension.setup_done(strategy, trainer)
        rank_debug(ctx.rank, "setup: %s", trainer.state.fn)

    @override
    def configure_ddp(self, strategy: Any, parent: Parent) -> None:
        """Replaces Lightning's: DDP over the extension's process group, then our one comm hook on every device
        type (Lightning registers a hook on CUDA only, and it is given none)."""
        self.extension.before_ddp(strategy)
        if self.extension.wrap_model(strategy, lambda: self._plan_at_setup(strategy)):
            self.extension.after_ddp(strategy)
            return
        kwargs = dict(self.ddp_kwargs)
        group = self.extension.ddp_process_group()
        if group is not None:
            kwargs["process_group"] = group
        strategy.model = wrap_in_ddp(strategy.model, strategy.determine_ddp_device_ids(), kwargs)
        ctx = self.rank_context()
        hook = self.comm.register(strategy.model, self.cluster, ctx.world, ctx.rank,
                                  (self.restored or {}).get("compression"), lambda: self._finish_padding(strategy),
                                  self.pacing.clock.gradients_ready,
                                  prepare_bucket=_bucket_preparation(strategy.precision_plugin),
                                  process_group=kwargs.get("process_group"))
        rank_debug(ctx.rank, "comm hook: %s", hook.__qualname__)
        self.extension.after_ddp(strategy)

    # -- data -------------------------------------------------------------------------------------
    @override
    def distributed_sampler_kwargs(self, strategy: Any, parent: dict[str, Any]) -> dict[str, Any]:
        """Lightning's DDP sampler arguments; Lightning reads them only to add its distributed sampler to the
        loader it hands over next, which the run then replaces by its planned split."""
        self.batches.lightning_injects()
        return parent

    @override
    def process_dataloader(self, strategy: Any, parent: Parent, dataloader: Any) -> Any:
        """The training loader Lightning gave a distributed sampler is split by the plan's shares (``loaders.py``).

        A training loader Lightning left alone (``use_distributed_sampler=False``, the user's
        ``DistributedSampler``) runs as given on each rank, as under DDP.  Before the ranks are launched
        (``estimated_stepping_batches`` called outside ``fit``) it is split evenly: its length, the steps of an
        epoch, is the same for any shares.

        Evaluation loaders (validation, sanity check, test, predict) stay as Lightning's DDP makes them: its
        ``DistributedSampler`` (the user's ``shuffle``, ``drop_last``, ``overfit_batches``, ``limit_*_batches``;
        each loader of a ``CombinedLoader``), equal shares on every rank.  Evaluation has no backward and no
        gradient sync, so the speed-weighted split matters less there than the samplers' attributes and the
        ``sync_dist`` metrics being DDP's.
        """
        dataloader = parent(dataloader)
        module = strategy.lightning_module
        state = module.trainer.state
        stage = state.stage.value if state.stage is not None else ""
        training = stage in ("train", "")  # no stage: the fit loop's data set up outside fit
        if not isinstance(dataloader, DataLoader) or not training or is_split(dataloader):
            self.batches.forget_injection()
            return dataloader  # evaluation keeps DDP's sampler; ours is already split
        mode = self.batches.mode(dataloader)
        launched = dist.is_available() and dist.is_initialized()
        if mode is LoaderMode.AS_IS:
            if launched:
                self._keep_as_is(strategy, dataloader)
            return dataloader
        if not launched:
            world = strategy.world_size
            global_batch = self.batches.global_batch(dataloader, world)
            return self.batches.split(dataloader, mode, global_batch, split_by_shares(global_batch, [1] * world),
                                      0, 1, None)
        ctx = self.rank_context()
        global_batch = self.batches.global_batch(dataloader, ctx.world)
        if self.plans.ensure_plan(module, dataloader, global_batch, ctx, strategy.batch_to_device, self.restored):
            self._planned(strategy)
        shares = self.plans.shares_for(global_batch, ctx.world, self.batches.train_shares())
        loader = self.batches.split(dataloader, mode, global_batch, shares, ctx.rank, ctx.world,
                                    lambda: self.pacing.clock.step + 1)
        rank_debug(ctx.rank, "training loader split (%s): global batch %d, shares %s", mode.value, global_batch,
                   shares)
        return loader

    def _keep_as_is(self, strategy: Any, dataloader: DataLoader) -> None:
        """The training loader runs as given: its batch sizes are the shares; say where they differ from the plan."""
        ctx = self.rank_context()
        sizes = self.batches.keep_as_is(dataloader, ctx.world)
        planned = None
        if None not in sizes:
            global_batch = sum(s for s in sizes if s is not None)
            if self.plans.ensure_plan(strategy.lightning_module, dataloader, global_batch, ctx,
                                      strategy.batch_to_device, self.restored):
                self._planned(strategy)
            planned = self.plans.current_shares(None)
        if ctx.rank != 0:
            return
        logger.info("hetero: Lightning added no distributed sampler (use_distributed_sampler=False, or your own "
                    "DistributedSampler): each rank trains on its loader as given, batch sizes %s; the strategy "
                    "cannot move samples between ranks in this mode", sizes)
        if planned is not None and planned != sizes:
            logger.warning("hetero: the ranks' batch sizes %s differ from the plan's shares %s for the global "
                           "batch %d: build rank r's loader with strategy.planned_batch_size() for the planned "
                           "speed-up", sizes, planned, sum(planned))

    def planned_batch_size(self, strategy: Any, global_batch_size: int | None = None) -> int:
        """This rank's share of the training plan: the batch size to give its loader when you shard the data
        yourself (``use_distributed_sampler=False``).

        Call it on every rank once the ranks run (in ``setup``, ``train_dataloader``, ...), as
        ``trainer.strategy.planned_batch_size()``: without a plan for ``global_batch_size`` yet, rank 0 plans it
        and broadcasts it (a collective).  ``global_batch_size`` is the strategy's
        ``global_batch_size`` when not given.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("planned_batch_size() needs the launched ranks: call it from a hook that runs "
                              "during fit (setup, train_dataloader, configure_optimizers)")
        global_batch = global_batch_size or self.batches.global_batch_size
        if global_batch is None:
            if self.plan is None:
                raise field_error("global_batch_size", None, "be given (to planned_batch_size or the strategy) "
                                  "before a training plan exists")
            global_batch = self.plan.global_batch_size
        ctx = self.rank_context()
        if self.plans.ensure_plan(strategy.lightning_module, None, global_batch, ctx, None, self.restored):
            self._planned(strategy)
        return self.current_shares()[ctx.rank]

    def _plan_at_setup(self, strategy: Any) -> Plan:
        """The training plan before any loader exists (the global batch given to the strategy, or the given
        plan's): made now by rank 0 and broadcast (a collective) unless restored or made already."""
        global_batch = self.batches.global_batch_size or getattr(self.plans.plan_source, "global_batch_size", None)
        if global_batch is None:
            raise field_error("global_batch_size", None, "be given (or a plan) when the model is wrapped by its "
                              "plan in setup, before the DataLoaders exist")
        ctx = self.rank_context()
        if self.plans.ensure_plan(strategy.lightning_module, None, global_batch, ctx, None, self.restored):
            self._planned(strategy)
        assert self.plans.plan is not None  # invariant: ensure_plan made or kept one
        return self.plans.plan

    def _planned(self, strategy: Any) -> None:
        """A training plan was made: the emulated padding, the experts' share of it, the plan table."""
        ctx = self.rank_context()
        cluster, workload, plan = self.plans.cluster, self.plans.workload, self.plans.plan
        assert cluster is not None and workload is not None and plan is not None  # invariant: ensure_plan made them
        self.extension.plan_ready(plan)
        with_experts = self.experts is not None
        rank_dtype = plan.compute_dtype(cluster.devices[ctx.rank].name)
        if self.precision == PER_DEVICE:
            strategy.precision_plugin.scaling.use(rank_dtype, ctx.device)
            rank_debug(ctx.rank, "per-device precision: this rank computes in %s", rank_dtype)
        padding = self.pacing.emulate(cluster, ctx.rank, workload, rank_dtype, with_experts)
        self.placer.planned(plan, cluster, workload, ctx.dtype, ctx.rank, padding)
        if ctx.rank == 0 and self.verbose:
            self.plans.log_plan(ctx.dtype, with_experts)

    # -- steps --------------------------------------------------------------------------------------
    @override
    def training_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        batch_idx = batch_index(args, kwargs)
        trainer = strategy.lightning_module.trainer
        batch = args[0] if args else kwargs.get("batch")
        counts = self.batches.begin_batch(trainer.train_dataloader, batch_idx, batch=batch, training=True,
                                          device=strategy.root_device)
        self.loss_counts.begin_batch(batch, counts, strategy.global_rank)
        self.pacing.begin(batch_idx, None if counts is None else counts[0], trainer.global_step)
        self._in_step = True
        try:
            return parent(*args, **kwargs)
        finally:
            self._in_step = False
            self.pacing.clock.forward_done()

    def _eval_step(self, loaders: Any, parent: Parent, args: tuple, kwargs: dict) -> Any:
        dataloader_idx = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
        counts = self.batches.begin_batch(loaders, batch_index(args, kwargs), dataloader_idx)
        self.loss_counts.begin_batch(args[0] if args else kwargs.get("batch"), counts, None)  # labels optional there
        self._in_step = True
        try:
            return parent(*args, **kwargs)
        finally:
            self._in_step = False

    @override
    def validation_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(strategy.lightning_module.trainer.val_dataloaders, parent, args, kwargs)

    @override
    def test_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(strategy.lightning_module.trainer.test_dataloaders, parent, args, kwargs)

    def _finish_padding(self, strategy: Any) -> None:
        """Pad this training batch to its emulated device's time (once; called on the last gradient bucket)."""
        if strategy.lightning_module.trainer.training:
            self.pacing.finish_padding(self.batches.local_samples)

    @override
    def backward(self, strategy: Any, parent: Parent, closure_loss: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> Any:
        counts = self.loss_counts.counts(self.batches.counts, strategy.root_device, summed=False)
        if counts is not None:
            weight = self.extension.loss_weight(counts, strategy.world_size, strategy.root_device)
            closure_loss = self.loss_counts.weighted(closure_loss, weight)
        out = parent(closure_loss, optimizer, *args, **kwargs)
        self._finish_padding(strategy)  # when DDP skipped the sync (accumulation), no hook padded it
        samples = self.batches.local_samples
        if samples is not None and strategy.lightning_module.trainer.training:
            self.pacing.after_backward(samples)
        return out

    @override
    def optimizer_step(self, strategy: Any, parent: Parent, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        out = parent(optimizer, closure, model, **kwargs)
        if strategy.lightning_module.trainer.training:
            self.extension.after_optimizer_step(strategy)
        return out

    @override
    def reduce(self, strategy: Any, parent: Parent, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Inside a step, a mean over the whole world (``sync_dist`` logging) is weighted by each rank's samples
        (or counted tokens: ``loss_weighting``).

        Time spent in it during a step is waiting and communication, not compute: it is kept out of the step's
        measured compute time.
        """
        start = time.perf_counter()
        try:
            weighted = (self._in_step and group is None and isinstance(tensor, torch.Tensor)
                        and torch.is_floating_point(tensor) and _is_mean(reduce_op))
            counts = self.loss_counts.counts(self.batches.counts, strategy.root_device, summed=True) if weighted \
                else None
            if counts is not None:
                local, total = counts
                summed = parent(tensor * local, group=group, reduce_op="sum")
                return summed / total
            return parent(tensor, group=group, reduce_op=reduce_op)
        finally:
            if self._in_step:
                self.pacing.clock.add_collective(time.perf_counter() - start)

    @override
    def on_train_end(self, strategy: Any, parent: Parent) -> None:
        self.extension.train_end(strategy)
        parent()

    @override
    def on_validation_start(self, strategy: Any, parent: Parent) -> None:
        parent()
        self.extension.validation_start(strategy)

    @override
    def on_validation_end(self, strategy: Any, parent: Parent) -> None:
        self.extension.validation_end(strategy)
        parent()

    # -- checkpoints ------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self, strategy: Any, parent: Parent) -> dict[str, Any]:
        """The module's state (the extension's view of it) with every rank's HeteroMoE experts."""
        def state_of() -> dict[str, Any]:
            return self.placer.full_state(strategy.lightning_module, parent(), strategy.global_rank,
                                          strategy.world_size)

        return self.extension.module_state(state_of)

    @override
    def save_checkpoint(self, strategy: Any, parent: Parent, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Adds the run's part (``checkpoint.py``) and the extension's; a collective when compressing."""
        self.extension.add_to_checkpoint(strategy, checkpoint)
        plan, cluster = self.plans.plan, self.plans.cluster
        if plan is not None and cluster is not None:
            checkpoint[ckpt.CHECKPOINT_KEY] = ckpt.strategy_state(
                cluster, plan, self.current_shares(), ckpt.gather_compression(self.compression_state,
                                                                              strategy.world_size))
        with self.lifecycle.writing():  # a peer found gone meanwhile ends this rank after the file is complete
            self.extension.write_checkpoint(strategy, checkpoint, filepath,
                                            lambda c, f: parent(c, f, storage_options=storage_options))

    @override
    def load_checkpoint(self, strategy: Any, parent: Parent, checkpoint_path: Any, *args: Any,
                        **kwargs: Any) -> dict[str, Any]:
        """Lightning's checkpoint, whose strategy part (format checked) and callback states the run keeps."""
        check_resumable(strategy.lightning_module)
        checkpoint = self.extension.read_checkpoint(strategy, checkpoint_path,
                                                    lambda path: parent(path, *args, **kwargs))
        self.restored = ckpt.restored_state(checkpoint, checkpoint_path) or self.restored
        self._saved_callback_states = checkpoint.get("callbacks")
        self.extension.checkpoint_loaded(checkpoint, checkpoint_path)
        rank_debug(strategy.global_rank, "load_checkpoint: %s", checkpoint_path)
        return checkpoint

    @override
    def load_model_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any, strict: bool = True) -> None:
        if not self.extension.loaded_state_itself():
            parent(checkpoint, strict=strict)
        self.extension.model_state_loaded(strategy)

    @override
    def load_optimizer_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any) -> None:
        if not self.extension.loaded_state_itself():
            parent(checkpoint)
        self.extension.optimizer_state_loaded(strategy)

    @override
    def restore_checkpoint_after_setup(self, parent: bool) -> bool:
        """After setup when the extension reads checkpoints into the model as it wrapped it."""
        return parent or self.extension.restores_after_setup

    @override
    def lightning_restore_optimizer(self, parent: bool) -> bool:
        return parent and not self.extension.loaded_state_itself()


_DDP_ARGUMENTS = frozenset(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self", "module"}


def ddp_module_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of Lightning's ``DDPStrategy(**kwargs)`` that it hands ``DistributedDataParallel``: those
    ``DistributedDataParallel.__init__`` takes."""
    return {k: v for k, v in kwargs.items() if k in _DDP_ARGUMENTS}


def wrap_in_ddp(module: torch.nn.Module, device_ids: list[int] | None, kwargs: dict[str, Any]
                ) -> DistributedDataParallel:
    """``module`` in ``DistributedDataParallel``, built on a side stream on CUDA (as Lightning's DDP builds it:
    https://pytorch.org/docs/stable/notes/cuda.html#id5)."""
    with torch.cuda.stream(torch.cuda.Stream()) if device_ids is not None else nullcontext():
        return DistributedDataParallel(module=module, device_ids=device_ids, **kwargs)


def _bucket_preparation(plugin: Any) -> Callable[[Any], None] | None:
    """What runs on each gradient bucket before it is reduced: ``PerDevicePrecision`` unscales an fp16 rank's."""
    scaling = getattr(plugin, "scaling", None)
    return None if scaling is None else scaling.prepare_bucket


def _is_mean(reduce_op: Any) -> bool:
    if reduce_op is None or isinstance(reduce_op, str):
        return reduce_op is None or reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else False
