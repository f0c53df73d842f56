"""Planning time vs cluster size, and a sweep of small heterogeneous clusters.

Part 1, scaling: 8, 64, 512, 4,096, 16,384 and 131,072 devices of 4 types (H100,
A100-80GB, V100-32GB, T4; 8 a node), a 96-block model (~5B parameters), ZeRO 1,
max_tp 8, max_stages 16, batch max(2048, devices).  For reference: HARP's
stage construction took 164 s for three GPUs.

Part 2, small clusters: 5-12 devices of 3-4 types (mixes with uneven counts,
several types a node and one type a node, the shipped ``mixed_vendors`` and
``mixed_a100_v100_t4`` and ``mixed_vendors`` with one ``count`` removed: 1
MI250X, 4 A100-80GB, 2 L4) and a few of 16-64 devices, each planned for
``gpt_small``, ``opt350`` and ``gpt_96l`` (GPT-3 175B: mostly nothing fits,
which must be found fast too) with het-plan's default settings (batch 64) and
with max_tp 8.  The worst time is printed.

Every plan is a fresh ``search_plan(..., mode="auto")`` on one core (the planner is
single-threaded; numpy is pinned to one thread).  ``--repeat N`` plans each N
times and reports the median.  The last line is
``RESULT devices=4096 seconds=... devices_16384_seconds=... devices_131072_seconds=... worst_small_seconds=...
worst_small_cluster=<name>``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # numpy on one core, as the issue asks
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml  # noqa: E402

from het_strategy.core.cluster import cluster_from_dict  # noqa: E402
from het_strategy.core.train_settings import TrainSettings  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.shipped import config_file  # noqa: E402
from het_strategy.core.workload import TransformerConfig, load_workload, transformer_workload  # noqa: E402
from het_strategy.planning import search_plan  # noqa: E402

TYPES = ("H100-SXM", "A100-80GB", "V100-32GB", "T4")
SIZES = (8, 64, 512, 4096, 16384, 131072)
SMALL_MODELS = ("gpt_small", "opt350", "gpt_96l")


def scaling_cluster(num_devices: int) -> dict:
    """``num_devices`` split evenly over 4 types, 8 devices per node (fewer when the share is smaller)."""
    per_type = num_devices // len(TYPES)
    per_node = min(8, per_type)
    return {"name": f"scale{num_devices}", "inter_node_bandwidth_gbs": 25,
            "nodes": [{"name": f"{t}-n", "count": per_type // per_node,
                       "devices": [{"type": t, "count": per_node}]} for t in TYPES]}


def _cluster(name: str, *nodes: list[tuple[str, int]], inter: float = 25) -> dict:
    """A cluster dict: one node per argument, each a list of (type, count)."""
    return {"name": name, "inter_node_bandwidth_gbs": inter,
            "nodes": [{"name": f"n{i}", "devices": [{"type": t, "count": c} for t, c in devs]}
                      for i, devs in enumerate(nodes)]}


def _shipped(name: str) -> dict:
    raw = yaml.safe_load(config_file("cluster", name).read_text())
    return {"name": name, **raw}


def mixed_vendors_without_count() -> dict:
    """The shipped ``mixed_vendors`` with its first device entry's ``count`` removed (1 MI250X, 7 devices)."""
    raw = copy.deepcopy(_shipped("mixed_vendors"))
    raw["name"] = "mixed_vendors_7"
    raw["nodes"][0]["devices"][0].pop("count", None)
    return raw


def small_clusters() -> list[dict]:
    """5-12 devices of 3-4 types, then a few of 16-64 devices (module docstring)."""
    return [
        mixed_vendors_without_count(),
        _shipped("mixed_vendors"),
        _shipped("mixed_a100_v100_t4"),
        _cluster("c5_3types_1node", [("H100-SXM", 1), ("A100-80GB", 2), ("T4", 2)]),
        _cluster("c5_4types_2nodes", [("A100-80GB", 2), ("V100-32GB", 1)], [("T4", 1), ("L4", 1)]),
        _cluster("c6_3types_pernode", [("A100-40GB", 3)], [("V100-32GB", 2)], [("T4", 1)]),
        _cluster("c6_4types_1node", [("H100-SXM", 1), ("A100-40GB", 1), ("V100-16GB", 2), ("T4", 2)]),
        _cluster("c7_4types_mixed", [("H100-SXM", 1), ("A10G", 2)], [("V100-16GB", 3), ("L4", 1)]),
        _cluster("c8_4types_1node", [("H100-SXM", 2), ("A100-80GB", 2), ("V100-32GB", 2), ("T4", 2)]),
        _cluster("c8_4types_pernode", [("H100-SXM", 2)], [("A100-80GB", 2)], [("V100-32GB", 2)], [("T4", 2)]),
        _cluster("c8_3types_uneven", [("H100-SXM", 1)], [("A100-80GB", 5)], [("T4", 2)]),
        _cluster("c8_4types_uneven", [("H100-SXM", 1), ("A100-80GB", 4)], [("V100-32GB", 2), ("T4", 1)]),
        _cluster("c8_4types_2nodes", *[[("H100-SXM", 1), ("A100-80GB", 1), ("V100-32GB", 1), ("T4", 1)]] * 2),
        _cluster("c8_1gpu_nodes", *[[(t, 1)] for t in ("H100-SXM", "H100-SXM", "A100-80GB", "A100-80GB",
                                                       "V100-32GB", "V100-32GB", "T4", "T4")]),
        _cluster("c6_1gpu_nodes", *[[(t, 1)] for t in ("A100-40GB", "A100-40GB", "V100-16GB", "V100-16GB",
                                                       "L4", "L4")]),
        _cluster("c9_3types", [("A100-40GB", 4)], [("V100-32GB", 3), ("T4", 2)]),
        _cluster("c11_4types", [("H100-SXM", 1), ("A100-80GB", 2)], [("V100-16GB", 4)], [("T4", 4)]),
        _cluster("c12_4types_pernode", [("H100-SXM", 2)], [("A100-40GB", 3)], [("V100-32GB", 4)], [("T4", 3)]),
        _cluster("c12_3types_mixed", [("A100-80GB", 2), ("T4", 2)], [("A100-80GB", 2), ("T4", 2)],
                 [("V100-32GB", 4)]),
        _cluster("c16_3types", [("A100-80GB", 8)], [("V100-32GB", 4)], [("T4", 4)]),
        _cluster("c24_4types", [("H100-SXM", 8)], [("A100-40GB", 8)], [("V100-32GB", 4)], [("T4", 4)]),
        _cluster("c32_4types_uneven", [("H100-SXM", 4), ("A100-80GB", 4)], [("A100-80GB", 8)],
                 [("V100-16GB", 8)], [("T4", 8)]),
        _cluster("c48_3types", *([[("A100-80GB", 8)]] * 2 + [[("V100-32GB", 8)]] * 2 + [[("T4", 8)]] * 2)),
        _cluster("c64_4types_mixed", *([[("H100-SXM", 2), ("A100-40GB", 6)]] * 4
                                       + [[("V100-32GB", 4), ("T4", 4)]] * 4)),
    ]


