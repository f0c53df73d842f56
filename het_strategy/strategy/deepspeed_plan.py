"""The cluster and the Plan a ``hetero_deepspeed`` run holds: ``DeepSpeedPlanHolder``.

1. Construction (in the user's script, before any rank starts): a given plan (with an optional ZeRO-stage
   override) is checked against the cluster (``Plan.check_cluster``) and the ``deepspeed`` rule table of
   ``core.runtime_rules``; without a plan, the planning inputs are checked.
2. ``use_precision(precision)`` when the Trainer attaches its precision: the run trains in its dtype
   (``core.runtime_rules.DEEPSPEED_PRECISIONS``); a given plan must be in it, else rank 0 plans in it.
3. ``ensure(rank, world_size)`` at setup: without a plan, rank 0 searches one (``PlanRequest(runtime="deepspeed")``)
   and broadcasts it, so every rank runs the same plan (an error on rank 0 stops every rank with its message);
   then the plan is checked against the launched world (one process per device the plan uses).
4. ``stage_padding(module)``: on an emulated cluster, what ``PlanRunner`` pads each stage with; with
   ``emulation=False`` the emulated speeds are dropped at construction.
A LightningModule holding a Hugging Face model needs no ``workload=``: ``use_module`` takes it from the model's config
at ``seq_len`` tokens (``hf.lightning_adapter.module_workload``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Literal

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.dtypes import Dtype, precision_dtype
from het_strategy.core.errors import ConfigError, alternatives, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import DEEPSPEED_PRECISIONS, Runtime, raise_first, runtime_problems
from het_strategy.core.train_settings import TP_DEGREES, ZERO_STAGES, TrainSettings
from het_strategy.core.workload import WorkloadSpec, load_workload, transformer_workload
from het_strategy.emulation.speeds import cluster_is_emulated
from het_strategy.strategy.elastic import DEVICE_ENV, present_cluster
from het_strategy.planning.request import PlanMode
from het_strategy.strategy.rank_zero import decided_on_rank_zero

__all__ = ["ZeroStage", "DeepSpeedPlanHolder", "load_plan_source"]

ZeroStage = Literal[0, 1, 2, 3]
"""A ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over the replicas."""

def load_plan_source(plan: Any) -> Plan | None:
    """``plan=`` as a ``Plan`` (``None``: plan at setup); a ``ConfigError`` naming ``plan`` otherwise."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise field_error("plan", type(plan).__name__, "be a Plan, a plan JSON path, or None (plan at setup)")


