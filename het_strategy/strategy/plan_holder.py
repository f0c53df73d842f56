"""The cluster, the workload and the Plan a ``hetero`` run holds: ``PlanHolder``.

1. ``resolve_cluster`` — a shipped name, a YAML path, a mapping, a
   ``ClusterSpec`` or ``"auto"`` (probe); it must have one device per rank.
2. ``ensure_plan`` — once per fit: the checkpoint's plan (same devices and
   batch), the given plan checked, or rank 0's search broadcast to all ranks.
   Every rank must run the same plan, so no rank plans on its own.
3. ``apply_plan(plan, global_batch, dtype)`` — a new Plan (the straggler
   callback's rebalance), checked; ``plan`` is then the plan being run and the
   one checkpoints carry, and its shares are returned for the training loader.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec, load_workload
from het_strategy.emulation.speeds import cluster_is_emulated, emulation_summary
from het_strategy.moe import moe_layers
from het_strategy.planning.strategy_plans import data_parallel_plan, estimate_workload, shares_in_rank_order
from het_strategy.profiling.batch_contents import first_tensor
from het_strategy.strategy.elastic import DEVICE_ENV, present_cluster
from het_strategy.strategy.checkpoint import restored_plan
from het_strategy.strategy.rank_context import RankContext
from het_strategy.strategy.rank_zero import decided_on_rank_zero
from het_strategy.strategy.sampler import split_by_shares

__all__ = ["PlanHolder"]


class PlanHolder:
    """The cluster, the workload and the Plan of a run (see the module docstring).

    Args:
        cluster_source: ``"auto"`` or a checked cluster (``arguments.check_cluster_source``).
        plan_source: the given Plan, or None to plan at setup.
        workload_source: the model's costs as given, or None to estimate them from the module.
        emulation: honour the cluster's emulated speeds; False drops them.
        probe_cache_dir: where ``cluster="auto"`` caches its measurements.
        probe_refresh: measure again instead of reusing this host's measurements.
        profile_input: with ``cluster="auto"``, what the model's forward takes from a batch.
        verbose: log the plan (and emulation) table on rank 0.
    """

    def __init__(self, cluster_source: ClusterSpec | str, plan_source: Plan | None, workload_source: Any, *,
                 emulation: bool = True, probe_cache_dir: str | Path | None = None, probe_refresh: bool = False,
                 profile_input: Callable[[Any], Any] | None = None, verbose: bool = True,
                 planner: Callable[..., Plan] = data_parallel_plan) -> None:
        self.cluster_source, self.plan_source, self.workload_source = cluster_source, plan_source, workload_source
        self.planner = planner
        """``(cluster, workload, global_batch, dtype, given, profile) -> Plan``: the run's plan, ``given``
        checked or searched (the extension's ``make_plan``)."""
        self.emulation, self.probe_cache_dir, self.probe_refresh = emulation, probe_cache_dir, probe_refresh
        self.profile_input, self.verbose = profile_input, verbose
        self.cluster: ClusterSpec | None = None
        """The cluster (once ``resolve_cluster`` ran); rank r plays ``cluster.devices[r]``."""
        self.present: list[str] | None = None
        """The devices the ranks named (``HET_STRATEGY_DEVICE``) when the cluster is the ones present."""
        self.plan: Plan | None = None
        """The training plan being run (after ``apply_plan``, the applied one)."""
        self.workload: WorkloadSpec | None = None
        self.profile: MeasuredProfile | None = None
        """The measured per-block times when the model was profiled (``profile_input``)."""

    # -- cluster ----------------------------------------------------------------------------------
    def resolve_cluster(self, ctx: RankContext, present: list[str] | None = None) -> ClusterSpec:
        """The run's cluster (once: a later ``trainer.validate``/``test`` keeps it), checked against the world;
        ``present``: the device each rank named (``elastic.gather_device_names``), the cluster of those devices."""
        if self.cluster is not None:
            return self.cluster
        source = self.cluster_source
        if present is not None and isinstance(source, str) and source == "auto":
            raise field_error("cluster", "auto", f"be a cluster file when the ranks name their devices "
                              f"({DEVICE_ENV}: {present})")
        if isinstance(source, str) and source == "auto":
            from het_strategy.profiling.probe import probe_cluster

            cluster = probe_cluster(ctx.device, dtype=ctx.dtype, cache_dir=self.probe_cache_dir,
                                    refresh=self.probe_refresh, print_table=self.verbose).cluster
        else:
            cluster = load_cluster(source)
        if present is not None:
            cluster = present_cluster(cluster, present)
            self.present = present
        if cluster.num_devices != ctx.world:
            raise field_error("cluster", cluster.name,
                              f"describe as many devices as the launched world has ranks ({ctx.world}); "
                              f"it has {cluster.num_devices}",
                              "launch devices x num_nodes = the cluster's device count, or pass the matching cluster")
        if cluster_is_emulated(cluster) and not self.emulation:
            cluster = cluster.without_emulation()
        self.cluster = cluster
        _cap_emulated_memory(cluster, ctx)
        return cluster

    # -- the training plan ------------------------------------------------------------------------
    def ensure_plan(self, module: nn.Module, dataloader: DataLoader | None, global_batch: int, ctx: RankContext,
                    to_device: Callable[[Any, Any], Any] | None = None, restored: dict[str, Any] | None = None
                    ) -> bool:
        """The training plan (once per fit and global batch): ``restored``'s (the strategy's part of the checkpoint
        resumed from), given, or searched.

        ``to_device(batch, device)`` moves a profiling batch; without a ``dataloader`` (a plan asked for before
        the training loader exists) the model is not profiled and a sample is taken as one token.  Returns
        whether a plan was made now.
        """
        if self.plan is not None and self.plan.global_batch_size == global_batch:
            return False
        cluster = self.require_cluster()
        if self.workload is None:
            if (self.cluster_source == "auto" and self.profile_input is not None and dataloader is not None
                    and to_device is not None):
                self.workload, self.profile = self._profile_model(module, dataloader, ctx, to_device)
            else:
                self.workload = self.resolve_workload(module, dataloader, ctx.dtype)
        self.plan = (restored_plan(restored, cluster, global_batch, ctx.rank)
                     or self.broadcast_plan(global_batch, self.workload, ctx))
        return True

    def broadcast_plan(self, global_batch: int, workload: WorkloadSpec, ctx: RankContext) -> Plan:
        """Rank 0 plans (or checks the given plan) and broadcasts it; an error stops every rank."""
        cluster = self.require_cluster()
        profile = self.profile if workload is self.workload else None

        def decide() -> dict[str, Any]:
            try:
                return self.planner(cluster, workload, global_batch, ctx.dtype, self.plan_source, profile).to_dict()
            except ConfigError as exc:
                if self.present is None:
                    raise
                raise ConfigError(f"the devices present ({', '.join(self.present)}, named in {DEVICE_ENV}) hold no "
                                  f"plan: {exc}", field=exc.field, value=exc.value) from None

        return Plan.from_dict(decided_on_rank_zero(ctx.rank, ctx.world, decide))

    # -- live changes -----------------------------------------------------------------------------
    def shares_for(self, global_batch: int, world: int, train_shares: list[int] | None) -> list[int]:
        """The training shares (``current_shares``) scaled to a training loader's ``global_batch`` when it differs
        (the second loader of a combined training loader)."""
        shares = self.current_shares(train_shares)
        if sum(shares) == global_batch:
            return shares
        if global_batch < world:
            raise field_error("global batch", global_batch,
                              f"be >= the number of ranks ({world}) so the shares can cover it")
        return split_by_shares(global_batch, shares)

    def current_shares(self, train_shares: list[int] | None) -> list[int]:
        """Samples per rank of a full training global batch, in rank order: ``train_shares`` (the split training
        loader's), else the plan's."""
        if train_shares is not None:
            return list(train_shares)
        if self.plan is None:
            raise ConfigError("current_shares: no training plan yet (the training DataLoader is not split)")
        return shares_in_rank_order(self.plan, self.require_cluster())

    def apply_plan(self, plan: Plan, global_batch: int, dtype: str) -> list[int]:
        """``plan`` checked for the training ``global_batch`` becomes the plan being run; its shares in rank order.

        Every rank must call it with the same plan (the straggler callback decides from the same gathered
        telemetry), so every rank's loader takes the same shares at the same step.
        """
        if self.cluster is None or self.workload is None:
            raise ConfigError("apply_plan: no training DataLoader has been split yet")
        checked = self.planner(self.cluster, self.workload, global_batch, dtype, plan, None)
        self.plan = checked
        return shares_in_rank_order(checked, self.cluster)

    # -- workload ---------------------------------------------------------------------------------
    def resolve_workload(self, module: nn.Module, dataloader: DataLoader | None, dtype: str) -> WorkloadSpec:
        """The given workload, or one estimated from the module's size and a sample's length (one token
        without a ``dataloader``)."""
        if self.workload_source is not None:
            return load_workload(self.workload_source, dtype)
        # experts differ per rank and run on routed tokens only (HeteroMoE pads them itself): not counted
        num_params = sum(p.numel() for p in module.parameters()
                         if p.requires_grad and not getattr(p, "het_expert", False))
        tokens = 1
        if dataloader is not None and len(dataloader.dataset) > 0:  # type: ignore[arg-type]
            first = first_tensor(dataloader.dataset[0])
            if first is not None and not torch.is_floating_point(first) and first.dim() >= 1:
                tokens = int(first.numel())  # token ids: one sample is a sequence
        moe = [(m.num_experts, m.k, m.params_per_expert) for m in moe_layers(module)]
        return estimate_workload(type(module).__name__, num_params, tokens, dtype, moe)

    def _profile_model(self, module: nn.Module, dataloader: DataLoader, ctx: RankContext,
                       to_device: Callable[[Any, Any], Any]) -> tuple[WorkloadSpec, MeasuredProfile]:
        """Every rank times the model per block on its device; the first rank of each device type speaks for it."""
        from het_strategy.profiling.module_profile import profile_module
        from het_strategy.profiling.torch_device import DTYPE_NAMES

        assert self.profile_input is not None  # invariant: ensure_plan calls it only with profile_input
        n = min(len(dataloader.dataset), 4)  # type: ignore[arg-type]
        batch = dataloader.collate_fn([dataloader.dataset[i] for i in range(n)])  # type: ignore[misc]
        sample = to_device(self.profile_input(batch), ctx.device)
        param = next(p for p in module.parameters() if p.is_floating_point())
        dtype = DTYPE_NAMES.get(param.dtype)
        if dtype is None:
            raise field_error("profile_input", "a model in " + str(param.dtype),
                              "profile a model whose parameters are fp32, bf16 or fp16")
        device_type = self.require_cluster().devices[ctx.rank].type
        result = profile_module(module, sample, dtype=dtype, device_type=device_type, name=type(module).__name__)
        gathered: list[Any] = [None] * ctx.world
        dist.all_gather_object(gathered, result.profile.times)
        times: dict[tuple[str, int], Any] = {}
        for rank_times in gathered:
            for key, rows in rank_times.items():
                times.setdefault(key, rows)
        return result.workload, MeasuredProfile(model=result.workload.name, times=times)

    def log_plan(self, dtype: str, with_experts: bool) -> None:
        """The plan table (and the emulation summary) through the ``het_strategy`` logger (call on rank 0)."""
        from het_strategy.core.cost_model import CostModel
        from het_strategy.core.train_settings import TrainSettings
        from het_strategy.report.table import plan_table

        cluster = self.require_cluster()
        if self.plan is None or self.workload is None:
            raise ConfigError("log_plan: no training plan yet")
        settings = TrainSettings(global_batch_size=self.plan.global_batch_size, dtype=dtype, micro_batch_sizes=(1,))
        score = CostModel(cluster, self.workload, settings, self.profile).score(self.plan)
        logger.info("%s", plan_table(self.plan, score, cluster))
        if self.workload_source is None and self.profile is None:
            logger.info("note: rough estimate: the model's costs come from its parameter count (2 x parameters x "
                        "tokens FLOPs per sample, no activation memory); pass workload= (a model YAML or "
                        "WorkloadSpec), or cluster='auto' with profile_input= to time the model on each device")
        if cluster_is_emulated(cluster):
            logger.info("%s", emulation_summary(cluster, self.workload, dtype, with_experts))

    def require_cluster(self) -> ClusterSpec:
        """The cluster; a ``ConfigError`` before ``setup_environment`` resolved it."""
        if self.cluster is None:
            raise ConfigError("the hetero strategy has no cluster yet (it is resolved in setup_environment)")
        return self.cluster


def _cap_emulated_memory(cluster: ClusterSpec, ctx: RankContext) -> None:
    """On CUDA, an emulated device smaller than the real card gets its memory as an allocator cap."""
    if not cluster_is_emulated(cluster) or ctx.device.type != "cuda":
        return  # on CPU the emulated memory is honoured by the planner only
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    cap = cluster.devices[ctx.rank].memory_bytes
    if cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total, ctx.device)
