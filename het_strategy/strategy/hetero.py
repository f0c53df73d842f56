"""``HeteroStrategy``: the ``hetero`` Lightning strategy, DDP with uneven, planned per-rank batches.

``Trainer(strategy="hetero")`` (after ``import het_strategy``) runs ordinary DDP, plus:

1. **Cluster and plan** (``PlanHolder``, ``plan_holder.py``) — the cluster is loaded or probed at
   setup; when the training DataLoader arrives rank 0 plans the uneven split of the
   global batch and broadcasts it; ``apply_plan`` switches to a new Plan at a step.
2. **Batches** (``BatchSplitter``, ``loaders.py``, ``sampler.py``, ``user_batches.py``) — every loader
   Lightning gave a distributed sampler is rebuilt, in its own class, so rank r gets ``shares[r]``
   samples of every global batch, every sample of an epoch once (a custom batch sampler is rebuilt
   over the rank's slices); a loader Lightning left alone (``use_distributed_sampler=False``) runs as given.
3. **Exact update** — each rank's loss is scaled by ``n_r x world / N`` before
   backward, so DDP's gradient average is the gradient of the mean loss over the
   whole global batch; ``sync_dist`` logging inside a step is weighted the same way.
4. **One comm hook on every device type** (``CommHookBuilder``, ``compression_run.py``) — compression,
   the user's hook or allreduce, wrapped to pad an emulated device and timestamp when the
   last gradient bucket is ready (``StepPacing``, ``step_timing.py``).
5. **Checkpoints** (``checkpoint.py``) carry the plan being run, the loader position and the
   checkpoint format.
6. **Experts** of ``HeteroMoE`` layers are placed at setup (``ExpertPlacer``, ``experts.py``).
7. **Callbacks**: the ``rebalance`` callback and the telemetry ones are attached at fit setup
   (``het_strategy.callbacks.attach``).

The class owns one collaborator per concern and hands each the rank, world size,
device and dtype it needs (``RankContext``); it keeps no state of theirs.  It is written
on ``lightning.pytorch``; its ``pytorch_lightning`` twin is ``HeteroStrategyPL``
(``pytorch_lightning_classes.py``), so method bodies reach Lightning only through ``self``.
"""

from __future__ import annotations

import os
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader
from typing_extensions import override

from het_strategy.callbacks.attach import attach_callbacks
from het_strategy.compression import CompressionState, WireBytes, compression_config
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger, rank_debug
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.core.runtime_rules import Runtime
from het_strategy.planning.run_plan import data_parallel_plan, precision_dtype
from het_strategy.strategy.elastic import check_agent_store, gather_device_names, init_attempt_process_group
from het_strategy.strategy.per_device_precision import PER_DEVICE
from het_strategy.strategy import checkpoint as ckpt
from het_strategy.strategy.arguments import ProbeMode, check_cluster_source, check_options, check_plan_source, \
    check_timeouts, check_workload_source, planned_compression
from het_strategy.strategy.compression_run import CommHookBuilder
from het_strategy.strategy.experts import ExpertPlacer, ExpertRun, PlacementOption, check_resumable
from het_strategy.strategy.liveness import COLLECTIVE_TIMEOUT_S, HEARTBEAT_TIMEOUT_S, LivenessGuard
from het_strategy.strategy.process_exit import destroy_groups_at_exit, mark_failed
from het_strategy.strategy.loaders import BatchSplitter, LoaderMode, batch_index, is_split
from het_strategy.strategy.plan_holder import PlanHolder
from het_strategy.strategy.sampler import split_by_shares
from het_strategy.strategy.rank_context import RankContext
from het_strategy.strategy.step_timing import StepPacing

__all__ = ["HeteroStrategy", "ProbeMode"]


