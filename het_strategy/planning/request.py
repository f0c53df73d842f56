"""What one planning run is asked for: ``PlanRequest``, the ``planner`` section of het-plan and het-train.

``PlanRequest`` names the planner modes, the runtime the plan must run on, the
objective with its budget and throughput floor, whether inter-node compression
is planned with the placement, and whose measured layer times price the
devices.  ``planning.plan(cluster, workload, settings, request)`` answers it.

Every option is a ``StrEnum`` (``core.runtime_rules.Runtime`` for the runtime)
whose member names are the config spellings, as Hydra matches an enum value by
name; the strings ``"dp"``, ``"cost"``, ... compare equal to the members.
``__post_init__`` converts strings and checks every field and the
combinations, each error naming ``planner.<field>``.  The class
is frozen; Hydra composes the ``planner`` section against it (see
``cli/structured.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Mapping, Optional

from het_strategy.core.errors import check_keys, field_error, require_option
from het_strategy.core.runtime_rules import Runtime
from het_strategy.planning.low_communication import OuterSyncBudget

__all__ = ["PlanMode", "Objective", "CompressionPlanning", "ProfileSource", "PlanRequest"]


class PlanMode(StrEnum):
    """Which planners search (``planning/search.py``)."""

    auto = "auto"
    """The best of dp, pipeline, hybrid and fsdp by the cost model."""
    dp = "dp"
    """Uneven data parallelism: one single-device stage per replica."""
    pipeline = "pipeline"
    """One pipeline through every device."""
    hybrid = "hybrid"
    """Pipelines x stages x tensor parallelism x micro-batches."""
    fsdp = "fsdp"
    """Fully sharded data parallelism: shares by speed, each rank's shard of every parameter by its free memory
    (``fsdp``); runs on ``hetero_fsdp``."""
    low_communication = "low_communication"
    """Groups (default: nodes) of uneven data parallelism exchanging every H steps (``low_communication``), shown
    beside the synchronous plan with joint compression; runs on ``hetero_diloco``."""


class Objective(StrEnum):
    """What the best plan minimises."""

    time = "time"
    """Step time."""
    cost = "cost"
    """USD per iteration of the plan's used devices (idle devices are not rented)."""


class CompressionPlanning(StrEnum):
    """Whether the inter-node compression is planned with the placement."""

    none = "none"
    """Syncs priced in ``settings.inter_node_compression`` (default uncompressed)."""
    joint = "joint"
    """Placement x every inter-node method searched together (data parallelism); the plan carries the choice.
    (Mode low_communication always plans its synchronous comparison so.)"""


class ProfileSource(StrEnum):
    """Measured per-layer times that replace datasheet figures."""

    sailor = "sailor"
    """Sailor's published profiles of the models it measured (OPT-350, ...)."""
    measured = "measured"
    """Times measured here from the model itself: ``model=<config.json>`` built from its config (random init) and
    timed per pipeline unit on this machine's device (``hf/layer_profile.py``), filed under its device type."""


