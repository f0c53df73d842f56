"""Planned uneven data-parallel split vs an equal split, on every shipped cluster.

Both plans are pure data parallelism (every device holds the model, as plain
DDP does) and are scored by the same cost model; ratio = equal-split step time
/ planned step time (> 1: the planned split is faster).  Clusters whose
devices cannot all hold the model are reported and skipped.
Last line: ``RESULT best_ratio=...``.
"""

from __future__ import annotations

import argparse

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel, TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.shipped import shipped_config_dir
from het_strategy.planning import equal_split_plan, plan
from het_strategy.core.workload import load_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt_small")
    ap.add_argument("--local-model", default="tiny_gpt", help="model for the emulated local_* clusters")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--dtype", default="fp16", help="fp16: what V100/T4 train in (they lack bf16)")
    args = ap.parse_args()
    print(f"{'cluster':<26} {'devices':>7} {'equal_step_s':>12} {'planned_step_s':>14} {'ratio':>6}  shares (first 8)")
    best = 0.0
    for path in sorted(shipped_config_dir("cluster").glob("*.yaml")):
        cluster = load_cluster(path)
        model = args.local_model if path.stem.startswith("local_") else args.model
        settings = TrainSettings(global_batch_size=max(args.batch, cluster.num_devices), dtype=args.dtype)
        workload = load_workload(model, dtype=args.dtype)
        cm = CostModel(cluster, workload, settings)
        try:
            planned = plan(cluster, workload, settings, mode="dp")
        except ConfigError as exc:
            print(f"{path.stem:<26} {cluster.num_devices:>7}  skipped: {exc}")
            continue
        equal = cm.score(equal_split_plan(cm))
        ratio = equal.step_time_s / planned.predicted["step_time_s"]
        best = max(best, ratio)
        shares = [p.samples for p in planned.pipelines][:8]
        print(f"{path.stem:<26} {cluster.num_devices:>7} {equal.step_time_s:>12.4f} "
              f"{planned.predicted['step_time_s']:>14.4f} {ratio:>6.2f}  {shares}")
    print(f"RESULT best_ratio={best:.3f}")


if __name__ == "__main__":
    main()
