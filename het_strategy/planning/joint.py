"""Placement and compression planned together: the best plan over every inter-node compression choice.

A compression-blind planner prices the gradient sync uncompressed, so behind a
slow inter-node link it leaves devices idle whose sync costs more than their
compute saves — and a controller compressing afterwards cannot bring them
back.  ``search_joint`` searches both: for each method the inter-node hop may
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
from het_strategy.core.compressed_sync import JOINT_CHOICES
from het_strategy.core.errors import ConfigError
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.plan import Plan
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.search import search_plan

__all__ = ["JointResult", "search_joint"]


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


def search_joint(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings, mode: str = "dp",
                 profile: MeasuredProfile | None = None) -> JointResult:
    """Step 2 of ``planning.plan`` for ``PlanRequest(compression="joint")``: the fastest plan over
    ``JOINT_CHOICES`` x placement (see the module docstring), each choice searched in ``mode``."""
    choices = JOINT_CHOICES if len(cluster.nodes) >= 2 else ("none",)
    by_choice: dict[str, Plan] = {}
    errors: list[str] = []
    for token in choices:
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
