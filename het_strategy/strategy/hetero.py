"""The ``hetero`` Lightning strategy: DDP with uneven, planned per-rank batches — the Lightning hooks.

``Trainer(strategy="hetero")`` (after ``import het_strategy``) runs ordinary DDP, plus:

1. **Cluster and plan** (``planned_run.py``) — the cluster is loaded or probed at
   setup; when the training DataLoader arrives rank 0 plans the uneven split of the
   global batch and broadcasts it; ``apply_plan`` switches to a new Plan at a step.
2. **Batches** (``loaders.py``, ``sampler.py``) — every loader is rebuilt so rank r
   gets ``shares[r]`` samples of every global batch, every sample of an epoch once.
3. **Exact update** — each rank's loss is scaled by ``n_r x world / N`` before
   backward, so DDP's gradient average is the gradient of the mean loss over the
   whole global batch; ``sync_dist`` logging inside a step is weighted the same way.
4. **One comm hook on every device type** — compression, the user's hook or
   allreduce, wrapped to pad an emulated device and timestamp when the last
   gradient bucket is ready (``emulation/padding.py``, ``step_timing.py``).
5. **Checkpoints** (``checkpoint.py``) carry the plan being run and the loader position.
6. **Experts** of ``HeteroMoE`` layers are placed at setup (``experts.py``).
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from typing_extensions import override

from het_strategy.compression import CompressionState, WireBytes, compression_config, counted_comm_hook
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_debug
from het_strategy.core.plan import Plan
from het_strategy.core.workload import WorkloadSpec
from het_strategy.emulation.padding import padded_comm_hook
from het_strategy.strategy import checkpoint as ckpt
from het_strategy.strategy.arguments import check_cluster_source, check_options, check_plan_source, \
    planned_compression
from het_strategy.strategy.compression_run import CompressionRun, build_compression
from het_strategy.strategy.loaders import HeteroDataLoader, batch_index, check_same_order, check_splittable, \
    loader_at, split_loader
from het_strategy.strategy.experts import MoERun
from het_strategy.strategy.planned_run import PlannedRun
from het_strategy.strategy.run_callbacks import attach_callbacks
from het_strategy.strategy.sampler import HeteroBatchSampler
from het_strategy.strategy.step_timing import StepClock

__all__ = ["HeteroLogic"]


class HeteroLogic(MoERun, PlannedRun):
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
            or any DDP comm hook ``(state, bucket) -> Future`` with its ``compression_state``.
        rebalance: a callback (straggler mitigation) added to the Trainer's.
        emulation: honour the cluster's emulated speeds (pad compute); ``False``
            drops them (every rank plans and runs at its real speed).
        probe_cache_dir: where ``cluster="auto"`` caches its measurements.
        profile_input: with ``cluster="auto"``, what the model's ``forward`` takes
            from a batch (e.g. ``lambda batch: batch[0]``): every rank then times
            the model's forward/backward per block on its device and the planner
            uses those times.
        verbose: print the plan (and emulation) table on rank 0.
        moe_placement: ``HeteroMoE`` experts: ``"planned"``, ``"uniform"``, or per layer (``strategy/experts.py``).
        probe: with ``cluster="auto"``: ``"cached"`` reuses this host's measurements, ``"refresh"`` measures again.
        telemetry: log the plan, per-rank step times, bytes and decisions to the Trainer's loggers (``run_callbacks.py``).
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``,
            ``find_unused_parameters``, ``timeout``, ...).
    """

    strategy_name = "hetero"

    def __init__(self, cluster: str | Path | ClusterSpec | dict = "auto", plan: str | Path | Plan | None = None,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 compression: Callable | None = None, compression_state: Any = None, rebalance: Any = None,
                 emulation: bool = True, probe_cache_dir: str | Path | None = None,
                 profile_input: Callable[[Any], Any] | None = None, verbose: bool = True,
                 moe_placement: Any = "planned", probe: str = "cached", telemetry: bool = True,
                 **ddp_kwargs: Any) -> None:
        cluster = check_cluster_source(cluster)  # bad input fails here, in the user's script, before any rank starts
        plan = check_plan_source(plan)
        check_options(cluster, global_batch_size, emulation, profile_input, probe, telemetry)
        self._compression_config = None if callable(compression) else compression_config(planned_compression(
            compression, plan))
        if self._compression_config is not None and compression_state is not None:
            raise field_error("compression_state", type(compression_state).__name__,
                              "be None when `compression` names a method (the strategy builds the state)")
        hook = compression if callable(compression) else None
        super().__init__(ddp_comm_hook=hook, ddp_comm_state=compression_state, **ddp_kwargs)
        self._cluster_source, self._plan_source, self._workload_source = cluster, plan, workload
        self._global_batch_size, self._rebalance, self._emulation_on = global_batch_size, rebalance, emulation
        self._probe_cache_dir, self._profile_input, self._verbose = probe_cache_dir, profile_input, verbose
        self._probe_refresh, self._telemetry = probe == "refresh", telemetry
        self._moe_placement = moe_placement
        self.compression_state: CompressionState | None = None
        self._compression_run: CompressionRun | None = None
        self.cluster = self.plan = self._eval_plan = self.train_sampler = self.experts = None
        self.workload = self.profile = self.padding = None
        self.clock, self.wire = StepClock(), WireBytes()  # this rank's step times; its gradient bytes
        self._restored: dict[str, Any] | None = None
        self._counts: tuple[int, int] | None = None  # (this rank's samples, all ranks') of the current batch
        self._in_step = False

    @property
    def records(self) -> Any:  # this rank's ``StepRecord`` per training batch (the last 10 000)
        return self.clock.records

    # -- setup ------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        # Lightning warns its DistributedSampler may repeat validation samples; ours evaluates each once
        warnings.filterwarnings("ignore", message=".*Using `DistributedSampler` with the dataloaders.*")
        super().setup_environment()
        if self.cluster is None:  # once per strategy: a later trainer.validate/test keeps the cluster
            self.cluster = self.resolve_cluster()
            self.cap_emulated_memory()
        rank_debug(self.global_rank, "setup_environment: cluster %s", self.cluster.name)

    @override
    def setup(self, trainer: Any) -> None:
        self.place_experts()  # before DDP wraps the model and the optimizer is built
        super().setup(trainer)
        attach_callbacks(self, trainer, self._rebalance, self._telemetry)  # the rebalance and telemetry callbacks
        rank_debug(self.global_rank, "setup: %s", trainer.state.fn)

    @override
    def _register_ddp_hooks(self) -> None:
        """Replaces DDPStrategy's: registers the comm hook on every device type (Lightning does only on CUDA)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner = self._ddp_comm_hook or allreduce_hook
        state = self._ddp_comm_state if self._ddp_comm_hook is not None else None
        if self._compression_config is not None and self._compression_config.method != "none":
            if self._compression_run is None:  # a later trainer.validate/test keeps the fitted state
                self._compression_run = build_compression(self.model, self._compression_config, self.cluster,
                                                          self.world_size, self.global_rank,
                                                          (self._restored or {}).get("compression"))
                self.compression_state = self._compression_run.compression_state
            inner, state = self._compression_run.hook, self._compression_run.hook_state
        hook = padded_comm_hook(counted_comm_hook(inner, self.wire), self._finish_padding, self.clock.gradients_ready)
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(state=state, hook=hook)
        rank_debug(self.global_rank, "comm hook: %s", hook.__qualname__)

    # -- data -------------------------------------------------------------------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage.value if trainer.state.stage is not None else ""
        if stage == "predict" or isinstance(dataloader, HeteroDataLoader):
            return dataloader  # prediction keeps Lightning's sampler; ours is already split
        check_splittable(dataloader)
        training = stage == "train"
        if training and self._global_batch_size is not None:
            global_batch = self._global_batch_size
        elif dataloader.batch_size is None:
            raise field_error("DataLoader.batch_size", None, "be set (per-rank size; the global batch is "
                              "batch_size x world size)", "or pass HeteroStrategy(global_batch_size=...)")
        else:
            global_batch = int(dataloader.batch_size) * self.world_size
        if training:
            self.ensure_plan(dataloader, global_batch)
        loader = split_loader(dataloader, global_batch, self.shares_for(dataloader, global_batch),
                              self.global_rank, (lambda: self.clock.step + 1) if training else None)
        sampler: HeteroBatchSampler = loader.batch_sampler  # type: ignore[assignment]
        if sampler.sampler.base_sampler is not None:
            check_same_order(sampler, self.world_size)
        if training:
            self.train_sampler = sampler
        rank_debug(self.global_rank, "%s loader split: global batch %d, shares %s", stage, global_batch,
                   list(sampler.shares))
        return loader

    # -- steps --------------------------------------------------------------------------------------
    def _begin_batch(self, loaders: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        sampler = getattr(loader_at(loaders, dataloader_idx), "batch_sampler", None)
        self._counts = sampler.step_counts(batch_idx) if isinstance(sampler, HeteroBatchSampler) else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = batch_index(args, kwargs)
        trainer = self.lightning_module.trainer
        self._begin_batch(trainer.train_dataloader, batch_idx)
        self.clock.begin(batch_idx)
        if self.padding is not None and self._counts is not None:
            self.padding.begin(self._counts[0], trainer.global_step)
        self._in_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._in_step = False
            self.clock.forward_done()

    def _eval_step(self, loaders: Any, name: str, args: tuple, kwargs: dict) -> Any:
        dataloader_idx = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
        self._begin_batch(loaders, batch_index(args, kwargs), dataloader_idx)
        self._in_step = True
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self._in_step = False

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.val_dataloaders, "validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.test_dataloaders, "test_step", args, kwargs)

    @property
    def current_local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a filler), if known."""
        return None if self._counts is None else self._counts[0]

    def _finish_padding(self) -> None:
        """Pad this training batch to its emulated device's time (once; called on the last gradient bucket)."""
        if self.padding is not None and self._counts is not None and self.lightning_module.trainer.training:
            self.padding.finish()

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._counts is not None:
            local, total = self._counts
            closure_loss = closure_loss * (local * self.world_size / total)
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        self._finish_padding()  # when DDP skipped the sync (accumulation), no hook padded it
        if self._counts is not None and self.lightning_module.trainer.training:
            pad = self.padding
            self.clock.record(self._counts[0], pad.pad_s if pad else 0.0, pad.target_s if pad else None)
        return out

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Inside a step, a mean over the whole world (``sync_dist`` logging) is weighted by each rank's samples.

        Time spent in it during a step is waiting and communication, not compute:
        it is kept out of the step's measured compute time.
        """
        start = time.perf_counter()
        try:
            if (self._in_step and self._counts is not None and group is None and isinstance(tensor, torch.Tensor)
                    and torch.is_floating_point(tensor) and _is_mean(reduce_op)):
                local, total = self._counts
                summed = super().reduce(tensor * local, group=group, reduce_op="sum")
                return summed / total
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        finally:
            if self._in_step:
                self.clock.add_collective(time.perf_counter() - start)

    # -- checkpoints ------------------------------------------------------------------------------
    def het_state(self) -> dict[str, Any]:
        """What a checkpoint carries for this strategy (``checkpoint.py``); a collective when compressing."""
        assert self.cluster is not None and self.plan is not None
        return ckpt.strategy_state(self.cluster, self.plan, self.current_shares(),
                                   ckpt.gather_compression(self.compression_state, self.world_size))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.plan is not None:
            checkpoint[ckpt.CHECKPOINT_KEY] = self.het_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._restored = ckpt.restored_state(checkpoint) or self._restored
        rank_debug(self.global_rank, "load_checkpoint: %s", checkpoint_path)
        return checkpoint


def _is_mean(reduce_op: Any) -> bool:
    if reduce_op is None or isinstance(reduce_op, str):
        return reduce_op is None or reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else False
