"""The ``hetero`` Lightning strategy: DDP with uneven, planned per-rank batches.

``Trainer(strategy="hetero")`` (after ``import het_strategy``) runs ordinary
DDP, with these changes:

1. **Cluster** — at setup it loads the cluster (a shipped name, a YAML path, a
   ``ClusterSpec``) or probes the devices and links (``cluster="auto"``), and
   refuses a cluster whose size is not the launched world.
2. **Plan and batches** — when the training DataLoader arrives it plans the
   data-parallel split of the global batch (``batch_size x world`` unless
   ``global_batch_size`` is given) with the cost model, or checks a given plan,
   and replaces the DataLoader's sampling with a ``HeteroBatchSampler``: rank r
   gets ``shares[r]`` samples of every global batch, every sample of an epoch
   once.  Evaluation DataLoaders are split the same way.
3. **Exact update** — each rank's loss is scaled by ``n_r x world / N`` before
   backward, so DDP's average of gradients is the gradient of the mean loss
   over the whole global batch: the update equals the single-process one.
   Values logged with ``sync_dist=True`` inside a step are averaged weighted by
   the samples behind them.
4. **Emulation, timing, compression** — a DDP comm hook (gradient compression from
   `het_strategy.compression`, the user's own hook, or allreduce) is
   registered on every device type; it timestamps when the last gradient bucket
   is ready (the rank's compute time without waiting) and, on an emulated
   cluster, first pads the batch to its emulated device's time.
5. **Live rebalancing** — ``set_shares(shares, first_step)`` switches every
   rank to new shares at the same step (the straggler callback's lever).

The plan, the shares and the sampler's position travel in Lightning
checkpoints, so a resumed run continues with the same batches.

``lightning.pytorch`` and ``pytorch_lightning`` are separate class trees; the
same behaviour is built on each package's own ``DDPStrategy``
(``HeteroStrategy`` and ``HeteroStrategyPL``).
"""

from __future__ import annotations

import importlib
import os
import time
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from het_strategy.cluster import ClusterSpec, load_cluster
from het_strategy.compression import CompressionState, compression_config, compression_hook
from het_strategy.emulation import EmulatedCompute, cluster_is_emulated, emulated_factor, \
    emulated_seconds_per_sample, emulation_summary
from het_strategy.errors import ConfigError, field_error
from het_strategy.plan import Plan
from het_strategy.profiling import batch_length, first_tensor
from het_strategy.runtime_planning import data_parallel_plan, estimate_workload, precision_dtype, \
    shares_in_rank_order
from het_strategy.sampler import GlobalOrder, HeteroBatchSampler, order_fingerprint, split_by_shares
from het_strategy.workload import MeasuredProfile, WorkloadSpec, load_workload

__all__ = ["StepRecord", "HeteroDataLoader", "HeteroStrategy", "HeteroStrategyPL", "EmulatedDeviceCallback",
           "EmulatedDeviceCallbackPL", "build_strategy_class", "register_strategies"]

CHECKPOINT_KEY = "het_strategy"
STATE_VERSION = 1


@dataclass
class StepRecord:
    """One training batch on this rank."""

    step: int
    samples: int
    forward_s: float
    pad_s: float
    compute_s: float
    """Batch start to the last gradient bucket ready, less time inside collectives: this rank's own work
    (on an emulated device, at least its emulated time)."""