@dataclass(frozen=True)
class PlanRequest:
    """One planning request: the ``planner`` section (defaults: the fastest plan of any mode, any runtime)."""

    mode: PlanMode = PlanMode.auto
    """auto | dp | pipeline | hybrid | fsdp | low_communication: the planners searched."""
    runtime: Runtime = Runtime("any")
    """any | deepspeed | hetero | hetero_diloco | hetero_fsdp: only plans that runtime runs (the slowdown against
    the unconstrained best is reported); hetero_diloco runs low_communication plans (mode auto becomes
    low_communication), hetero_fsdp fsdp plans (mode auto becomes fsdp)."""
    compression: CompressionPlanning = CompressionPlanning.none
    """none | joint: placement and inter-node compression planned together (mode dp or auto, runtime any)."""
    objective: Objective = Objective.time
    """time: the fastest plan | cost: the least USD per iteration, searched over sub-clusters."""
    budget_per_hour: Optional[float] = None
    """USD per hour the plan's used devices may cost; null: no cap."""
    min_throughput: Optional[float] = None
    """Samples/s the plan must reach; null: no floor."""
    profile: Optional[ProfileSource] = None
    """null: datasheet figures | sailor: Sailor's measured per-layer times of the model | measured: the Hugging
    Face model of ``model=<config.json>`` timed per layer on this machine's device."""
    outer_sync: OuterSyncBudget = field(default_factory=OuterSyncBudget)
    """mode low_communication: the largest H, the exchange's share of a round, the codecs, groups and split."""

    def __post_init__(self) -> None:
        convert = object.__setattr__  # frozen: the checked enum members replace the given strings
        convert(self, "mode", require_option(PlanMode, self.mode, "planner.mode", "the planners searched"))
        convert(self, "runtime", require_option(Runtime, self.runtime, "planner.runtime",
                                                "the strategy the plan runs on"))
        convert(self, "compression", require_option(
            CompressionPlanning, self.compression, "planner.compression",
            "none: compression-blind; joint: placement and inter-node compression planned together"))
        convert(self, "objective", require_option(
            Objective, self.objective, "planner.objective",
            "time: the fastest plan; cost: the least USD per iteration, idle devices not rented"))
        if self.profile is not None:
            convert(self, "profile", require_option(ProfileSource, self.profile, "planner.profile",
                                                    "sailor: Sailor's measured per-layer times; measured: the "
                                                    "model timed here; null: datasheet figures"))
        for key, unit in (("budget_per_hour", "USD per hour for the plan's used devices"),
                          ("min_throughput", "samples/s")):
            value = getattr(self, key)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise field_error(f"planner.{key}", value, f"be null or a number > 0 ({unit})")
        if isinstance(self.outer_sync, Mapping):  # the Python API may give the section as a mapping
            check_keys(self.outer_sync, {f.name for f in fields(OuterSyncBudget)}, "planner.outer_sync")
            convert(self, "outer_sync", OuterSyncBudget(**self.outer_sync))
        elif not isinstance(self.outer_sync, OuterSyncBudget):
            raise field_error("planner.outer_sync", self.outer_sync, "be a mapping of max_inner_steps, "
                              "max_sync_overhead, codecs, groups and split")
        self._check_low_communication()
        self._check_fsdp()
        if self.compression == CompressionPlanning.joint and self.mode != PlanMode.low_communication and (
                self.mode not in (PlanMode.dp, PlanMode.auto) or self.runtime != "any"):
            raise field_error("planner.compression", "joint", "go with planner.mode=dp (or auto) and "
                              "planner.runtime=any: the hetero strategy runs the hierarchical exchange for "
                              "data-parallel plans")
        if self.runtime == Runtime.hetero and self.mode in (PlanMode.pipeline, PlanMode.hybrid):
            raise field_error("planner.mode", str(self.mode), "be dp or auto with planner.runtime=hetero (the hetero "
                              "strategy runs pure data-parallel plans)", "run pipeline plans with "
                              "planner.runtime=deepspeed")

    def _check_low_communication(self) -> None:
        """``runtime=hetero_diloco`` goes with mode low_communication (auto is read as it); that mode runs on
        any or hetero_diloco, with the time objective, no budget and no floor."""
        if self.runtime == Runtime.hetero_diloco:
            if self.mode == PlanMode.auto:
                object.__setattr__(self, "mode", PlanMode.low_communication)
            elif self.mode != PlanMode.low_communication:
                raise field_error("planner.runtime", "hetero_diloco", "go with planner.mode=low_communication (or "
                                  f"auto), not {self.mode}: hetero_diloco runs low-communication plans")
        if self.mode != PlanMode.low_communication:
            return
        if self.runtime not in (Runtime.any, Runtime.hetero_diloco):
            raise field_error("planner.mode", "low_communication", "go with planner.runtime=any or hetero_diloco "
                              f"(not {self.runtime}): only hetero_diloco runs low-communication plans")
        if self.searches_sub_clusters:
            key = "objective" if self.objective != Objective.time else \
                next(k for k in ("budget_per_hour", "min_throughput") if getattr(self, k) is not None)
            raise field_error(f"planner.{key}", str(getattr(self, key)), "stay at its default (objective time, no "
                              "budget_per_hour or min_throughput) with planner.mode=low_communication, which plans "
                              "the whole cluster")

    def _check_fsdp(self) -> None:
        """``runtime=hetero_fsdp`` goes with mode fsdp (auto is read as it); mode fsdp with runtime any or
        hetero_fsdp."""
        if self.runtime == Runtime.hetero_fsdp:
            if self.mode == PlanMode.auto:
                object.__setattr__(self, "mode", PlanMode.fsdp)
            elif self.mode != PlanMode.fsdp:
                raise field_error("planner.runtime", "hetero_fsdp", f"go with planner.mode=fsdp (or auto), not "
                                  f"{self.mode}: hetero_fsdp runs fully sharded plans")
        if self.mode == PlanMode.fsdp and self.runtime not in (Runtime.any, Runtime.hetero_fsdp):
            raise field_error("planner.mode", "fsdp", f"go with planner.runtime=any or hetero_fsdp (not "
                              f"{self.runtime}): only hetero_fsdp runs fully sharded plans")

    @property
    def searches_sub_clusters(self) -> bool:
        """A money objective, budget or floor: the search runs over sub-clusters (``planning/objective.py``)."""
        return self.objective != Objective.time or self.budget_per_hour is not None \
            or self.min_throughput is not None

    def describe_objective(self) -> str:
        """``objective cost (budget $8/hour, floor 50 samples/s)``."""
        limits = ([f"budget ${self.budget_per_hour:g}/hour"] if self.budget_per_hour is not None else []) + \
            ([f"floor {self.min_throughput:g} samples/s"] if self.min_throughput is not None else [])
        return f"objective {self.objective}" + (f" ({', '.join(limits)})" if limits else "")

    def objective_dict(self) -> dict[str, Any]:
        """The objective as the plan JSON records it (``predicted.objective``)."""
        return {"objective": str(self.objective), "budget_per_hour": self.budget_per_hour,
                "min_throughput": self.min_throughput}
