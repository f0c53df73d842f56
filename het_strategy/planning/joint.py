"""Placement and compression planned together: the best plan over every inter-node compression choice.

A compression-blind planner prices the gradient sync uncompressed, so behind a
slow inter-node link it leaves devices idle whose sync costs more than their
compute saves — and a controller compressing afterwards cannot bring them
back.  ``plan_jointly`` searches both: for each method the inter-node hop may
run in (``compressed_sync.JOINT_CHOICES``: uncompressed, and the quantizers
within the adaptive controller's quality budget), the planner's exact search
over placement with the sync priced in that method; the fastest wins.  A
one-node cluster has no inter-node hop: the blind plan is returned.

The chosen method is recorded in ``plan.compression`` (``{"inter_node":
"q4"}``), which ``compression="planned"`` turns into the hierarchical
exchange; ``JointResult`` keeps every choice's plan, so a report can show what
compression brought back into use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.compressed_sync import JOINT_CHOICES, check_token
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.search import search_plan

__all__ = ["JointResult", "plan_jointly"]


@dataclass
class JointResult:
    plan: Plan
    """The fastest plan, its ``compression`` set."""
    by_choice: dict[str, Plan]
    """Every choice's best plan (``none``: the compression-blind plan)."""

    @property
    def blind(self) -> Plan | None:
        return self.by_choice.get("none")

    def brought_back(self) -> list[str]:
        """Devices the joint plan uses that the compression-blind plan leaves idle."""
        blind = self.blind
        if blind is None:
            return []
        return sorted(set(self.plan.used_devices) - set(blind.used_devices))


def plan_jointly(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, mode: str = "dp",
                 profile: MeasuredProfile | None = None, choices: tuple[str, ...] = JOINT_CHOICES) -> JointResult:
    """The fastest plan over ``choices`` x placement (see the module docstring); ``planning.plan`` runs it for
    ``PlanRequest(compression="joint")`` in mode dp."""
    if not choices:
        raise field_error("planner.compression_choices", list(choices), "name at least one method token")
    for i, token in enumerate(choices):
        check_token(token, f"planner.compression_choices[{i}]")
    if len(cluster.nodes) < 2:
        choices = ("none",)
    by_choice: dict[str, Plan] = {}
    errors: list[str] = []
    for token in dict.fromkeys(choices):
        try:
            found = search_plan(cluster, workload, dataclasses.replace(settings, inter_node_compression=token), mode,
                           profile)
        except ConfigError as exc:
            errors.append(f"{token}: {exc}")
            continue
        by_choice[token] = found
    if not by_choice:
        raise ConfigError("no plan fits with any inter-node compression: " + "; ".join(errors), field="planner")
    best = min(by_choice, key=lambda t: (by_choice[t].predicted["step_time_s"], t != "none"))
    return JointResult(by_choice[best], by_choice)