class HeteroStrategy(DDPStrategy):
    """DDP with uneven per-rank batches planned for a heterogeneous cluster.

    Args:
        cluster: a shipped cluster name, a YAML path, a mapping, a ``ClusterSpec``,
            or ``"auto"`` to probe the devices and links at setup (cached per host
            and device).  Rank r plays the cluster's r-th device.
        plan: a pure data-parallel plan (JSON path or ``Plan``, e.g. from
            ``het-plan planner.mode=dp``) checked against cluster, model and
            global batch; ``None`` plans at setup.
        workload: the model's costs for the planner (shipped model name, YAML,
            mapping, ``WorkloadSpec``); ``None`` estimates them from the module
            (2 x parameters x tokens FLOPs per sample).
        global_batch_size: samples per optimizer step over all ranks; ``None``
            takes the training DataLoader's ``batch_size x world size``.
        compression: gradient compression, registered on CPU/gloo as well as CUDA: a method name
            (``"adaptive"``, ``"q4"``, ``"powersgd"``, ``"topk"``, ``"fp16"``, ``"bf16"``, ``"none"``;
            ``"planned"``: the given plan's inter-node choice), a mapping of ``CompressionConfig`` fields
            (Hydra ``compression=<group>``) or a ``CompressionConfig`` (its state travels in checkpoints);
            or any DDP comm hook ``(state, bucket) -> Future``, with ``compression_state`` the state DDP hands it.
        compression_state: the state of a ``compression`` hook of the user's (None when ``compression``
            names a method: the strategy builds the state).
        rebalance: a callback (straggler mitigation) added to the Trainer's.
        emulation: honour the cluster's emulated speeds (pad compute); ``False``
            drops them (every rank plans and runs at its real speed).
        probe_cache_dir: where ``cluster="auto"`` caches its measurements.
        profile_input: with ``cluster="auto"``, what the model's ``forward`` takes
            from a batch (e.g. ``lambda batch: batch[0]``): every rank then times
            the model's forward/backward per block on its device and the planner
            uses those times.
        verbose: log the plan (and emulation) table on rank 0.
        moe_placement: ``HeteroMoE`` experts: ``"planned"``, ``"uniform"``, or one placement per layer
            (``strategy/experts.py``).
        probe: with ``cluster="auto"``: ``"cached"`` reuses this host's measurements, ``"refresh"`` measures again.
        telemetry: log the plan, per-rank step times, bytes and decisions to the Trainer's loggers
            (``het_strategy.callbacks.attach``).
        heartbeat_timeout_s: a rank that gives no heartbeat for this long is gone: every other rank ends,
            the lowest of them naming it in one line (``strategy/liveness.py``); ``None`` turns the heartbeat
            off.  The collectives' own timeout is Lightning's ``timeout=``, here ``COLLECTIVE_TIMEOUT_S``
            unless given.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``,
            ``find_unused_parameters``, ``timeout``, ``ddp_comm_wrapper``, ...).
    """

    strategy_name = "hetero"
    runtime = Runtime.hetero
    """The rule table's runtime a given plan must pass (``core.runtime_rules``)."""

    def __init__(self, cluster: str | Path | ClusterSpec | dict = "auto", plan: str | Path | Plan | None = None,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 compression: Any = None, compression_state: Any = None, rebalance: Any = None,
                 emulation: bool = True, probe_cache_dir: str | Path | None = None,
                 profile_input: Callable[[Any], Any] | None = None, verbose: bool = True,
                 moe_placement: PlacementOption = "planned", probe: ProbeMode = "cached", telemetry: bool = True,
                 heartbeat_timeout_s: float | None = HEARTBEAT_TIMEOUT_S, **ddp_kwargs: Any) -> None:
        cluster = check_cluster_source(cluster)  # bad input fails here, in the user's script, before any rank starts
        workload_spec = check_workload_source(workload)  # setup builds it again in the run's dtype
        plan = check_plan_source(plan, cluster, workload_spec, self.runtime)
        check_options(cluster, global_batch_size, emulation, profile_input, probe, telemetry)
        check_agent_store()  # ranks that name their devices run under an agent that keeps its store
        for key in ("ddp_comm_hook", "ddp_comm_state"):
            if key in ddp_kwargs:
                raise field_error(key, type(ddp_kwargs[key]).__name__, "not be given to the hetero strategy",
                                  "pass the hook as compression= and its state as compression_state=")
        hook = compression if callable(compression) else None
        config = None if hook is not None else compression_config(planned_compression(compression, plan))
        self.comm = CommHookBuilder(config, hook, compression_state, ddp_kwargs.pop("ddp_comm_wrapper", None))
        """The comm hook and the compression state."""
        check_timeouts(heartbeat_timeout_s, ddp_kwargs.get("timeout"))
        ddp_kwargs.setdefault("timeout", timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        # Lightning registers no hook without ``ddp_comm_hook``; it still reads the state (post-localSGD averaging)
        super().__init__(ddp_comm_state=compression_state if hook is not None else None, **ddp_kwargs)
        self.plans = PlanHolder(cluster, plan, workload, emulation=emulation, probe_cache_dir=probe_cache_dir,
                                probe_refresh=probe == "refresh", profile_input=profile_input, verbose=verbose,
                                planner=self.run_plan)
        """The cluster, workload and Plan of the run."""
        self.batches = BatchSplitter(global_batch_size)
        """The split loaders and the current batch's sample counts."""
        self.pacing = StepPacing()
        """This rank's step clock and emulated padding."""
        self.placer = ExpertPlacer(moe_placement, workload, plan, verbose)
        """Where the HeteroMoE layers' experts live."""
        self.rebalance, self.telemetry, self.verbose = rebalance, telemetry, verbose
        self.liveness = LivenessGuard(heartbeat_timeout_s)
        """This rank's heartbeat and watchdog (from ``setup_environment``, with more than one rank)."""
        self._saved_callback_states: dict[str, Any] | None = None
        self._in_step = False

    # -- what callbacks read (callbacks/runtime.py HeteroRuntime) -----------------------------------
    @property
    def cluster(self) -> ClusterSpec | None:
        """The cluster (from ``setup_environment`` on); rank r plays ``cluster.devices[r]``."""
        return self.plans.cluster

    @property
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
        return precision_dtype(self.precision_plugin.precision)

    def rank_context(self) -> RankContext:
        """This rank, the world size, the device and the dtype (valid once Lightning launched the ranks)."""
        return RankContext(self.global_rank, self.world_size, self.root_device, self.dtype)

    def run_plan(self, cluster: ClusterSpec, workload: WorkloadSpec, global_batch: int, dtype: str,
                 given: Plan | None, profile: MeasuredProfile | None) -> Plan:
        """The run's plan (on rank 0): ``given`` checked, or the data-parallel planner's optimum."""
        return data_parallel_plan(cluster, workload, global_batch, dtype, given, profile)

    def current_shares(self) -> list[int]:
        """Samples per rank of a full training global batch, in rank order."""
        return self.plans.current_shares(self.batches.train_sampler)

    def next_safe_step(self) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        return self.batches.next_safe_step(self.root_device)

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        """Run ``plan`` from step ``first_step`` of this epoch on (every rank, same arguments)."""
        if self.batches.train_sampler is None:
            raise ConfigError("apply_plan: " + self.batches.not_rebalanceable())
        self.plans.apply_plan(plan, first_step, self.batches.train_sampler, self.dtype)

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_distributed(self) -> None:
        """Lightning's, except under torchrun's elastic agent: each (re)start joins a process group of its own
        attempt (``elastic.init_attempt_process_group``; Lightning then finds it initialised)."""
        self.set_world_ranks()
        if init_attempt_process_group(self._get_process_group_backend(), self.global_rank, self.world_size,
                                      self._timeout):
            rank_debug(self.global_rank, "process group of restart %s", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
        super().setup_distributed()

    @override
    def setup_environment(self) -> None:
        # Lightning warns its DistributedSampler may repeat validation samples; ours evaluates each once
        warnings.filterwarnings("ignore", message=".*Using `DistributedSampler` with the dataloaders.*")
        super().setup_environment()
        # under torchrun's elastic agent each rank names its device: the cluster is the devices present
        cluster = self.plans.resolve_cluster(self.rank_context(), gather_device_names(self.world_size))
        rank_debug(self.global_rank, "setup_environment: cluster %s", cluster.name)
        self.liveness.start(self.global_rank, self.world_size, cluster.devices)
        destroy_groups_at_exit()

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
        # the experts are placed before DDP wraps the model and the optimizer is built
        self.placer.place(self.lightning_module, self.plans.require_cluster(), self.dtype, self.global_rank,
                          self.world_size)
        super().setup(trainer)
        attach_callbacks(self, trainer, self.global_rank, self.rebalance, self.telemetry,
                         self._saved_callback_states)
        rank_debug(self.global_rank, "setup: %s", trainer.state.fn)

    @override
    def configure_ddp(self) -> None:
        """Lightning's DDP wrapping, then our one comm hook, registered on every device type."""
        super().configure_ddp()
        hook = self.comm.register(self.model, self.cluster, self.world_size, self.global_rank,
                                  (self.plans.restored or {}).get("compression"), self._finish_padding,
                                  self.pacing.clock.gradients_ready,
                                  prepare_bucket=getattr(self.precision_plugin, "prepare_bucket", None),
                                  process_group=self._ddp_kwargs.get("process_group"))
        rank_debug(self.global_rank, "comm hook: %s", hook.__qualname__)

    # -- data -------------------------------------------------------------------------------------
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's DDP sampler arguments; Lightning reads them only to add its distributed sampler to the
        loader it hands over next, which the strategy then replaces by its planned split."""
        self.batches.lightning_injects()
        return super().distributed_sampler_kwargs

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Every loader Lightning gave a distributed sampler is split by the plan's shares (``loaders.py``).

        A loader Lightning left alone (``use_distributed_sampler=False``, the user's ``DistributedSampler``)
        runs as given on each rank, as under DDP.  Before the ranks are launched (``estimated_stepping_batches``
        called outside ``fit``) a loader is split evenly: its length, the steps of an epoch, is the same for
        any shares.
        """
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage.value if trainer.state.stage is not None else ""
        if not isinstance(dataloader, DataLoader) or stage == "predict" or is_split(dataloader):
            self.batches.forget_injection()
            return dataloader  # prediction keeps Lightning's sampler; ours is already split
        mode = self.batches.mode(dataloader)
        training = stage in ("train", "")  # no stage: the fit loop's data set up outside fit
        launched = dist.is_available() and dist.is_initialized()
        if mode is LoaderMode.AS_IS:
            if training and launched:
                self._keep_as_is(dataloader)
            return dataloader
        ctx = self.rank_context()
        global_batch = self.batches.global_batch(dataloader, training, ctx.world)
        if not launched:
            shares = split_by_shares(global_batch, [1] * ctx.world)
            return self.batches.split(dataloader, mode, global_batch, shares, 0, 1, None)
        if training and self.plans.ensure_plan(self.lightning_module, dataloader, global_batch, ctx,
                                               self.batch_to_device):
            self._planned(ctx)
        shares = self.plans.shares_for(self.lightning_module, dataloader, global_batch, ctx,
                                       self.batches.train_sampler)
        next_step = (lambda: self.pacing.clock.step + 1) if training else None
        loader = self.batches.split(dataloader, mode, global_batch, shares, ctx.rank, ctx.world, next_step)
        rank_debug(ctx.rank, "%s loader split (%s): global batch %d, shares %s", stage, mode.value, global_batch,
                   shares)
        return loader

    def _keep_as_is(self, dataloader: DataLoader) -> None:
        """The training loader runs as given: its batch sizes are the shares; say where they differ from the plan."""
        ctx = self.rank_context()
        sizes = self.batches.keep_as_is(dataloader, ctx.world)
        if None in sizes:
            planned = None
        else:
            global_batch = sum(s for s in sizes if s is not None)
            if self.plans.ensure_plan(self.lightning_module, dataloader, global_batch, ctx, self.batch_to_device):
                self._planned(ctx)
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

    def planned_batch_size(self, global_batch_size: int | None = None) -> int:
        """This rank's share of the training plan: the batch size to give its loader when you shard the data
        yourself (``use_distributed_sampler=False``).

        Call it on every rank once the ranks run (in ``setup``, ``train_dataloader``, ...): without a plan for
        ``global_batch_size`` yet, rank 0 plans it and broadcasts it (a collective).  ``global_batch_size`` is
        the strategy's ``global_batch_size`` when not given.
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
        if self.plans.ensure_plan(self.lightning_module, None, global_batch, ctx):
            self._planned(ctx)
        return self.plans.current_shares(self.batches.train_sampler)[ctx.rank]

    def _planned(self, ctx: RankContext) -> None:
        """A training plan was made: the emulated padding, the experts' share of it, the plan table."""
        cluster, workload, plan = self.plans.cluster, self.plans.workload, self.plans.plan
        assert cluster is not None and workload is not None and plan is not None  # invariant: ensure_plan made them
        with_experts = self.experts is not None
        rank_dtype = plan.compute_dtype(cluster.devices[ctx.rank].name)
        if self.precision_plugin.precision == PER_DEVICE:
            self.precision_plugin.use(rank_dtype, self.root_device)
            rank_debug(ctx.rank, "per-device precision: this rank computes in %s", rank_dtype)
        padding = self.pacing.emulate(cluster, ctx.rank, workload, rank_dtype, with_experts)
        self.placer.planned(plan, cluster, workload, ctx.dtype, ctx.rank, padding)
        if ctx.rank == 0 and self.verbose:
            self.plans.log_plan(ctx.dtype, with_experts)

    # -- steps --------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = batch_index(args, kwargs)
        trainer = self.lightning_module.trainer
        batch = args[0] if args else kwargs.get("batch")
        counts = self.batches.begin_batch(trainer.train_dataloader, batch_idx, batch=batch, training=True,
                                          device=self.root_device)
        self.pacing.begin(batch_idx, None if counts is None else counts[0], trainer.global_step)
        self._in_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_step = False
            self.pacing.clock.forward_done()

    def _eval_step(self, loaders: Any, step: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        dataloader_idx = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
        self.batches.begin_batch(loaders, batch_index(args, kwargs), dataloader_idx)
        self._in_step = True
        try:
            return step(*args, **kwargs)
        finally:
            self._in_step = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.val_dataloaders, super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.test_dataloaders, super().test_step, args, kwargs)

    def _finish_padding(self) -> None:
        """Pad this training batch to its emulated device's time (once; called on the last gradient bucket)."""
        if self.lightning_module.trainer.training:
            self.pacing.finish_padding(self.batches.local_samples)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self.loss_weight()
        if weight is not None:
            closure_loss = closure_loss * weight
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._finish_padding()  # when DDP skipped the sync (accumulation), no hook padded it
        samples = self.batches.local_samples
        if samples is not None and self.lightning_module.trainer.training:
            self.pacing.after_backward(samples)
        return out

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Inside a step, a mean over the whole world (``sync_dist`` logging) is weighted by each rank's samples.

        Time spent in it during a step is waiting and communication, not compute:
        it is kept out of the step's measured compute time.
        """
        start = time.perf_counter()
        counts = self.batches.counts
        try:
            if (self._in_step and counts is not None and group is None and isinstance(tensor, torch.Tensor)
                    and torch.is_floating_point(tensor) and _is_mean(reduce_op)):
                local, total = counts
                summed = super().reduce(tensor * local, group=group, reduce_op="sum")
                return summed / total
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        finally:
            if self._in_step:
                self.pacing.clock.add_collective(time.perf_counter() - start)

    def loss_weight(self) -> float | None:
        """What this rank's mean loss is multiplied by so DDP's average is the mean over the global batch."""
        return self.batches.loss_weight(self.world_size)

    # -- checkpoints ------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        return self.placer.full_state(self.lightning_module, state, self.global_rank, self.world_size)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Adds the strategy's part (``checkpoint.py``); a collective when compressing (every rank's state)."""
        plan, cluster = self.plans.plan, self.plans.cluster
        if plan is not None and cluster is not None:
            checkpoint[ckpt.CHECKPOINT_KEY] = ckpt.strategy_state(
                cluster, plan, self.current_shares(), ckpt.gather_compression(self.compression_state,
                                                                              self.world_size))
        with self.liveness.writing():  # a peer found gone meanwhile ends this rank after the file is complete
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's checkpoint, whose strategy part (format checked) and callback states the run keeps."""
        check_resumable(self.lightning_module)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self.plans.restored = ckpt.restored_state(checkpoint, checkpoint_path) or self.plans.restored
        self._saved_callback_states = checkpoint.get("callbacks")
        rank_debug(self.global_rank, "load_checkpoint: %s", checkpoint_path)
        return checkpoint


def _is_mean(reduce_op: Any) -> bool:
    if reduce_op is None or isinstance(reduce_op, str):
        return reduce_op is None or reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else False
