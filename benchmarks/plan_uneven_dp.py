"""Planned uneven data-parallel split vs an equal split, on every shipped cluster; on multi-node clusters, the
plan made jointly with the inter-node compression beside the compression-blind one.

Both plans of the first table are pure data parallelism (every device holds
the model, as plain DDP does) and are scored by the same cost model; ratio =
equal-split step time / planned step time (> 1: the planned split is faster).
Clusters whose devices cannot all hold the model are reported and skipped.

The second table (multi-node clusters only) is ``planning.plan`` with
``PlanRequest(compression="joint", mode="dp")``:
placement searched once per inter-node method (none, q8, q4), the fastest
kept.  Its ``blind`` plan is the first table's planned one; ratio = blind step
time / joint step time; "brought back" lists the devices the joint plan trains
on that the blind plan leaves idle (a slow link makes their sync cost more than
their compute saves, until the sync is compressed).  All figures are the cost
model's predictions; ``HeteroStrategy(compression="planned")`` (``het-train
compression=planned``) runs the chosen method as the hierarchical exchange.
Last line: ``RESULT best_ratio=... joint_speedup_max=... joint_devices_back_max=...``.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.shipped import shipped_config_dir
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest, equal_split_plan, plan, search_plan
from het_strategy.planning.joint import JointResult

JOINT_HEADER = (f"{'cluster':<26} {'blind_step_s':>12} {'blind_sps':>9} {'joint_step_s':>12} {'joint_sps':>9} "
                f"{'inter_node':>10} {'ratio':>6}  brought back into use")


def describe_devices(names: Sequence[str], cluster: ClusterSpec) -> str:
    """``4 x T4 (b/0, b/1, b/2, b/3)``; past four devices only the counts per type (``96 x V100-16GB``)."""
    counts = Counter(cluster.device(n).type for n in names)
    kinds = ", ".join(f"{n} x {kind}" for kind, n in sorted(counts.items()))
    return f"{kinds} ({', '.join(names)})" if len(names) <= 4 else kinds


def brought_back_text(joint: JointResult, cluster: ClusterSpec) -> str:
    """The devices the joint plan brings back into use, or ``none`` and how the two device sets compare."""
    blind = joint.blind
    assert blind is not None  # the caller plans with "none" among the choices
    back = joint.brought_back()
    dropped = sorted(set(blind.used_devices) - set(joint.plan.used_devices))
    if not back and not dropped:
        return f"none (the same {len(blind.used_devices)} devices)"
    text = describe_devices(back, cluster) if back else "none"
    if dropped:  # e.g. a slow device's codec time is worth more than its compute once the hop is compressed
        text += f"; leaves idle {describe_devices(dropped, cluster)}"
    return text


def joint_speedup(joint: JointResult) -> float:
    """Blind step time / joint step time (>= 1: the blind plan is among the choices)."""
    assert joint.blind is not None
    return joint.blind.predicted["step_time_s"] / joint.plan.predicted["step_time_s"]


def joint_row(name: str, joint: JointResult, cluster: ClusterSpec) -> str:
    """One line of the joint-vs-blind table (``JOINT_HEADER``)."""
    blind, best = joint.blind, joint.plan
    assert blind is not None
    token = best.compression.get("inter_node", "none")
    return (f"{name:<26} {blind.predicted['step_time_s']:>12.4f} {blind.predicted['samples_per_s']:>9.1f} "
            f"{best.predicted['step_time_s']:>12.4f} {best.predicted['samples_per_s']:>9.1f} {token:>10} "
            f"{joint_speedup(joint):>6.2f}  {brought_back_text(joint, cluster)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--local-model", default="tiny_gpt", help="model for the emulated local_* clusters")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dtype", default="fp16", help="fp16: what V100/T4 train in (they lack bf16)")
    args = ap.parse_args()
    print(f"{'cluster':<26} {'devices':>7} {'equal_step_s':>12} {'planned_step_s':>14} {'ratio':>6}  shares (first 8)")
    best = 0.0
    joint_rows: list[str] = []
    joint_best, most_back = 1.0, 0
    for path in sorted(shipped_config_dir("cluster").glob("*.yaml")):
        cluster = load_cluster(path)
        model = args.local_model if path.stem.startswith("local_") else args.model
        settings = TrainSettings(global_batch_size=max(args.batch, cluster.num_devices), dtype=args.dtype, max_tp=1)
        workload = load_workload(model, dtype=args.dtype)
        cm = CostModel(cluster, workload, settings)
        try:
            planned = search_plan(cluster, workload, settings, mode="dp")
        except ConfigError as exc:
            print(f"{path.stem:<26} {cluster.num_devices:>7}  skipped: {exc}")
            continue
        equal = cm.score(equal_split_plan(cm))
        ratio = equal.step_time_s / planned.predicted["step_time_s"]
        best = max(best, ratio)
        shares = [p.samples for p in planned.pipelines][:8]
        print(f"{path.stem:<26} {cluster.num_devices:>7} {equal.step_time_s:>12.4f} "
              f"{planned.predicted['step_time_s']:>14.4f} {ratio:>6.2f}  {shares}")
        if len(cluster.nodes) > 1:  # one node: no inter-node hop, the joint plan is the blind one
            joint = plan(cluster, workload, settings, PlanRequest(compression="joint", mode="dp")).joint
            joint_rows.append(joint_row(path.stem, joint, cluster))
            joint_best, most_back = max(joint_best, joint_speedup(joint)), max(most_back, len(joint.brought_back()))
    print(f"\nplanned jointly with the inter-node compression (none, q8, q4) vs compression-blind, multi-node "
          f"clusters; predicted (cost model), sps = samples/s, ratio = blind step / joint step:")
    print(JOINT_HEADER)
    print("\n".join(joint_rows))
    print(f"RESULT best_ratio={best:.3f} joint_speedup_max={joint_best:.3f} joint_devices_back_max={most_back}")


if __name__ == "__main__":
    main()