class DeepSpeedPlanHolder:
    """The cluster, the workload and the Plan of a ``hetero_deepspeed`` run (see the module docstring).

    Args:
        cluster: the run's cluster; it holds every device the plan names.
        plan: the ``Plan`` (or its JSON path) to run; ``None``: rank 0 plans at setup.
        zero_stage: ``None`` keeps the plan's (0 when planning); 0 to 3 overrides it.
        workload: the model's layers for the planner (a ``WorkloadSpec``, a shipped model name or a mapping);
            needed when ``plan`` is ``None``.
        global_batch_size: with ``plan=None``: samples per optimizer step.
        planner_mode: with ``plan=None``: the planners searched (``PlanMode``).
        max_tp: with ``plan=None``: the largest tensor-parallel degree the planner may use (``TP_DEGREES``).
        emulation: honour the cluster's emulated speeds (plan with them, pad each stage to them).
        seq_len: the sequence length a Hugging Face model the LightningModule holds is planned and priced at (its
            workload then comes from its config at setup, ``hf.lightning_adapter.module_workload``).
    """

    def __init__(self, cluster: ClusterSpec, plan: Any = None, *, zero_stage: ZeroStage | None = None,
                 workload: Any = None, global_batch_size: int | None = None,
                 planner_mode: PlanMode | str = PlanMode.auto, max_tp: int = 8, emulation: bool = True,
                 seq_len: int | None = None) -> None:
        if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1):
            raise field_error("seq_len", seq_len, "be an integer >= 1 (tokens per sample) or None")
        self.seq_len = seq_len
        """The sequence length a Hugging Face model is planned and priced at (None: not given)."""
        if isinstance(max_tp, bool) or max_tp not in TP_DEGREES:
            raise field_error("max_tp", max_tp, f"be {alternatives(TP_DEGREES)} (the largest tensor-parallel degree "
                              "planned)")
        if zero_stage is not None and (isinstance(zero_stage, bool) or zero_stage not in ZERO_STAGES):
            raise field_error("zero_stage", zero_stage, f"be {alternatives(ZERO_STAGES)} or None (the plan's)")
        # low_communication runs on hetero_diloco, fsdp on hetero_fsdp
        modes = [m for m in PlanMode if m not in (PlanMode.low_communication, PlanMode.fsdp)]
        if planner_mode not in modes:
            raise field_error("planner_mode", planner_mode, f"be one of {', '.join(modes)}")
        self.planner_mode = PlanMode(planner_mode)
        if not isinstance(emulation, bool):
            raise field_error("emulation", emulation, "be true or false")
        self.cluster = cluster if emulation or not cluster_is_emulated(cluster) else cluster.without_emulation()
        """The run's cluster (without its emulated speeds when ``emulation=False``)."""
        self.workload: WorkloadSpec | None = None if workload is None else load_workload(workload, dtype="fp32")
        """The model's layers as the planner prices them (``None`` when not given)."""
        self.plan_summary: str | None = None
        """With planning at setup: how the best runnable plan compares with the unconstrained best."""
        self.settings: TrainSettings | None = None
        """With ``plan=None``: the settings rank 0 plans with."""
        self.dtype = Dtype.fp32
        """The dtype the run trains in (``use_precision``; fp32 until a Trainer attaches its precision)."""
        loaded = load_plan_source(plan)
        if loaded is None:
            if self.workload is None and seq_len is None:
                raise field_error("workload", None, "be given when plan is None (the planner prices its layers)",
                                  "pass workload= (a WorkloadSpec, a shipped model name or mapping), plan=, or "
                                  "seq_len= for a LightningModule holding a Hugging Face model")
            if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
                raise field_error("global_batch_size", global_batch_size, "be an integer >= 1 when plan is None")
            self.settings = TrainSettings(global_batch_size=global_batch_size, dtype="fp32",
                                          zero_stage=zero_stage or 0, max_tp=max_tp)
        else:
            if zero_stage is not None:
                loaded = dataclasses.replace(loaded, zero_stage=zero_stage)
            self.check(loaded)
        self.plan: Plan | None = loaded
        """The plan run (``None`` until ``ensure`` when the strategy plans)."""
        self.present: list[str] | None = None
        """The devices the ranks named (``HET_STRATEGY_DEVICE``) when the cluster is the ones present."""

    def use_devices_present(self, names: list[str] | None) -> None:
        """Under torchrun's elastic agent (``names``: the device each rank named, ``elastic.gather_device_names``):
        the run's cluster is those devices (``elastic.present_cluster``), and rank 0 plans for them at setup; a
        given plan must name exactly them.  ``None``: the cluster as given."""
        if names is None:
            return
        self.cluster = present_cluster(self.cluster, names)
        self.present = names
        if self.plan is not None:
            self.check(self.plan)

    def check(self, plan: Plan, world_size: int | None = None) -> None:
        """Refuse a plan of another cluster, or one the deepspeed runtime cannot run."""
        plan.check_cluster(self.cluster)
        raise_first(runtime_problems(plan, Runtime.deepspeed, world_size))

    def use_module(self, module: Any) -> None:
        """Without a workload given: that of the Hugging Face model ``module`` holds, at ``seq_len``."""
        from het_strategy.hf.lightning_adapter import module_workload

        if self.workload is None:
            self.workload = module_workload(module, self.seq_len, "fp32")
        if self.workload is None and self.plan is None:
            raise field_error("workload", None, f"be given when plan is None ({type(module).__name__} holds no "
                              "Hugging Face model to take it from)", "pass workload= or plan=")

    def limit_tp_to(self, module: Any) -> str | None:
        """Plan with tp = 1 when none of the module's pipeline layers (``hf.lightning_adapter.pipeline_layers_of``)
        has a ``tensor_parallel_plan()``, else with the largest degree up to ``max_tp`` their plans split (a GQA
        model's kv heads, say); only when planning with ``max_tp`` > 1.  Returns the reason to log, or None when
        nothing changed."""
        from het_strategy.hf.lightning_adapter import pipeline_layers_of
        from het_strategy.tensor_parallel.tp_plan import check_layers, tensor_parallel_plan_of

        layers = pipeline_layers_of(module) if self.settings is not None and self.settings.max_tp > 1 else None
        if layers is None:
            return None
        asked = self.settings.max_tp
        if not any(tensor_parallel_plan_of(layer) is not None for layer in layers):
            self.settings = dataclasses.replace(self.settings, max_tp=1)
            return (f"max_tp={asked} is not used: none of {type(module).__name__}'s pipeline layers has a "
                    "tensor_parallel_plan() (het_strategy.TensorParallelPlan), so the plan keeps tp = 1")
        why = ""
        for tp in sorted((t for t in TP_DEGREES if t <= asked), reverse=True):
            try:
                check_layers(layers, 0, tp, tp, "max_tp")
            except ConfigError as err:
                why = why or str(err)
                continue
            if tp == asked:
                return None
            self.settings = dataclasses.replace(self.settings, max_tp=tp)
            return f"max_tp={asked} is lowered to {tp}: {why}"
        return None

    def use_precision(self, precision: Any) -> None:
        """Train in Lightning's ``precision`` (``DEEPSPEED_PRECISIONS``): a given plan must be in its dtype; without
        one, rank 0 plans in it (the deepspeed rule table then applies to that dtype)."""
        if str(precision) not in DEEPSPEED_PRECISIONS:
            raise field_error("Trainer.precision", precision, f"be one of {', '.join(DEEPSPEED_PRECISIONS)} "
                              "(DeepSpeed's bf16 and fp16 keep fp32 master weights: Lightning's -mixed)")
        dtype = precision_dtype(precision)
        if self.plan is not None and self.plan.dtype != dtype:
            raise field_error("plan.dtype", self.plan.dtype, f"be {dtype}, the dtype of Trainer(precision="
                              f"{str(precision)!r})", f"plan with settings.dtype={dtype}, or set the Trainer's "
                              "precision to the plan's")
        if self.settings is not None:
            self.settings = dataclasses.replace(self.settings, dtype=dtype)
        self.dtype = dtype

    def ensure(self, rank: int, world_size: int) -> Plan:
        """The plan every rank runs: the given one, or rank 0's search broadcast; checked against the world and
        the run's dtype."""
        if self.plan is None:
            self.plan = self._plan_on_rank_zero(rank, world_size)
        self.check(self.plan, world_size)
        if self.plan.dtype != self.dtype:
            raise field_error("plan.dtype", self.plan.dtype, f"be {self.dtype}, the dtype the run trains in",
                              "set Trainer(precision=...) to the plan's dtype")
        return self.plan

    def _plan_on_rank_zero(self, rank: int, world_size: int) -> Plan:
        """Rank 0 plans (``planner.runtime=deepspeed``) and broadcasts one Plan; an error stops every rank."""
        from het_strategy.planning import PlanRequest, plan

        settings, workload = self.settings, self.workload
        assert settings is not None and workload is not None  # invariant: no plan given: set by __init__/use_module

        def search() -> tuple[str, str]:
            result = plan(self.cluster, workload, settings, PlanRequest(mode=self.planner_mode,
                                                                         runtime=Runtime.deepspeed))
            self._refuse_idle(result.plan)
            return result.plan.to_json(), result.summary()

        value, summary = decided_on_rank_zero(rank, world_size, search)
        self.plan_summary = summary
        return Plan.from_dict(json.loads(value))

    def _refuse_idle(self, best: Plan) -> None:
        """The best plan leaves a device of the run idle: one line naming it and why (every rank of a
        ``hetero_deepspeed`` run holds a stage, so its process has nothing to run)."""
        idle = [d.name for d in self.cluster.devices if d.name not in best.used_devices]
        if not idle:
            return
        why = "; ".join(f"{d}: {best.idle_reasons.get(d, 'not used by the best plan')}" for d in idle)
        idle_part = f"leaves {', '.join(idle)} idle ({why}), and every hetero_deepspeed rank must hold a stage"
        if self.present is not None:
            raise field_error(DEVICE_ENV, idle[0] if len(idle) == 1 else idle, "name only devices the plan uses: "
                              f"the best plan for the devices present {idle_part}",
                              "stop the agents of the idle devices: torchrun restarts the others without them")
        raise field_error("cluster", self.cluster.name, f"hold only devices the plan uses: its best plan {idle_part}",
                          "launch one process per device the plan uses, with a cluster of those devices")

    def stage_padding(self, module: Any) -> tuple[ClusterSpec | None, WorkloadSpec | None]:
        """``(cluster, workload)`` that ``PlanRunner`` pads each stage to; ``(None, None)`` on real devices."""
        if not cluster_is_emulated(self.cluster):
            return None, None
        if self.workload is not None:
            return self.cluster, self.workload
        from het_strategy.hf.lightning_adapter import module_workload

        hf = module_workload(module, self.seq_len, "fp32")
        if hf is not None:
            return self.cluster, hf
        if not callable(getattr(module, "workload_config", None)):
            raise field_error("workload", None, "be given for an emulated cluster (it prices each stage), or the "
                              "LightningModule must define workload_config()", "pass workload= to the strategy")
        return self.cluster, transformer_workload(module.workload_config(), dtype="fp32")
