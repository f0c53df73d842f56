"""The cluster and the Plan a ``hetero`` run holds, and how they change.

``PlannedRun`` is the strategy's planning half (a mixin of ``HeteroLogic``;
it reads ``world_size``, ``global_rank``, ``root_device``, ``precision_plugin``
and ``lightning_module`` from the Lightning strategy it is mixed into):

1. ``resolve_cluster`` — a shipped name, a YAML path, a mapping, a
   ``ClusterSpec`` or ``"auto"`` (probe); it must have one device per rank.
2. ``ensure_plan`` — once per fit: the checkpoint's plan (same devices and
   batch), the given plan checked, or rank 0's search broadcast to all ranks.
   Every rank must run the same plan, so no rank plans on its own.
3. ``apply_plan(plan, first_step)`` — a new Plan (the straggler callback's
   rebalance) takes effect at a step boundary on every rank; ``plan`` is then
   the plan being run and the one checkpoints carry.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec, load_workload
from het_strategy.emulation.padding import BatchPadding
from het_strategy.moe import moe_layers
from het_strategy.emulation.speeds import cluster_is_emulated, emulation_summary
from het_strategy.planning.run_plan import data_parallel_plan, estimate_workload, precision_dtype, \
    shares_in_rank_order
from het_strategy.profiling.batch_contents import first_tensor
from het_strategy.strategy.checkpoint import restored_plan
from het_strategy.strategy.experts import ExpertRun
from het_strategy.strategy.sampler import HeteroBatchSampler, split_by_shares

__all__ = ["PlannedRun"]

if TYPE_CHECKING:  # at run time the registry mixes this into each Lightning package's own DDPStrategy
    from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy
else:
    _DDPStrategy = object


class PlannedRun(_DDPStrategy):
    """The cluster, the workload and the Plan of a run (see the module docstring)."""

    _cluster_source: str | Path | ClusterSpec | dict
    _plan_source: str | Path | Plan | None
    _workload_source: Any
    _emulation_on: bool
    _probe_cache_dir: str | Path | None
    _probe_refresh: bool
    _profile_input: Callable[[Any], Any] | None
    _verbose: bool
    _restored: dict[str, Any] | None
    _eval_plan: Plan | None

    cluster: ClusterSpec | None
    plan: Plan | None
    workload: WorkloadSpec | None
    profile: MeasuredProfile | None
    padding: BatchPadding | None
    experts: ExpertRun | None
    train_sampler: HeteroBatchSampler | None

    @property
    def dtype(self) -> str:
        """The training dtype as the cost model names it."""
        return precision_dtype(self.precision_plugin.precision)

    # -- cluster ----------------------------------------------------------------------------------
    def resolve_cluster(self) -> ClusterSpec:
        source = self._cluster_source
        if isinstance(source, str) and source == "auto":
            from het_strategy.profiling.probe import probe_cluster

            cluster = probe_cluster(self.root_device, dtype=self.dtype,
                                    cache_dir=self._probe_cache_dir, refresh=self._probe_refresh,
                                    print_table=self._verbose).cluster
        else:
            cluster = load_cluster(source)
        world = self.world_size
        if cluster.num_devices != world:
            raise field_error("cluster", cluster.name,
                              f"describe as many devices as the launched world has ranks ({world}); "
                              f"it has {cluster.num_devices}",
                              "launch devices x num_nodes = the cluster's device count, or pass the matching cluster")
        if cluster_is_emulated(cluster) and not self._emulation_on:
            cluster = cluster.without_emulation()
        return cluster

    def cap_emulated_memory(self) -> None:
        """On CUDA, an emulated device smaller than the real card gets its memory as an allocator cap."""
        assert self.cluster is not None
        if not cluster_is_emulated(self.cluster) or self.root_device.type != "cuda":
            return  # on CPU the emulated memory is honoured by the planner only
        total = torch.cuda.get_device_properties(self.root_device).total_memory
        cap = self.cluster.devices[self.global_rank].memory_bytes
        if cap < total:
            torch.cuda.set_per_process_memory_fraction(cap / total, self.root_device)

    # -- the training plan ------------------------------------------------------------------------
    def ensure_plan(self, dataloader: DataLoader, global_batch: int) -> None:
        """The training plan (once per fit): restored from the checkpoint, given, or searched."""
        if self.plan is not None and self.plan.global_batch_size == global_batch:
            return
        assert self.cluster is not None
        if self.workload is None:
            if self._cluster_source == "auto" and self._profile_input is not None:
                self.workload, self.profile = self._profile_model(dataloader)
            else:
                self.workload = self.resolve_workload(dataloader)
        rank = self.global_rank
        self.plan = (restored_plan(self._restored, self.cluster, global_batch, rank)
                     or self.broadcast_plan(global_batch, self.workload))
        if cluster_is_emulated(self.cluster):
            self.padding = BatchPadding.for_device(self.cluster, self.cluster.devices[rank].name, self.workload,
                                                   self.dtype, experts=self.experts is None)
            self.padding.warn = rank == 0  # rank 0 says it once if its emulated time is far below the real one
        if self.experts is not None:
            self.experts.plan_expert_map(self.plan, self.cluster, self.workload)
            if self.padding is not None:
                self.experts.emulate_experts(self.cluster, self.workload, self.dtype, rank, self.padding)
        if rank == 0 and self._verbose:
            self._print_plan()

    def broadcast_plan(self, global_batch: int, workload: WorkloadSpec) -> Plan:
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

    def shares_for(self, dataloader: DataLoader, global_batch: int) -> list[int]:
        """The training shares, scaled to an evaluation loader's global batch when it differs.

        Before any training plan exists (the sanity check, ``trainer.validate``)
        an evaluation loader gets its own plan for its global batch.
        """
        assert self.cluster is not None
        if self.plan is not None:
            shares = self.current_shares()
        elif self._plan_source is not None:  # a given plan, checked, then scaled
            source = self._plan_source
            given = source if isinstance(source, Plan) else Plan.load(source)
            workload = self.workload or self.resolve_workload(dataloader)
            checked = data_parallel_plan(self.cluster, workload, given.global_batch_size, self.dtype, given)
            shares = shares_in_rank_order(checked, self.cluster)
        else:
            if self._eval_plan is None or self._eval_plan.global_batch_size != global_batch:
                # before training (sanity check, trainer.validate): the model's costs from its size; the
                # training plan profiles the model when asked (not possible here, under inference mode)
                self._eval_plan = self.broadcast_plan(global_batch, self.resolve_workload(dataloader))
            shares = shares_in_rank_order(self._eval_plan, self.cluster)
        if sum(shares) == global_batch:
            return shares
        if global_batch < self.world_size:
            raise field_error("global batch", global_batch,
                              f"be >= the number of ranks ({self.world_size}) so the shares can cover it")
        return split_by_shares(global_batch, shares)

    # -- live changes -----------------------------------------------------------------------------
    def current_shares(self) -> list[int]:
        """Samples per rank of a full training global batch, in rank order."""
        if self.train_sampler is not None:
            return list(self.train_sampler.shares)
        assert self.plan is not None and self.cluster is not None
        return shares_in_rank_order(self.plan, self.cluster)

    def next_safe_step(self) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        assert self.train_sampler is not None
        produced = torch.tensor([self.train_sampler.produced], dtype=torch.long,
                                device=self.root_device)
        dist.all_reduce(produced, op=dist.ReduceOp.MAX)
        return int(produced.item())

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        """Run ``plan`` from step ``first_step`` of this epoch on (every rank, same arguments).

        Every rank must call it with the same plan at the same step (the straggler
        callback decides from the same gathered telemetry); updates stay exact
        and each sample of the epoch is still used once.
        """
        if self.train_sampler is None or self.cluster is None or self.workload is None:
            raise ConfigError("apply_plan: no training DataLoader has been split yet")
        checked = data_parallel_plan(self.cluster, self.workload, self.train_sampler.global_batch_size,
                                     self.dtype, plan)
        self.train_sampler.set_shares(shares_in_rank_order(checked, self.cluster), first_step)
        self.plan = checked

    def set_shares(self, shares: list[int], first_step: int) -> None:
        """Deprecated (0.1.0): ``apply_plan(planning.rebalance.with_shares(plan, cluster, shares), first_step)``."""
        from het_strategy.planning.rebalance import with_shares

        warnings.warn("HeteroStrategy.set_shares is deprecated: hand a whole Plan to apply_plan (e.g. from "
                      "het_strategy.planning.rebalance)", DeprecationWarning, stacklevel=2)
        assert self.plan is not None and self.cluster is not None
        self.apply_plan(with_shares(self.plan, self.cluster, shares), first_step)

    # -- workload ---------------------------------------------------------------------------------
    def resolve_workload(self, dataloader: DataLoader) -> WorkloadSpec:
        if self._workload_source is not None:
            return load_workload(self._workload_source, self.dtype)
        module = self.lightning_module
        # experts differ per rank and run on routed tokens only (HeteroMoE pads them itself): not counted
        num_params = sum(p.numel() for p in module.parameters()
                         if p.requires_grad and not getattr(p, "het_expert", False))
        tokens = 1
        if len(dataloader.dataset) > 0:  # type: ignore[arg-type]
            first = first_tensor(dataloader.dataset[0])
            if first is not None and not torch.is_floating_point(first) and first.dim() >= 1:
                tokens = int(first.numel())  # token ids: one sample is a sequence
        moe = [(m.num_experts, m.k, m.params_per_expert) for m in moe_layers(module)]
        return estimate_workload(type(module).__name__, num_params, tokens, self.dtype, moe)

    def _profile_model(self, dataloader: DataLoader) -> tuple[WorkloadSpec, MeasuredProfile]:
        """Every rank times the model per block on its device; the first rank of each device type speaks for it."""
        from het_strategy.profiling.module_profile import profile_module
        from het_strategy.profiling.torch_device import DTYPE_NAMES

        assert self.cluster is not None and self._profile_input is not None
        n = min(len(dataloader.dataset), 4)  # type: ignore[arg-type]
        batch = dataloader.collate_fn([dataloader.dataset[i] for i in range(n)])  # type: ignore[misc]
        sample = self.batch_to_device(self._profile_input(batch), self.root_device)
        module = self.lightning_module
        param = next(p for p in module.parameters() if p.is_floating_point())
        dtype = DTYPE_NAMES.get(param.dtype)
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

    def _print_plan(self) -> None:
        from het_strategy.core.cost_model import CostModel, TrainSettings
        from het_strategy.report.table import plan_table

        assert self.plan is not None and self.cluster is not None and self.workload is not None
        settings = TrainSettings(global_batch_size=self.plan.global_batch_size, dtype=self.dtype,
                                 micro_batch_sizes=(1,))
        score = CostModel(self.cluster, self.workload, settings, self.profile).score(self.plan)
        logger.info("%s", plan_table(self.plan, score, self.cluster))  # rank 0 only (the caller's check)
        if self._workload_source is None and self.profile is None:
            logger.info("note: rough estimate: the model's costs come from its parameter count (2 x parameters x "
                        "tokens FLOPs per sample, no activation memory); pass workload= (a model YAML or "
                        "WorkloadSpec), or cluster='auto' with profile_input= to time the model on each device")
        if cluster_is_emulated(self.cluster):
            logger.info("%s", emulation_summary(self.cluster, self.workload, self.dtype, self.experts is not None))