def _timed_plan(cluster, workload, settings, repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` fresh plans, and the last plan (or the error)."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        try:
            result = search_plan(cluster, workload, settings, mode="auto")
        except ConfigError as exc:  # nothing fits: finding that out counts too
            result = exc
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def run_scaling(sizes: list[int], repeat: int) -> dict[int, float]:
    # 96 transformer blocks (+ embedding and head), GPT-style, ~5B parameters
    workload = transformer_workload(TransformerConfig("gpt_96l_h2048", num_layers=96, hidden_size=2048,
                                                      num_heads=16, seq_len=2048, vocab_size=50257))
    print(f"model: {workload.name}, {workload.num_layers} layers, {workload.total_params / 1e9:.1f}B params")
    print(f"{'devices':>8} {'seconds':>8} {'pipelines':>9} {'stages':>8} {'step_s':>8} {'samples/s':>10}")
    out = {}
    for n in sizes:
        cluster = cluster_from_dict(scaling_cluster(n))
        settings = TrainSettings(global_batch_size=max(2048, n), zero_stage=1, max_tp=8, max_stages=16)
        seconds, p = _timed_plan(cluster, workload, settings, repeat)
        stages = sorted({len(pipe.stages) for pipe in p.pipelines})
        print(f"{cluster.num_devices:>8} {seconds:>8.2f} {p.num_pipelines:>9} {str(stages):>8} "
              f"{p.predicted['step_time_s']:>8.3f} {p.predicted['samples_per_s']:>10.1f}", flush=True)
        out[cluster.num_devices] = seconds
    return out


def run_small(repeat: int) -> tuple[float, str]:
    print(f"\n{'cluster':>22} {'dev':>3} {'typ':>3} {'model':>9} {'tp':>2} {'seconds':>8} {'step_s':>10}")
    worst = (-1.0, "", "", 0)
    workloads = {m: load_workload(m) for m in SMALL_MODELS}
    for raw in small_clusters():
        cluster = cluster_from_dict(raw)
        for model, workload in workloads.items():
            for max_tp in (1, 8):
                settings = TrainSettings(global_batch_size=64, max_tp=max_tp)
                seconds, p = _timed_plan(cluster, workload, settings, repeat)
                step = "no fit" if isinstance(p, Exception) else f"{p.predicted['step_time_s']:.5g}"
                print(f"{cluster.name:>22} {cluster.num_devices:>3} {len(cluster.device_types):>3} {model:>9} "
                      f"{max_tp:>2} {seconds:>8.2f} {step:>10}", flush=True)
                if seconds > worst[0]:
                    worst = (seconds, cluster.name, model, max_tp)
    print(f"worst small cluster: {worst[1]} ({worst[2]}, max_tp {worst[3]}) {worst[0]:.2f} s")
    return worst[0], worst[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="scaling sizes (none: skip part 1)")
    ap.add_argument("--no-small", action="store_true", help="skip the small-cluster sweep")
    ap.add_argument("--repeat", type=int, default=1, help="plans per figure; the median is reported")
    args = ap.parse_args()
    times = run_scaling(args.sizes, args.repeat) if args.sizes else {}
    worst_s, worst_name = (math.nan, "none") if args.no_small else run_small(args.repeat)
    print(f"RESULT devices=4096 seconds={times.get(4096, math.nan):.2f} "
          f"devices_16384_seconds={times.get(16384, math.nan):.2f} "
          f"devices_131072_seconds={times.get(131072, math.nan):.2f} worst_small_seconds={worst_s:.2f} "
          f"worst_small_cluster={worst_name}")


if __name__ == "__main__":
    main()
