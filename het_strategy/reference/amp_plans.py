"""AMP's measured plans on its V100 + T4 cluster, as our Plans (reference data for the cost model).

AMP (Li, Wang, Xing, Zhang; NeurIPS 2022) ran its top-ranked strategies for
GPT-2 (24 blocks, hidden 1024, sequence 1024, global batch 32) on 3 AWS
p3.8xlarge (4 V100-16GB each) + 1 g4dn.12xlarge (4 T4) and logged the measured
iteration times (``data/amp/measured_plans.json`` names the source).  This
module rebuilds the six micro-batch-1 plans on the shipped ``amp_v100_t4``
cluster: AMP's logged stage boundaries (its 30-entry layer list mapped onto our
26 layers: embedding, 24 blocks, head) and DeepSpeed's rank order
(``rank = tp_index + tp * dp_index + tp * dp * stage`` over the nodes in order,
the T4 node last).  Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.workload import WorkloadSpec

__all__ = ["AMP_DATA", "AmpMeasuredPlan", "amp_measured_plans"]

AMP_DATA = Path(__file__).with_name("data") / "amp" / "measured_plans.json"


@dataclass(frozen=True)
class AmpMeasuredPlan:
    """One of AMP's measured strategies and its rebuilt Plan."""

    mbs: int
    tp: int
    dp: int
    pp: int
    measured_s: float
    """AMP's measured iteration time on the real cluster."""
    amp_predicted_s: float
    """AMP's own cost model's prediction."""
    plan: Plan

    @property
    def label(self) -> tuple[int, int, int, int]:
        return (self.mbs, self.tp, self.dp, self.pp)


def _our_boundary(amp_boundary: int, num_layers: int) -> int:
    """AMP's list: 0-1 embedding, 2-25 the 24 blocks, 26-29 the head; ours: 0 embedding, 1-24 blocks, 25 head."""
    if amp_boundary <= 1:
        return 0
    return amp_boundary - 1 if amp_boundary < 26 else num_layers


def amp_measured_plans(cluster: ClusterSpec, workload: WorkloadSpec) -> list[AmpMeasuredPlan]:
    """AMP's measured plans on ``cluster`` (``amp_v100_t4``) for ``workload`` (``gpt2_amp``)."""
    data = json.loads(AMP_DATA.read_text())
    names = [d.name for d in cluster.devices]
    L = workload.num_layers
    out = []
    for entry in data["plans"]:
        tp, dp, pp, mbs = entry["tp"], entry["dp"], entry["pp"], entry["mbs"]
        if entry["boundaries"]:
            bounds = [_our_boundary(b, L) for b in entry["boundaries"]]
        else:  # one micro-batch per pipeline stage count AMP split uniformly
            bounds = [round(i * L / pp) for i in range(pp + 1)]
        batch = data.get("global_batch_size", 32)
        pipes = tuple(Pipeline(tuple(Stage(tuple(names[t + tp * j + tp * dp * s] for t in range(tp)),
                                           (bounds[s], bounds[s + 1])) for s in range(pp)), mbs, batch // dp)
                      for j in range(dp))
        plan = Plan(cluster=cluster.name, cluster_devices=tuple(names), model=workload.fingerprint(),
                    global_batch_size=batch, pipelines=pipes, dtype="fp16", mode="manual")
        out.append(AmpMeasuredPlan(mbs, tp, dp, pp, entry["measured_s"], entry["amp_predicted_s"], plan))
    return out
