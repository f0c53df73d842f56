"""``hetero_diloco``: DiLoCo across groups of unequal devices, as an extension of the ``hetero`` run.

``Trainer(strategy="hetero_diloco")`` runs uneven data parallelism (``HeteroRun``) inside each group of devices
and exchanges parameters between the groups every H steps instead of gradients every step.
``DiLoCoExtension`` is what it changes, at ``DataParallelExtension``'s points:

1. **Its plan** (``make_plan``): ``plan=`` a low-communication plan, or planned on rank 0 (H, the codec and the
   split from the devices, the link and the quality budget: ``planning/low_communication.py``).
2. **Groups** (``environment_ready`` / ``teardown``, ``diloco/groups.py``): one per node by default; each group's
   DDP reduces over the group only (``ddp_process_group``), so no inner step crosses the slow link.
3. **Inner steps**: the user's optimizer; a faster group takes more samples per step, so every group ends its H
   steps together; each rank's loss is weighted so its group's DDP average is the group's mean (``loss_weight``:
   by samples, or by counted label tokens under ``loss_weighting="tokens"``).
4. **Outer step** (``after_optimizer_step``, ``diloco/outer_loop.py``): every H inner steps the groups'
   pseudo-gradients are averaged (weighted by their samples, or tokens) through the plan's codec and the outer
   optimizer steps.
5. **Lightning**: validation and the checkpoint's ``state_dict`` hold the outer parameters; the checkpoint adds
   every group's own state (``diloco/group_state.py``), and resume is exact.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from typing import Any, Callable

import torch
import torch.distributed as dist
from typing_extensions import override

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger, rank_debug
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.diloco.group_state import CHECKPOINT_KEY, copy_flat_into, gather_state, group_part
from het_strategy.diloco.groups import DiLoCoGroups, build_groups, group_ranks
from het_strategy.diloco.outer_exchange import OuterExchange
from het_strategy.diloco.outer_loop import OuterLoop, OuterRecord
from het_strategy.planning.low_communication import resolve_groups
from het_strategy.planning.strategy_plans import check_given_plan, data_parallel_settings
from het_strategy.strategy.diloco_options import PLANNED, DiLoCoOptions
from het_strategy.strategy.dp_extension import DataParallelExtension
from het_strategy.strategy.hetero_run import HeteroRun
from het_strategy.strategy.loss_tokens import summed_count

__all__ = ["DiLoCoExtension", "diloco_run"]


def diloco_run(cluster: Any = "auto", plan: Any = None, **kwargs: Any) -> HeteroRun:
    """The ``hetero_diloco`` strategy's run: ``HeteroRun`` with a ``DiLoCoExtension``.

    ``kwargs``: ``DiLoCoOptions``' fields (``inner_steps``, ``outer_codec``, ``groups``, ``split``,
    ``max_inner_steps``, ``max_sync_overhead``, ``outer_codecs``, ``outer_lr``, ``outer_momentum``,
    ``outer_optimizer``), and ``HeteroRun``'s arguments (``workload``, ``global_batch_size``, ...).
    """
    names = DiLoCoOptions.names()
    options = DiLoCoOptions(**{k: v for k, v in kwargs.items() if k in names})
    hetero_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    for key, why in (("compression", "the groups' gradients stay inside the group; the outer exchange's codec "
                                     "is outer_codec="),
                     ("rebalance", "live rebalancing re-plans a synchronous split; the inner split is planned "
                                   "once per fit"),
                     ("extension", "it is hetero_diloco's own")):
        if hetero_kwargs.get(key) is not None:
            raise field_error(key, type(hetero_kwargs[key]).__name__, f"be None for hetero_diloco ({why})")
    return HeteroRun(cluster, plan, extension=DiLoCoExtension(options), **hetero_kwargs)


class DiLoCoExtension(DataParallelExtension):
    """DiLoCo's outer loop over groups of uneven data parallelism (module docstring).

    Args:
        options: the outer loop's options, checked.
    """

    runtime = Runtime.hetero_diloco

    def __init__(self, options: DiLoCoOptions) -> None:
        self.options = options
        self.groups: DiLoCoGroups | None = None
        """This rank's groups (from ``environment_ready``)."""
        self.outer: OuterLoop | None = None
        """The outer parameters, optimizer and round (from ``after_ddp``)."""
        self.plan: Plan | None = None
        """The low-communication plan being run (from ``plan_ready``)."""
        self.cluster: ClusterSpec | None = None
        self._saved: tuple[Any, str] | None = None
        self._restored: dict[str, Any] | None = None
        self._pending_samples = 0
        self._eval_swap = ExitStack()

    @override
    def check_sources(self, cluster: ClusterSpec | str, given: Plan | None) -> None:
        """A split that misses a device, or options a given plan already decides, are refused now."""
        if given is None:
            if isinstance(cluster, ClusterSpec):
                resolve_groups(cluster, self.options.groups, "groups")
            return
        o = self.options
        for name, value in {**o.pinned(), "groups": o.groups, "split": o.split}.items():
            if value not in (PLANNED, "node", "planned"):
                raise field_error(name, value, "be left at its default when plan= is given (the plan's "
                                  f"outer_sync sets it: {given.outer_sync.to_dict() if given.outer_sync else {}})")

    @override
    def make_plan(self, cluster: ClusterSpec, workload: WorkloadSpec, global_batch: int, dtype: str,
                  given: Plan | None, profile: MeasuredProfile | None) -> Plan:
        """``given`` checked, or the low-communication planner's choice for this cluster and budget."""
        if given is not None:
            return check_given_plan(given, cluster, workload, global_batch, dtype, Runtime.hetero_diloco)
        from het_strategy.planning.low_communication import plan_low_communication

        o = self.options
        budget = dataclasses.replace(o.budget, groups=resolve_groups(cluster, o.groups, "groups"))
        pinned = o.pinned()
        return plan_low_communication(cluster, workload, data_parallel_settings(global_batch, dtype), budget,
                                      profile, inner_steps=pinned.get("inner_steps"),
                                      codec=pinned.get("outer_codec")).plan

    @override
    def plan_ready(self, plan: Plan) -> None:
        self.plan = plan

    @override
    def loss_weight(self, counts: tuple[int, int | None], world: int, device: Any) -> float:
        """This rank's count (samples, or counted tokens) over its group's mean (the group's DDP then averages to
        the group's mean loss); the group's count is added to the round's, which weights its pseudo-gradient."""
        local, groups = counts[0], self._require_groups()
        group_count = summed_count(local, device, groups.group) if len(groups.members) > 1 else local
        self._pending_samples += group_count
        return local * len(groups.members) / group_count if group_count else 0.0

    @override
    def ddp_process_group(self) -> Any:
        return self._require_groups().group

    def _require_groups(self) -> DiLoCoGroups:
        if self.groups is None:
            raise RuntimeError("hetero_diloco: the groups are made in setup_environment")
        return self.groups

    # -- setup and teardown -------------------------------------------------------------------------
    @override
    def environment_ready(self, strategy: Any, cluster: ClusterSpec, given: Plan | None, timeout: Any) -> None:
        """Every group's process group: the given plan's groups, or the ``groups`` option's (a collective)."""
        self.cluster = cluster
        names = given.outer_sync.groups if given is not None and given.outer_sync else resolve_groups(
            cluster, self.options.groups, "groups")
        self.groups = build_groups(names, [d.name for d in cluster.devices], strategy.global_rank, timeout)
        rank_debug(strategy.global_rank, "hetero_diloco: group %d of %s", self.groups.index, self.groups.ranks)

    @override
    def teardown(self) -> None:
        """This rank's group process groups (``setup_environment`` makes new ones)."""
        if self.groups is not None and dist.is_initialized():
            for group in {self.groups.group, self.groups.leaders} - {None, dist.GroupMember.NON_GROUP_MEMBER}:
                dist.destroy_process_group(group)
        self.groups = None

    @override
    def setup_done(self, strategy: Any, trainer: Any) -> None:
        if trainer.state.fn == "fit" and len(strategy.optimizers) != 1:
            raise field_error("configure_optimizers", f"{len(strategy.optimizers)} optimizers",
                              "return one optimizer (hetero_diloco's inner optimizer)")

    @override
    def before_ddp(self, strategy: Any) -> None:
        """Every group starts from rank 0's parameters, sent to the groups' leaders here (once over the link), to
        each group's ranks by its DDP's initial broadcast; or from its checkpointed ones."""
        groups = self._require_groups()
        if self._restored is None and groups.leaders is not None:
            with torch.no_grad():
                for tensor in [*strategy.model.parameters(), *strategy.model.buffers()]:
                    dist.broadcast(tensor.data, src=0, group=groups.leaders)

    @override
    def after_ddp(self, strategy: Any) -> None:
        """The outer loop takes the module's parameters as its outer parameters (or the checkpoint's)."""
        params = [p for p in strategy.lightning_module.parameters() if p.requires_grad]
        self.outer = OuterLoop(params, self.options.make_outer_optimizer)
        restored = self._restored
        if restored is not None:
            self.outer.load_state_dict(restored["shared"], restored["round_samples"], restored["residual"],
                                       restored["codec"])

    def _start_rounds(self, strategy: Any) -> None:
        """The plan's H and codec for the outer loop (once, at the first inner step of the fit)."""
        assert self.outer is not None  # invariant: called after after_ddp built it
        plan, cluster, groups = self.plan, self.cluster, self._require_groups()
        if plan is None or plan.outer_sync is None or cluster is None:
            raise ConfigError("hetero_diloco: no low-communication plan when training started", field="plan")
        sync = plan.outer_sync
        if group_ranks(sync.groups, [d.name for d in cluster.devices]) != groups.ranks:
            raise field_error("plan.outer_sync.groups", [list(g) for g in sync.groups],
                              f"be the run's groups (ranks {[list(r) for r in groups.ranks]})")
        self.outer.run(sync.inner_steps, OuterExchange(sync.codec, groups))
        if strategy.global_rank == 0:
            predicted = plan.predicted
            logger.info("hetero_diloco: %d groups %s, an outer step every %d inner steps, exchange in %s%s",
                        groups.count, [list(g) for g in sync.groups], sync.inner_steps, sync.codec,
                        f" (predicted {predicted['round_s']:.3g} s per outer round)" if "round_s" in predicted
                        else "")

    # -- steps ----------------------------------------------------------------------------------------
    @override
    def after_optimizer_step(self, strategy: Any) -> None:
        """The inner step is done; after H of them, the outer step."""
        if self.outer is None:
            return
        if self.outer.exchange is None:
            self._start_rounds(strategy)
        samples, self._pending_samples = self._pending_samples, 0
        self._logged(strategy, self.outer.inner_step_done(samples))

    def _logged(self, strategy: Any, record: OuterRecord | None) -> None:
        if record is None:
            return
        groups = self._require_groups()
        rank_debug(strategy.global_rank, "outer step %d: %d samples, %d bytes sent, |pseudo-gradient| %.4g",
                   record.round, record.samples, record.bytes_sent, record.pseudo_gradient_norm)
        if strategy.global_rank != 0:
            return
        trainer = strategy.lightning_module.trainer
        metrics = {"diloco/round": float(record.round),
                   "diloco/bytes_per_round": float(record.bytes_sent * groups.count),
                   "diloco/pseudo_grad_norm": record.pseudo_gradient_norm,
                   "diloco/round_samples": float(record.samples)}
        for lightning_logger in trainer.loggers:
            lightning_logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def train_end(self, strategy: Any) -> None:
        """The run's last, partial round is closed: the model ends with the outer parameters."""
        if self.outer is not None:
            self._logged(strategy, self.outer.outer_step())

    @override
    def validation_start(self, strategy: Any) -> None:
        """Validation during fit sees the outer (global) parameters."""
        if self.outer is not None and strategy.lightning_module.trainer.state.fn == "fit":
            self._eval_swap.enter_context(self.outer.outer_in_model())

    @override
    def validation_end(self, strategy: Any) -> None:
        self._eval_swap.close()

    # -- checkpoints ----------------------------------------------------------------------------------
    @override
    def module_state(self, state_of: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The model with the outer parameters (the groups' own ones go in the checkpoint's DiLoCo part)."""
        if self.outer is None:
            return state_of()
        with self.outer.outer_in_model():
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state_of().items()}

    @override
    def add_to_checkpoint(self, strategy: Any, checkpoint: dict[str, Any]) -> None:
        """Every group's part, gathered to rank 0 (a collective)."""
        if self.outer is not None and self.groups is not None:
            part = gather_state(self.outer, self.groups, strategy.optimizers, strategy.global_rank,
                                strategy.world_size)
            if part is not None:
                checkpoint[CHECKPOINT_KEY] = part

    @override
    def checkpoint_loaded(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        self._saved = (checkpoint.get(CHECKPOINT_KEY), str(checkpoint_path))

    @override
    def model_state_loaded(self, strategy: Any) -> None:
        """When fitting, this group's own parameters over the outer ones (the checkpoint's model)."""
        if self._saved is None or strategy.lightning_module.trainer.state.fn != "fit":
            return
        saved, where = self._saved
        self._restored = group_part(saved, self._require_groups(), where)
        if self._restored is not None:
            copy_flat_into([p for p in strategy.lightning_module.parameters() if p.requires_grad],
                           self._restored["local"])

    @override
    def optimizer_state_loaded(self, strategy: Any) -> None:
        """This group's own inner optimizer state (over rank 0's, which Lightning loaded)."""
        if self._restored is not None:
            for optimizer, state in zip(strategy.optimizers, self._restored["inner_optimizers"]):
                optimizer.load_state_dict(state)
