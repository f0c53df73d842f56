"""Planning time vs cluster size: 8, 64, 512 and 4,096 devices of 4 types, a 96-layer model.

Each size is planned once in a fresh process-free call on one core (the
planner is single-threaded).  Prints a row per size and, last,
``RESULT devices=4096 seconds=...``.  For reference: HARP's stage
construction took 164 s for three GPUs.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # numpy on one core, as the issue asks
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from het_strategy.core.cluster import cluster_from_dict  # noqa: E402
from het_strategy.core.cost_model import TrainSettings  # noqa: E402
from het_strategy.planning import plan  # noqa: E402
from het_strategy.core.workload import TransformerConfig, transformer_workload  # noqa: E402

TYPES = ("H100-SXM", "A100-80GB", "V100-32GB", "T4")


def scaling_cluster(num_devices: int) -> dict:
    """``num_devices`` split evenly over 4 types, 8 devices per node (fewer when the share is smaller)."""
    per_type = num_devices // len(TYPES)
    per_node = min(8, per_type)
    return {"name": f"scale{num_devices}", "inter_node_bandwidth_gbs": 25,
            "nodes": [{"name": f"{t}-n", "count": per_type // per_node,
                       "devices": [{"type": t, "count": per_node}]} for t in TYPES]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 512, 4096])
    args = ap.parse_args()
    # 96 transformer blocks (+ embedding and head), GPT-style, ~5B parameters
    workload = transformer_workload(TransformerConfig("gpt_96l_h2048", num_layers=96, hidden_size=2048,
                                                      num_heads=16, seq_len=2048, vocab_size=50257))
    print(f"model: {workload.name}, {workload.num_layers} layers, {workload.total_params / 1e9:.1f}B params")
    print(f"{'devices':>8} {'seconds':>8} {'pipelines':>9} {'stages':>8} {'step_s':>8} {'samples/s':>10}")
    last = None
    for n in args.sizes:
        cluster = cluster_from_dict(scaling_cluster(n))
        settings = TrainSettings(global_batch_size=max(2048, n), zero_stage=1, max_tp=8, max_stages=16)
        t0 = time.perf_counter()
        p = plan(cluster, workload, settings, mode="auto")
        seconds = time.perf_counter() - t0
        stages = sorted({len(pipe.stages) for pipe in p.pipelines})
        print(f"{cluster.num_devices:>8} {seconds:>8.2f} {p.num_pipelines:>9} {str(stages):>8} "
              f"{p.predicted['step_time_s']:>8.3f} {p.predicted['samples_per_s']:>10.1f}")
        last = (cluster.num_devices, seconds)
    print(f"RESULT devices={last[0]} seconds={last[1]:.2f}")


if __name__ == "__main__":
    main()