class HeteroDataLoader(DataLoader):
    """A DataLoader over a ``HeteroBatchSampler``; Lightning saves and restores its position."""

    def __init__(self, *args: Any, next_step: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_step = next_step

    def state_dict(self) -> dict[str, Any]:
        sampler: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler.state_dict(self._next_step() if self._next_step else 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)  # type: ignore[union-attr]


def _rebuild_loader(dl: DataLoader, batch_sampler: HeteroBatchSampler,
                    next_step: Callable[[], int] | None) -> HeteroDataLoader:
    kwargs: dict[str, Any] = dict(
        dataset=dl.dataset, batch_sampler=batch_sampler, num_workers=dl.num_workers, collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory, timeout=dl.timeout, worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context, generator=dl.generator,
        persistent_workers=dl.persistent_workers, pin_memory_device=dl.pin_memory_device)
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    return HeteroDataLoader(next_step=next_step, **kwargs)


def _global_order_source(dl: DataLoader) -> tuple[bool, int, Any]:
    """(shuffle, seed, user sampler or None) of a DataLoader as Lightning handed it over."""
    sampler = dl.sampler
    if isinstance(sampler, DistributedSampler):
        inner = getattr(sampler.dataset, "_sampler", None)  # Lightning's DistributedSamplerWrapper
        if inner is not None and type(sampler).__name__ == "DistributedSamplerWrapper":
            return False, 0, inner
        return bool(sampler.shuffle), int(sampler.seed), None
    if isinstance(sampler, RandomSampler):
        return True, int(os.environ.get("PL_GLOBAL_SEED", 0)), None
    if isinstance(sampler, SequentialSampler):
        return False, 0, None
    return False, 0, sampler


class _HeteroLogic:
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
        compression: gradient compression, registered on CPU/gloo as well as
            CUDA: a method name (``"adaptive"``, ``"quantize"``/``"q4"``,
            ``"powersgd"``, ``"topk"``, ``"fp16"``, ``"bf16"``, ``"none"``), a
            mapping of ``CompressionConfig`` fields (Hydra ``compression=<group>``)
            or a ``CompressionConfig`` (its state then travels in checkpoints);
            or any DDP comm hook ``(state, bucket) -> Future`` with its
            ``compression_state``.
        rebalance: a callback (straggler mitigation) added to the Trainer's.
        emulation: honour the cluster's emulated speeds (pad compute); ``False``
            drops them (every rank plans and runs at its real speed).
        probe_cache_dir: where ``cluster="auto"`` caches its measurements.
        profile_input: with ``cluster="auto"``, what the model's ``forward`` takes
            from a batch (e.g. ``lambda batch: batch[0]``): every rank then times
            the model's forward/backward per block on its device
            (``profiling.profile_module``) and the planner uses those times.
        verbose: print the plan (and emulation) table on rank 0.
        **ddp_kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``,
            ``find_unused_parameters``, ``timeout``, ...).
    """

    strategy_name = "hetero"

    def __init__(self, cluster: str | Path | ClusterSpec | dict = "auto", plan: str | Path | Plan | None = None,
                 workload: str | Path | dict | WorkloadSpec | None = None, global_batch_size: int | None = None,
                 compression: Callable | None = None, compression_state: Any = None, rebalance: Any = None,
                 emulation: bool = True, probe_cache_dir: str | Path | None = None,
                 profile_input: Callable[[Any], Any] | None = None, verbose: bool = True,
                 **ddp_kwargs: Any) -> None:
        if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
            raise field_error("global_batch_size", global_batch_size, "be an integer >= 1 or None")
        self._compression_config = None if callable(compression) else compression_config(compression)
        if self._compression_config is not None and compression_state is not None:
            raise field_error("compression_state", type(compression_state).__name__,
                              "be None when `compression` names a method (the strategy builds the state)")
        if not isinstance(emulation, bool):
            raise field_error("emulation", emulation, "be true or false")
        if profile_input is not None and not callable(profile_input):
            raise field_error("profile_input", profile_input, "be a callable: batch -> the model's forward input")
        if plan is not None and not isinstance(plan, (str, Path, Plan)):
            raise field_error("plan", type(plan).__name__, "be a plan JSON path, a Plan, or None to plan at setup")
        hook = compression if callable(compression) else None
        super().__init__(ddp_comm_hook=hook, ddp_comm_state=compression_state, **ddp_kwargs)
        self.compression_state: CompressionState | None = None
        self._cluster_source = cluster
        self._plan_source = plan
        self._workload_source = workload
        self._global_batch_size = global_batch_size
        self._rebalance = rebalance
        self._emulation_on = emulation
        self._probe_cache_dir = probe_cache_dir
        self._profile_input = profile_input
        self._verbose = verbose
        self.cluster: ClusterSpec | None = None
        self.plan: Plan | None = None
        self._eval_plan: Plan | None = None
        self.train_sampler: HeteroBatchSampler | None = None
        self.workload: WorkloadSpec | None = None
        self.profile: MeasuredProfile | None = None
        self.emulator: EmulatedCompute | None = None
        self.records: deque[StepRecord] = deque(maxlen=10_000)
        self._restored: dict[str, Any] | None = None
        self._counts: tuple[int, int] | None = None  # (this rank's samples, all ranks') of the current batch
        self._in_step = False
        self._batch_t0 = 0.0
        self._forward_s = 0.0
        self._pad_s = 0.0
        self._last_grad_ready = 0.0
        self._collective_s = 0.0  # time this batch spent inside reduce() collectives (not compute)
        self._padded = False
        self._emulated_s = 0.0
        self._train_step = -1

    # -- setup ------------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        # Lightning warns that its DistributedSampler may repeat samples in validation; ours replaces it and
        # evaluates every sample exactly once.
        warnings.filterwarnings("ignore", message=".*Using `DistributedSampler` with the dataloaders.*")
        super().setup_environment()  # type: ignore[misc]
        if self.cluster is None:  # once per strategy: a later trainer.validate/test keeps the cluster
            self.cluster = self._resolve_cluster()
            self._cap_emulated_memory()

    def _cap_emulated_memory(self) -> None:
        """On CUDA, an emulated device smaller than the real one gets its memory as an allocator cap."""
        assert self.cluster is not None
        if not cluster_is_emulated(self.cluster) or self.root_device.type != "cuda":
            return  # on CPU the emulated memory is honoured by the planner only
        total = torch.cuda.get_device_properties(self.root_device).total_memory
        cap = self.cluster.devices[self.global_rank].memory_bytes
        if cap < total:
            torch.cuda.set_per_process_memory_fraction(cap / total, self.root_device)

    def _resolve_cluster(self) -> ClusterSpec:
        source = self._cluster_source
        if isinstance(source, str) and source == "auto":
            from het_strategy.probe import probe_cluster

            cluster = probe_cluster(self.root_device, dtype=self.dtype, cache_dir=self._probe_cache_dir,
                                    print_table=self._verbose).cluster
        else:
            cluster = load_cluster(source)
        if cluster.num_devices != self.world_size:
            raise field_error("cluster", cluster.name,
                              f"describe as many devices as the launched world has ranks ({self.world_size}); "
                              f"it has {cluster.num_devices}",
                              "launch devices x num_nodes = the cluster's device count, or pass the matching cluster")
        if cluster_is_emulated(cluster) and not self._emulation_on:
            cluster = cluster.without_emulation()
        return cluster

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]
        if self._rebalance is not None and self._rebalance not in trainer.callbacks:
            trainer.callbacks.append(self._rebalance)

    def _register_ddp_hooks(self) -> None:
        """Register the comm hook on every device type (Lightning does only on CUDA), timed."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner = self._ddp_comm_hook or allreduce_hook
        state = self._ddp_comm_state if self._ddp_comm_hook is not None else None
        if self._compression_config is not None and self._compression_config.method != "none":
            if self.compression_state is None:  # a later trainer.validate/test keeps the fitted state
                self.compression_state = CompressionState(self.model, self._compression_config)  # type: ignore[arg-type]
                restored = (self._restored or {}).get("compression")
                if restored is not None:
                    self._restore_compression(restored["ranks"])
            inner, state = compression_hook, self.compression_state

        def timed_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
            if bucket.is_last():  # forward and backward are over: finish the emulated compute, then sync
                self._finish_emulated_compute()
            self._last_grad_ready = time.perf_counter()
            return inner(state, bucket)

        timed_hook.__qualname__ = f"timed_hook({getattr(inner, '__qualname__', type(inner).__name__)})"
        hook = timed_hook if self._ddp_comm_wrapper is None else self._ddp_comm_wrapper(timed_hook)
        self.model.register_comm_hook(state=state, hook=hook)  # type: ignore[union-attr]

    # -- data -------------------------------------------------------------------------------------
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        if not isinstance(dataloader, DataLoader):
            return dataloader
        trainer = self.lightning_module.trainer
        stage = trainer.state.stage.value if trainer.state.stage is not None else ""
        if stage == "predict" or isinstance(dataloader, HeteroDataLoader):
            return dataloader  # prediction keeps Lightning's sampler; ours is already split
        if isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
            raise field_error("DataLoader.dataset", type(dataloader.dataset).__name__,
                              "be a map-style dataset (the hetero strategy splits indices by shares)")
        batch_sampler = dataloader.batch_sampler
        if batch_sampler is None or (type(batch_sampler) is not BatchSampler
                                     and not isinstance(batch_sampler, HeteroBatchSampler)):
            raise field_error("DataLoader.batch_sampler", type(batch_sampler).__name__,
                              "be the default one (give batch_size, and optionally a sampler)",
                              "the hetero strategy builds each rank's batches itself from the global batch")
        training = stage == "train"
        global_batch = self._loader_global_batch(dataloader, training)
        if training:
            self._ensure_plan(dataloader, global_batch)
        shares = self._shares_for(dataloader, global_batch)
        shuffle, seed, base = _global_order_source(dataloader)
        order = GlobalOrder(len(dataloader.dataset), shuffle=shuffle, seed=seed, base_sampler=base)
        sampler = HeteroBatchSampler(order, global_batch, shares, self.global_rank,
                                     drop_last=bool(dataloader.drop_last))
        if base is not None:
            self._check_same_order(sampler)
        if training:
            self.train_sampler = sampler
        return _rebuild_loader(dataloader, sampler, self._next_train_step if training else None)

    def _loader_global_batch(self, dataloader: DataLoader, training: bool) -> int:
        if training and self._global_batch_size is not None:
            return self._global_batch_size
        if dataloader.batch_size is None:
            raise field_error("DataLoader.batch_size", None, "be set (per-rank size; the global batch is "
                              "batch_size x world size)", "or pass HeteroStrategy(global_batch_size=...)")
        return int(dataloader.batch_size) * self.world_size

    def _shares_for(self, dataloader: DataLoader, global_batch: int) -> list[int]:
        """The training shares, scaled to an evaluation loader's global batch when it differs.

        Before any training plan exists (the sanity check, ``trainer.validate``)
        an evaluation loader gets its own plan for its global batch.
        """
        assert self.cluster is not None
        if self.plan is not None:
            shares = self.current_shares()
        elif self._plan_source is not None:  # a given plan, checked for its own global batch, then scaled
            given = self._plan_source if isinstance(self._plan_source, Plan) else Plan.load(self._plan_source)
            workload = self.workload or self._resolve_workload(dataloader, self.dtype)
            checked = data_parallel_plan(self.cluster, workload, given.global_batch_size, self.dtype, given)
            shares = shares_in_rank_order(checked, self.cluster)
        else:
            if self._eval_plan is None or self._eval_plan.global_batch_size != global_batch:
                # before training (sanity check, trainer.validate): the model's costs from its size; the
                # training plan profiles the model when asked (not possible here, under inference mode)
                self._eval_plan = self._make_plan(global_batch, self._resolve_workload(dataloader, self.dtype))
            shares = shares_in_rank_order(self._eval_plan, self.cluster)
        if sum(shares) == global_batch:
            return shares
        if global_batch < self.world_size:
            raise field_error("global batch", global_batch,
                              f"be >= the number of ranks ({self.world_size}) so the shares can cover it")
        return split_by_shares(global_batch, shares)

    def current_shares(self) -> list[int]:
        """Samples per rank of a full training global batch, in rank order."""
        if self.train_sampler is not None:
            return list(self.train_sampler.shares)
        assert self.plan is not None and self.cluster is not None
        return shares_in_rank_order(self.plan, self.cluster)

    def next_safe_step(self) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        assert self.train_sampler is not None
        produced = torch.tensor([self.train_sampler.produced], dtype=torch.long, device=self.root_device)
        dist.all_reduce(produced, op=dist.ReduceOp.MAX)
        return int(produced.item())

    def set_shares(self, shares: list[int], first_step: int) -> None:
        """Live rebalancing: split every global batch from ``first_step`` of this epoch on by ``shares``.

        Every rank must call it with the same arguments (straggler callbacks decide
        from the same gathered telemetry); updates stay exact and each sample of the
        epoch is still used once.
        """
        if self.train_sampler is None:
            raise ConfigError("set_shares: no training DataLoader has been split yet")
        self.train_sampler.set_shares(shares, first_step)

    def _check_same_order(self, sampler: HeteroBatchSampler) -> None:
        fingerprints: list[Any] = [None] * self.world_size
        dist.all_gather_object(fingerprints, order_fingerprint(sampler.sampler.indices()))
        if len(set(fingerprints)) != 1:
            raise field_error("DataLoader.sampler", type(sampler.sampler.base_sampler).__name__,
                              "yield the same order on every rank (seed it): the hetero strategy cuts one "
                              "global order into per-rank slices", "or pass shuffle=True and no sampler")

    def _next_train_step(self) -> int:
        return self._train_step + 1

    # -- planning ---------------------------------------------------------------------------------
    def _ensure_plan(self, dataloader: DataLoader, global_batch: int) -> None:
        """The training plan (once per fit): restored from the checkpoint, given, or searched."""
        if self.plan is not None and self.plan.global_batch_size == global_batch:
            return
        assert self.cluster is not None
        if self.workload is None:
            if self._cluster_source == "auto" and self._profile_input is not None:
                self.workload, self.profile = self._profile_model(dataloader)
            else:
                self.workload = self._resolve_workload(dataloader, self.dtype)
        self.plan = self._restored_plan(global_batch) or self._make_plan(global_batch, self.workload)
        if cluster_is_emulated(self.cluster):
            device = self.cluster.devices[self.global_rank]
            self.emulator = EmulatedCompute(emulated_seconds_per_sample(self.cluster, device.name,
                                                                        self.workload, self.dtype))
        if self.global_rank == 0 and self._verbose:
            self._print_plan()

    @property
    def dtype(self) -> str:
        """The training dtype as the cost model names it."""
        return precision_dtype(self.precision_plugin.precision)

    def _make_plan(self, global_batch: int, workload: WorkloadSpec) -> Plan:
        """Rank 0 plans (or checks the given plan) and broadcasts it; an error stops every rank."""
        assert self.cluster is not None
        payload: list[Any] = [None]
        if self.global_rank == 0:
            try:
                profile = self.profile if workload is self.workload else None
                payload[0] = ("plan", data_parallel_plan(self.cluster, workload, global_batch, self.dtype,
                                                         self._plan_source, profile).to_dict())
            except ConfigError as exc:
                payload[0] = ("error", str(exc))
        dist.broadcast_object_list(payload, src=0)
        kind, value = payload[0]
        if kind == "error":
            raise ConfigError(value)
        return Plan.from_dict(value)

    def _profile_model(self, dataloader: DataLoader) -> tuple[WorkloadSpec, MeasuredProfile]:
        """Every rank times the model per block on its device; the first rank of each device type speaks for it."""
        from het_strategy.profiling import profile_module

        assert self.cluster is not None and self._profile_input is not None
        n = min(len(dataloader.dataset), 4)
        batch = dataloader.collate_fn([dataloader.dataset[i] for i in range(n)])
        sample = self.batch_to_device(self._profile_input(batch), self.root_device)
        module = self.lightning_module
        param = next(p for p in module.parameters() if p.is_floating_point())
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(param.dtype)
        if dtype is None:
            raise field_error("profile_input", "a model in " + str(param.dtype),
                              "profile a model whose parameters are fp32, bf16 or fp16")
        device_type = self.cluster.devices[self.global_rank].type
        result = profile_module(module, sample, dtype=dtype, device_type=device_type, name=type(module).__name__)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, result.profile.times)
        times: dict[tuple[str, int], Any] = {}
        for rank_times in gathered:
            for key, rows in rank_times.items():
                times.setdefault(key, rows)
        return result.workload, MeasuredProfile(model=result.workload.name, times=times)

    def _resolve_workload(self, dataloader: DataLoader, dtype: str) -> WorkloadSpec:
        if self._workload_source is not None:
            return load_workload(self._workload_source, dtype)
        module = self.lightning_module
        num_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
        tokens = 1
        if len(dataloader.dataset) > 0:
            first = first_tensor(dataloader.dataset[0])
            if first is not None and not torch.is_floating_point(first) and first.dim() >= 1:
                tokens = int(first.numel())  # token ids: one sample is a sequence
        return estimate_workload(type(module).__name__, num_params, tokens, dtype)

    def _restored_plan(self, global_batch: int) -> Plan | None:
        state = self._restored
        if state is None:
            return None
        assert self.cluster is not None
        names = [d.name for d in self.cluster.devices]
        if state["devices"] != names or state["global_batch_size"] != global_batch:
            if self.global_rank == 0:
                print(f"het_strategy: the checkpoint's plan was made for devices {state['devices']} and global "
                      f"batch {state['global_batch_size']}; this run has {names} and {global_batch}: re-planning",
                      flush=True)
            return None
        return Plan.from_dict(state["plan"])

    def _print_plan(self) -> None:
        from het_strategy.cost_model import CostModel, TrainSettings
        from het_strategy.report import plan_table

        assert self.plan is not None and self.cluster is not None and self.workload is not None
        settings = TrainSettings(global_batch_size=self.plan.global_batch_size, dtype=self.dtype,
                                 micro_batch_sizes=(1,))
        score = CostModel(self.cluster, self.workload, settings, self.profile).score(self.plan)
        print(plan_table(self.plan, score, self.cluster), flush=True)
        if cluster_is_emulated(self.cluster):
            print(emulation_summary(self.cluster, self.workload, self.dtype), flush=True)

    # -- steps --------------------------------------------------------------------------------------
    def _begin_batch(self, loaders: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        loader = _pick_loader(loaders, dataloader_idx)
        sampler = getattr(loader, "batch_sampler", None)
        self._counts = sampler.step_counts(batch_idx) if isinstance(sampler, HeteroBatchSampler) else None

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch_idx = _batch_idx(args, kwargs)
        trainer = self.lightning_module.trainer
        self._begin_batch(trainer.train_dataloader, batch_idx)
        self._train_step = batch_idx
        self._batch_t0 = time.perf_counter()
        self._pad_s = 0.0
        self._emulated_s = 0.0
        self._padded = False
        self._collective_s = 0.0
        if self.emulator is not None:
            self.emulator.begin()
        self._in_step = True
        try:
            return super().training_step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._in_step = False
            self._forward_s = time.perf_counter() - self._batch_t0

    def _eval_step(self, loaders: Any, name: str, args: tuple, kwargs: dict) -> Any:
        batch_idx = _batch_idx(args, kwargs)
        dataloader_idx = kwargs.get("dataloader_idx", args[2] if len(args) > 2 else 0)
        self._begin_batch(loaders, batch_idx, dataloader_idx)
        self._in_step = True
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self._in_step = False

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.val_dataloaders, "validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step(self.lightning_module.trainer.test_dataloaders, "test_step", args, kwargs)

    @property
    def current_local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a filler), if known."""
        return None if self._counts is None else self._counts[0]

    def _finish_emulated_compute(self) -> None:
        """Pad this batch's compute to the emulated device's time at this step (once per batch).

        The emulated device is busy from the batch's start for its whole emulated
        time: real compute and any wait inside it (a ``sync_dist`` log waiting for
        another rank's real forward) fall within that window, as they would on the
        real device, so the pad is the emulated time minus the wall time so far.
        """
        if self.emulator is None or self._counts is None or self._padded or not self.lightning_module.trainer.training:
            return
        assert self.cluster is not None
        factor = emulated_factor(self.cluster, self.cluster.devices[self.global_rank].name,
                                 self.lightning_module.trainer.global_step)
        self._emulated_s = self.emulator.target_s(self._counts[0], factor)
        self._pad_s = self.emulator.pad(self._counts[0], factor, self.emulator.elapsed_s())
        self._padded = True

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._counts is not None:
            local, total = self._counts
            closure_loss = closure_loss * (local * self.world_size / total)
        out = super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        self._finish_emulated_compute()  # when DDP skipped the sync (accumulation), no hook padded it
        if self._counts is not None and self.lightning_module.trainer.training:
            # No comm hook ran after the batch started when DDP skipped the sync (gradient accumulation):
            # then the whole backward was this rank's own compute.
            synced = self._last_grad_ready >= self._batch_t0
            end = self._last_grad_ready if synced else time.perf_counter()
            measured = max(end - self._batch_t0 - self._collective_s, 0.0)
            # an emulated device computed for its whole emulated time (or longer, if the real work took longer)
            compute = max(measured, self._emulated_s) if self.emulator is not None else measured
            self.records.append(StepRecord(step=self._train_step, samples=self._counts[0],
                                           forward_s=self._forward_s - self._collective_s, pad_s=self._pad_s,
                                           compute_s=compute))
        return out

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
                summed = super().reduce(tensor * local, group=group, reduce_op="sum")  # type: ignore[misc]
                return summed / total
            return super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        finally:
            if self._in_step:
                self._collective_s += time.perf_counter() - start

    # -- checkpoints ------------------------------------------------------------------------------
    def het_state(self) -> dict[str, Any]:
        """What a checkpoint carries for this strategy: plan, cluster device names, shares."""
        assert self.cluster is not None
        return {"version": STATE_VERSION, "cluster": self.cluster.name,
                "devices": [d.name for d in self.cluster.devices],
                "global_batch_size": self.plan.global_batch_size if self.plan else None,
                "plan": self.plan.to_dict() if self.plan else None,
                "shares": self.current_shares() if self.plan else None,
                "compression": self._compression_checkpoint()}

    def _compression_checkpoint(self) -> dict[str, Any] | None:
        """Every rank's compression state (error feedback is per rank; the checkpoint is written by rank 0).
        A collective: Lightning calls ``save_checkpoint`` on every rank."""
        if self.compression_state is None:
            return None
        own = self.compression_state.state_dict()
        if not dist.is_initialized() or self.world_size == 1:
            return {"ranks": [own]}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, own)
        return {"ranks": gathered}

    def _restore_compression(self, ranks: list[dict[str, Any]]) -> None:
        assert self.compression_state is not None
        if len(ranks) == self.world_size:
            self.compression_state.load_state_dict(ranks[self.global_rank])
            return
        # another world size: the choices and schedule still hold, the per-rank residuals do not
        state = {**ranks[0], "residuals": {}, "chunk_residuals": {}, "powersgd": None, "generator": None}
        self.compression_state.load_state_dict(state)
        if self.global_rank == 0:
            warnings.warn(f"the checkpoint's compression state is from {len(ranks)} ranks, this run has "
                          f"{self.world_size}: its error-feedback residuals are dropped")

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.plan is not None:
            checkpoint[CHECKPOINT_KEY] = self.het_state()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None:
            if state.get("version") != STATE_VERSION:
                raise field_error(f"checkpoint[{CHECKPOINT_KEY!r}].version", state.get("version"),
                                  f"be {STATE_VERSION}", "the checkpoint was written by another het_strategy")
            self._restored = state
        return checkpoint


def _pick_loader(loaders: Any, dataloader_idx: int) -> Any:
    if isinstance(loaders, (list, tuple)):
        return loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
    if isinstance(loaders, dict):
        values = list(loaders.values())
        return values[dataloader_idx] if dataloader_idx < len(values) else None
    return loaders


def _batch_idx(args: tuple, kwargs: dict) -> int:
    if "batch_idx" in kwargs:
        return int(kwargs["batch_idx"])
    return int(args[1]) if len(args) > 1 else 0


def _is_mean(reduce_op: Any) -> bool:
    if reduce_op is None:
        return True
    if isinstance(reduce_op, str):
        return reduce_op.lower() in ("mean", "avg")
    return reduce_op == dist.ReduceOp.AVG if hasattr(dist.ReduceOp, "AVG") else False


def build_strategy_class(pl: ModuleType) -> type:
    """``HeteroStrategy`` on ``pl``'s own DDPStrategy and Callback (``lightning.pytorch`` or ``pytorch_lightning``)."""

    class EmulatedDeviceCallback(pl.Callback):  # type: ignore[name-defined,misc]
        """Emulated devices under a strategy other than ``hetero`` (plain ``ddp``, for comparison).

        Rank r plays the cluster's r-th device; a batch's samples are its first
        tensor's length.  As under ``hetero``, the compute is padded when the last
        gradient bucket is ready, through a comm hook this callback registers on
        the DDP model (allreduce, as DDP's default); where the model already has a
        hook, it pads before backward instead, estimating the backward still to
        come as ``backward_ratio`` x the forward.
        """

        def __init__(self, cluster: Any, workload: Any, dtype: str = "fp32") -> None:
            self._cluster = load_cluster(cluster)
            self._workload_source, self._dtype = workload, dtype
            self._own: EmulatedCompute | None = None
            self._device = ""
            self._samples = 0
            self._in_hook = False
            self._padded = False
            self._step = 0

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            if hasattr(trainer.strategy, "het_state"):
                raise field_error("callbacks", type(self).__name__, "not be used with the hetero strategy",
                                  "it emulates the cluster's devices by itself")
            if self._cluster.num_devices != trainer.world_size:
                raise field_error("cluster", self._cluster.name, f"describe {trainer.world_size} devices (the world "
                                  f"size); it has {self._cluster.num_devices}")
            workload = load_workload(self._workload_source, self._dtype)
            self._device = self._cluster.devices[trainer.global_rank].name
            self._own = EmulatedCompute(emulated_seconds_per_sample(self._cluster, self._device, workload,
                                                                    self._dtype))
            if trainer.global_rank == 0:
                print(emulation_summary(self._cluster, workload, self._dtype), flush=True)

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
            from torch.nn.parallel import DistributedDataParallel

            model = trainer.strategy.model
            if not isinstance(model, DistributedDataParallel):
                return

            def padding_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
                if bucket.is_last():
                    self._finish()
                return allreduce_hook(state, bucket)

            try:
                model.register_comm_hook(state=None, hook=padding_hook)
                self._in_hook = True
            except RuntimeError:  # the model has a hook already: pad before backward
                self._in_hook = False

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self._samples = batch_length(batch)
            self._step, self._padded = trainer.global_step, False
            assert self._own is not None
            self._own.begin()

        def _finish(self, computed_s: float | None = None) -> None:
            if self._own is None or self._padded:
                return
            computed = self._own.elapsed_s() if computed_s is None else computed_s
            self._own.pad(self._samples, emulated_factor(self._cluster, self._device, self._step), computed)
            self._padded = True

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
            if trainer.training and not self._in_hook and self._own is not None:
                self._finish(self._own.estimate_with_backward())

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            if trainer.training:
                self._finish()  # a backward without sync (gradient accumulation) ran no hook

    class HeteroStrategy(_HeteroLogic, pl.strategies.DDPStrategy):  # type: ignore[misc]
        __doc__ = _HeteroLogic.__doc__
        emulation_callback_cls = EmulatedDeviceCallback

    HeteroStrategy.__module__ = EmulatedDeviceCallback.__module__ = __name__
    suffix = "" if pl.__name__ == "lightning.pytorch" else "PL"
    HeteroStrategy.__qualname__ = HeteroStrategy.__name__ = f"HeteroStrategy{suffix}"
    EmulatedDeviceCallback.__qualname__ = EmulatedDeviceCallback.__name__ = f"EmulatedDeviceCallback{suffix}"
    return HeteroStrategy


def register_strategies(pl: ModuleType, cls: type) -> None:
    """Register ``hetero`` in ``pl``'s StrategyRegistry (a second call does nothing)."""
    registry = pl.strategies.StrategyRegistry
    if "hetero" not in registry:
        registry.register("hetero", cls, description="Uneven data parallelism planned for a heterogeneous cluster "
                                                     "(het_strategy)")
    if "hetero_spawn" not in registry:
        registry.register("hetero_spawn", cls, description="hetero with start_method='spawn'", start_method="spawn")


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_lightning = _optional("lightning.pytorch")
HeteroStrategy = build_strategy_class(_lightning) if _lightning is not None else None
EmulatedDeviceCallback = HeteroStrategy.emulation_callback_cls if HeteroStrategy is not None else None
_pytorch_lightning = _optional("pytorch_lightning")
HeteroStrategyPL = build_strategy_class(_pytorch_lightning) if _pytorch_lightning is not None else None
EmulatedDeviceCallbackPL = HeteroStrategyPL.emulation_callback_cls if HeteroStrategyPL is not None else None
if _lightning is not None:
    register_strategies(_lightning, HeteroStrategy)  # type: ignore[arg-type]
if _pytorch_lightning is not None:
    register_strategies(_pytorch_lightning, HeteroStrategyPL)  # type: ignore[arg-type]
