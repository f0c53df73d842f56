"""``HeteroDiLoCoStrategy``: the ``hetero_diloco`` Lightning strategy, DiLoCo across groups of unequal devices.

``Trainer(strategy="hetero_diloco")`` (after ``import het_strategy``) runs the
``hetero`` strategy inside each group of devices, and exchanges parameters
between the groups every H steps instead of gradients every step:

1. **Groups** (``diloco/groups.py``) — one per node of the cluster YAML by
   default (``groups="device"`` or explicit lists); each group's DDP all-reduces
   over the group only, so no step crosses the slow link.
2. **Inner steps** — the user's own optimizer from ``configure_optimizers``.  The
   global batch is split by the plan's shares over every device: a faster group
   gets more samples per inner step, so every group finishes its H steps
   together.  (More samples per step rather than more steps per round: Lightning
   runs one loop in which every rank takes the same steps, so checkpoints,
   validation, schedulers and loggers keep a step count common to all ranks.)
   Each rank's loss is weighted so its group's DDP average is the mean over the
   group's samples.
3. **Outer step** (``diloco/outer_loop.py``, ``diloco/outer_exchange.py``) —
   after H inner steps, the groups' pseudo-gradients (outer minus local
   parameters) are averaged, weighted by each group's samples of the round,
   through the plan's codec with error feedback; the outer optimizer (Nesterov
   SGD by default) steps on the average and every group restarts from the new
   outer parameters.  A run's last, partial round is closed at the end of fit.
4. **Plan** — ``plan=`` a low-communication plan (``het-plan
   planner.mode=low_communication``), or planned at setup: H, the codec and the
   split from the devices' speeds, the link and the quality budget
   (``planning/low_communication.py``); ``inner_steps=`` / ``outer_codec=`` pin
   either.
5. **Lightning** — validation and the checkpoint's ``state_dict`` hold the outer
   parameters; the checkpoint adds every group's own parameters, inner optimizer
   state, round position and residual (``diloco/group_state.py``), and resume
   is exact.  The loggers get ``diloco/round``, ``diloco/bytes_per_round``,
   ``diloco/pseudo_grad_norm`` at each outer step.

Written on ``HeteroStrategy``; its ``pytorch_lightning`` twin is ``HeteroDiLoCoStrategyPL``.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
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
from het_strategy.planning.run_plan import checked_run_plan, data_parallel_settings
from het_strategy.planning.low_communication import resolve_groups
from het_strategy.strategy.diloco_options import PLANNED, DiLoCoOptions
from het_strategy.strategy.hetero import HeteroStrategy

__all__ = ["HeteroDiLoCoStrategy"]


class HeteroDiLoCoStrategy(HeteroStrategy):
    """DiLoCo over groups of uneven data parallelism, planned for a heterogeneous cluster (module docstring).

    Args:
        cluster: as ``HeteroStrategy`` (the other arguments of ``HeteroStrategy`` are taken too).
        plan: a low-communication plan (it carries ``outer_sync``), or None to plan at setup.
        inner_steps: H, inner steps per outer step, or ``"planned"``.
        outer_codec: the outer exchange's codec (``none``, ``fp16``, ``bf16``, ``q8`` ... ``q2``) or
            ``"planned"``.
        groups: ``"node"`` (one group per node), ``"device"``, or lists of device names.
        split: ``"planned"`` (samples per inner step by speed) or ``"even"`` (the same for every device).
        max_inner_steps: the planner's quality budget: the largest H.
        max_sync_overhead: the fraction of an outer round the planner lets the exchange take.
        outer_codecs: the codecs the planner may choose, the most faithful first.
        outer_lr: the default outer optimizer's (Nesterov SGD) learning rate.
        outer_momentum: its momentum.
        outer_optimizer: ``params -> torch.optim.Optimizer`` instead of the default.
        **hetero_kwargs: ``HeteroStrategy``'s arguments (``workload``, ``global_batch_size``, ...).
    """

    strategy_name = "hetero_diloco"
    runtime = Runtime.hetero_diloco

    def __init__(self, cluster: str | Path | ClusterSpec | dict = "auto", plan: str | Path | Plan | None = None, *,
                 inner_steps: int | str = PLANNED, outer_codec: str = PLANNED, groups: Any = "node",
                 split: str = "planned", max_inner_steps: int = 500, max_sync_overhead: float = 0.05,
                 outer_codecs: tuple[str, ...] | list[str] = ("none", "fp16", "q8", "q4"), outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, outer_optimizer: Callable[[list[Any]], Any] | None = None,
                 **hetero_kwargs: Any) -> None:
        for key, why in (("compression", "the groups' gradients stay inside the group; the outer exchange's codec "
                                         "is outer_codec="),
                         ("rebalance", "live rebalancing re-plans a synchronous split; the inner split is "
                                       "planned once per fit")):
            if hetero_kwargs.get(key) is not None:
                raise field_error(key, type(hetero_kwargs[key]).__name__, f"be None for hetero_diloco ({why})")
        self.options = DiLoCoOptions(inner_steps, outer_codec, groups, split, max_inner_steps, max_sync_overhead,
                                     tuple(outer_codecs), outer_lr, outer_momentum, outer_optimizer)
        """The outer loop's options, checked."""
        super().__init__(cluster, plan, **hetero_kwargs)
        given = self.plans.plan_source
        if isinstance(self.plans.cluster_source, ClusterSpec) and given is None:
            resolve_groups(self.plans.cluster_source, self.options.groups, "groups")  # a split missing a device
        if given is not None:
            for name, value in {**self.options.pinned(), "groups": groups, "split": split}.items():
                if value not in (PLANNED, "node", "planned"):
                    raise field_error(name, value, "be left at its default when plan= is given (the plan's "
                                      f"outer_sync sets it: {given.outer_sync.to_dict() if given.outer_sync else {}})")
        self.groups: DiLoCoGroups | None = None
        """This rank's groups (from ``setup_environment``)."""
        self.outer: OuterLoop | None = None
        """The outer parameters, optimizer and round (from ``configure_ddp``)."""
        self._saved: tuple[Any, str] | None = None
        self._restored: dict[str, Any] | None = None
        self._pending_samples = 0
        self._eval_swap = ExitStack()

    # -- the plan -----------------------------------------------------------------------------------
    @override
    def run_plan(self, cluster: ClusterSpec, workload: WorkloadSpec, global_batch: int, dtype: str,
                 given: Plan | None, profile: MeasuredProfile | None) -> Plan:
        """``given`` checked, or the low-communication planner's choice for this cluster and budget."""
        if given is not None:
            return checked_run_plan(given, cluster, workload, global_batch, dtype, Runtime.hetero_diloco)
        from het_strategy.planning.low_communication import plan_low_communication

        o = self.options
        budget = dataclasses.replace(o.budget, groups=resolve_groups(cluster, o.groups, "groups"))
        pinned = o.pinned()
        return plan_low_communication(cluster, workload, data_parallel_settings(global_batch, dtype), budget,
                                      profile, inner_steps=pinned.get("inner_steps"),
                                      codec=pinned.get("outer_codec")).plan

    # -- setup --------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        """The hetero setup, then every group's process group (the plan's groups, or the ``groups`` option's)."""
        super().setup_environment()
        cluster = self.plans.require_cluster()
        given = self.plans.plan_source
        names = given.outer_sync.groups if given is not None and given.outer_sync else resolve_groups(
            cluster, self.options.groups, "groups")
        self.groups = build_groups(names, [d.name for d in cluster.devices], self.global_rank, self._timeout)
        rank_debug(self.global_rank, "hetero_diloco: group %d of %s", self.groups.index, self.groups.ranks)

    @override
    def teardown(self) -> None:
        """The hetero teardown, then this rank's group process groups (``setup_environment`` makes new ones)."""
        super().teardown()
        if self.groups is not None and dist.is_initialized():
            for group in {self.groups.group, self.groups.leaders} - {None, dist.GroupMember.NON_GROUP_MEMBER}:
                dist.destroy_process_group(group)
        self.groups = None

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == "fit" and len(self.optimizers) != 1:
            raise field_error("configure_optimizers", f"{len(self.optimizers)} optimizers",
                              "return one optimizer (hetero_diloco's inner optimizer)")

    @override
    def configure_ddp(self) -> None:
        """Each group's DDP over its own process group; every group starts from rank 0's parameters (sent to the
        groups' leaders here, to each group's ranks by its DDP's initial broadcast), or from its checkpointed ones;
        the outer loop takes them as its outer parameters."""
        groups = self._require_groups()
        if self._restored is None and groups.leaders is not None:  # rank 0 leads its group: once over the link
            with torch.no_grad():
                for tensor in [*self.model.parameters(), *self.model.buffers()]:
                    dist.broadcast(tensor.data, src=0, group=groups.leaders)
        self._ddp_kwargs["process_group"] = groups.group
        super().configure_ddp()
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        self.outer = OuterLoop(params, self.options.make_outer_optimizer)
        restored = self._restored
        if restored is not None:
            self.outer.load_state_dict(restored["shared"], restored["round_samples"], restored["residual"],
                                       restored["codec"])

    def _require_groups(self) -> DiLoCoGroups:
        if self.groups is None:
            raise RuntimeError("hetero_diloco: the groups are made in setup_environment")
        return self.groups

    def _start_rounds(self) -> None:
        """The plan's H and codec for the outer loop (once, at the first inner step of the fit)."""
        assert self.outer is not None  # invariant: called from optimizer_step once configure_ddp built it
        plan, cluster, groups = self.plans.plan, self.plans.require_cluster(), self._require_groups()
        if plan is None or plan.outer_sync is None:
            raise ConfigError("hetero_diloco: no low-communication plan when training started", field="plan")
        sync = plan.outer_sync
        if group_ranks(sync.groups, [d.name for d in cluster.devices]) != groups.ranks:
            raise field_error("plan.outer_sync.groups", [list(g) for g in sync.groups],
                              f"be the run's groups (ranks {[list(r) for r in groups.ranks]})")
        self.outer.run(sync.inner_steps, OuterExchange(sync.codec, groups))
        if self.global_rank == 0:
            predicted = plan.predicted
            logger.info("hetero_diloco: %d groups %s, an outer step every %d inner steps, exchange in %s%s",
                        groups.count, [list(g) for g in sync.groups], sync.inner_steps, sync.codec,
                        f" (predicted {predicted['round_s']:.3g} s per outer round)" if "round_s" in predicted
                        else "")

    # -- steps --------------------------------------------------------------------------------------
    @override
    def loss_weight(self) -> float | None:
        """This rank's samples over its group's mean (the group's DDP then averages to the group's mean loss);
        the group's samples are added to the round."""
        counts = self.batches.counts
        if counts is None:
            return None
        local, groups = counts[0], self._require_groups()
        total = torch.tensor([local], dtype=torch.int64, device=self.root_device)
        if len(groups.members) > 1:
            dist.all_reduce(total, group=groups.group)
        group_samples = int(total.item())
        self._pending_samples += group_samples
        return local * len(groups.members) / group_samples if group_samples else 0.0

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The inner step; after H of them, the outer step."""
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.outer is not None and self.lightning_module.trainer.training:
            if self.outer.exchange is None:
                self._start_rounds()
            samples, self._pending_samples = self._pending_samples, 0
            self._logged(self.outer.inner_step_done(samples))
        return out

    def _logged(self, record: OuterRecord | None) -> None:
        if record is None:
            return
        groups = self._require_groups()
        rank_debug(self.global_rank, "outer step %d: %d samples, %d bytes sent, |pseudo-gradient| %.4g",
                   record.round, record.samples, record.bytes_sent, record.pseudo_gradient_norm)
        trainer = self.lightning_module.trainer
        if self.global_rank != 0:
            return
        metrics = {"diloco/round": float(record.round),
                   "diloco/bytes_per_round": float(record.bytes_sent * groups.count),
                   "diloco/pseudo_grad_norm": record.pseudo_gradient_norm,
                   "diloco/round_samples": float(record.samples)}
        for lightning_logger in trainer.loggers:
            lightning_logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def on_train_end(self) -> None:
        """The run's last, partial round is closed: the model ends with the outer parameters."""
        if self.outer is not None:
            self._logged(self.outer.outer_step())
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        """Validation during fit sees the outer (global) parameters."""
        super().on_validation_start()
        if self.outer is not None and self.lightning_module.trainer.state.fn == "fit":
            self._eval_swap.enter_context(self.outer.outer_in_model())

    @override
    def on_validation_end(self) -> None:
        self._eval_swap.close()
        super().on_validation_end()

    # -- checkpoints --------------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model with the outer parameters (the groups' own ones go in the strategy's part)."""
        if self.outer is None:
            return super().lightning_module_state_dict()
        with self.outer.outer_in_model():
            state = super().lightning_module_state_dict()
            return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Adds every group's part, gathered to rank 0 (a collective)."""
        if self.outer is not None and self.groups is not None:
            part = gather_state(self.outer, self.groups, self.optimizers, self.global_rank, self.world_size)
            if part is not None:
                checkpoint[CHECKPOINT_KEY] = part
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self._saved = (checkpoint.get(CHECKPOINT_KEY), str(checkpoint_path))
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The outer parameters (the checkpoint's model), then, when fitting, this group's own parameters."""
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._saved is None or self.lightning_module.trainer.state.fn != "fit":
            return
        saved, where = self._saved
        self._restored = group_part(saved, self._require_groups(), where)
        if self._restored is not None:
            copy_flat_into([p for p in self.lightning_module.parameters() if p.requires_grad],
                           self._restored["local"])

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning's (rank 0's optimizer), then this group's own inner optimizer state."""
        super().load_optimizer_state_dict(checkpoint)
        if self._restored is not None:
            for optimizer, state in zip(self.optimizers, self._restored["inner_optimizers"]):
                optimizer.load_state_dict(state)
