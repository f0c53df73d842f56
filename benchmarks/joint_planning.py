"""Placement and compression planned together vs a compression-blind plan compressed afterwards, measured.

An emulated two-node cluster (``emulation/node_network.py``: a network namespace per node, ``--rate-mbit``
each way between them, loopback within): node ``fast`` holds two devices of speed 1, node ``slow`` two of
speed ``--slow-speed`` (CPU processes whose compute the hetero strategy pads to the emulated device's time,
so emulated time, not the four processes' contention for two cores, sets the pace).  The model is the main
job's char GPT (``configs/model/tiny_gpt.yaml``: 0.87 M parameters, 3.5 MB of fp32 gradients); the cluster
file declares the link as it is shaped, so the planner prices what the run meets.

1. **Plan** (predicted, the cost model): the best compression-blind plan (gradient sync priced uncompressed;
   devices may stay idle) and the joint plan (placement x inter-node method, ``planning/joint.py``).
2. **Run** each with ``HeteroStrategy`` in Lightning, ranks launched into their node's namespace with
   ``LOCAL_RANK``/``NODE_RANK`` set (Lightning's multi-node launch from outside: ``num_nodes`` x
   ``devices``): the blind plan on the devices it uses with ``compression="adaptive"`` afterwards (the
   controller measures the link it gets and compresses per layer if it pays); the joint plan with
   ``compression="planned"`` (the hierarchical hook: node sum, the planned method between node leaders,
   broadcast).
3. **Compare**: measured samples/s (means over the steps after ``--skip``, past the compression warm-up)
   and each plan's predicted step time against its measured one.

Last line: ``RESULT ratio=<joint samples/s / blind samples/s> model_error=<the larger |predicted - measured|
/ measured of the two plans> blind_error=... joint_error=...``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emulated_nodes import add_link_options, require_netns, run_on_nodes  # noqa: E402

MODEL_YAML = Path(__file__).resolve().parents[1] / "configs" / "model" / "tiny_gpt.yaml"
DEVICE_TFLOPS = 0.008  # a speed-1 device's sustained TFLOPS (about 1/7 of one core here on this model)


def cluster_dict(rate_mbit: float, slow_speed: float, intra_gbs: float) -> dict[str, Any]:
    """The two-node cluster as a cluster YAML mapping; the inter-node link as shaped (Mbit/s -> GB/s)."""
    def device(name: str, speed: float) -> dict[str, Any]:
        return {"name": name, "type": "CPU", "tflops": {"fp32": DEVICE_TFLOPS, "bf16": DEVICE_TFLOPS},
                "efficiency": 1.0, "emulated_speed": speed}

    return {"name": "two_nodes_emulated",
            "description": f"two emulated nodes: 2 devices at speed 1, 2 at {slow_speed:g}, "
                           f"{rate_mbit:g} Mbit/s between them",
            "inter_node_bandwidth_gbs": rate_mbit / 8e3,
            "nodes": [{"name": "fast", "intra_bandwidth_gbs": intra_gbs,
                       "devices": [device("fast0", 1.0), device("fast1", 1.0)]},
                      {"name": "slow", "intra_bandwidth_gbs": intra_gbs,
                       "devices": [device("slow0", slow_speed), device("slow1", slow_speed)]}]}


def _workload() -> Any:
    import yaml

    from het_strategy.core.workload import transformer_config, transformer_workload

    cfg = transformer_config({"name": "tiny_gpt", **yaml.safe_load(MODEL_YAML.read_text())})
    return cfg, transformer_workload(cfg, "fp32")


def plans(cluster: Any, workload: Any, batch: int) -> Any:
    """The ``JointResult`` on ``cluster`` (``.blind``, ``.plan``: the joint one): pure data parallelism planned as
    the strategy plans it, except that devices may stay idle (the blind plan's point)."""
    from het_strategy.planning import PlanRequest, plan
    from het_strategy.planning.strategy_plans import data_parallel_settings

    return plan(cluster, workload, data_parallel_settings(batch, "fp32", idle_devices=True),
                PlanRequest(compression="joint", mode="dp")).joint


def sub_cluster(source: dict[str, Any], used: list[str]) -> dict[str, Any]:
    """The cluster mapping with only the ``used`` devices (and the nodes that still hold one)."""
    nodes = []
    for node in source["nodes"]:
        kept = [d for d in node["devices"] if d["name"] in used]
        if kept:
            nodes.append({**node, "devices": kept})
    return {**source, "name": source["name"] + "_used", "nodes": nodes}


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from het_strategy import HeteroStrategy
    from het_strategy.callbacks.throughput import ThroughputMonitor
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.demo.moe_gpt import build_char_model
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy.planning.strategy_plans import data_parallel_plan

    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    cfg, workload = _workload()
    cluster = load_cluster(args.cluster)
    plan = data_parallel_plan(cluster, workload, args.batch, "fp32", args.plan)
    world = cluster.num_devices
    per_node = world // len(cluster.nodes)
    corpus = stdlib_corpus(max_bytes=400_000, val_fraction=0.1, seed=0)
    train_set = CharDataset(corpus.train, cfg.seq_len)
    model = build_char_model(cfg, None, lr=1e-3, weight_decay=0.0)
    strategy = HeteroStrategy(cluster=cluster, workload=workload, global_batch_size=args.batch, plan=plan,
                              compression=args.compression, verbose=False)
    throughput = ThroughputMonitor(warmup_steps=args.skip, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=len(cluster.nodes), strategy=strategy,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, callbacks=[throughput])
    trainer.fit(model, DataLoader(train_set, batch_size=max(1, args.batch // world), shuffle=True))
    if trainer.global_rank == 0:
        settings = TrainSettings(global_batch_size=args.batch, dtype="fp32", max_tp=1)  # placement and compression
        score = CostModel(cluster, workload, settings).score(strategy.plan)
        state = strategy.run.compression_state
        inter = getattr(state, "inter", state)  # the hierarchical state's inter-node part
        summary = {**throughput.summary, "predicted_step_s": score.step_time_s, "shares": strategy.run.current_shares(), "compression": dict(strategy.plan.compression),
                   "choices": sorted(set(getattr(inter, "choices", {}).values())) if inter is not None else [],
                   "wire_ratio": getattr(inter, "wire_ratio", None) if inter is not None else None}
        Path(args.out).write_text(json.dumps(summary))


def _run(cluster: dict[str, Any], plan: Any, compression: str, args: argparse.Namespace, tmp: Path,
         label: str) -> dict[str, Any]:
    """Train ``plan`` on ``cluster`` (a namespace per node) and return rank 0's summary."""
    return run_on_nodes(__file__, cluster, plan, tmp / label, args.rate_mbit, [
        "--compression", compression, "--steps", str(args.steps), "--skip", str(args.skip), "--batch",
        str(args.batch), "--seed", str(args.seed)], timeout_s=1500)


def _compression_text(run: dict[str, Any]) -> str:
    planned = run["compression"].get("inter_node")
    where = f"planned {planned} between nodes" if planned else f"adaptive, per-layer methods {run['choices'] or ['none']}"
    saving = run["wire_ratio"]
    return where + ("" if saving is None else f" (wire saving {saving:.2f}x over the run)")


def _plan_line(label: str, plan: Any, cluster: Any) -> str:
    used = plan.used_devices
    idle = [d.name for d in cluster.devices if d.name not in used]
    p = plan.predicted
    return (f"  {label:<6} predicted {p['step_time_s'] * 1e3:7.1f} ms/step {p['samples_per_s']:6.1f} samples/s  "
            f"inter-node {plan.compression.get('inter_node', 'none'):<4}  shares "
            f"{ {d: n for d, n in plan.rank_shares().items() if n} }  idle {idle or 'none'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--compression", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=40, help="training steps per run")
    ap.add_argument("--skip", type=int, default=14, help="steps left out of the means (compression warm-up: 10)")
    ap.add_argument("--batch", type=int, default=24, help="global batch (sequences of 128 bytes)")
    add_link_options(ap, rate_mbit=100.0, slow_speed=0.6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    from het_strategy.core.cluster import cluster_from_dict

    require_netns("joint_planning")
    source = cluster_dict(args.rate_mbit, args.slow_speed, args.intra_gbs)
    cluster = cluster_from_dict(source)
    _, workload = _workload()
    result = plans(cluster, workload, args.batch)
    blind, joint = result.blind, result.plan
    print(f"cluster: node fast 2 x speed 1, node slow 2 x speed {args.slow_speed:g}, {args.rate_mbit:g} Mbit/s "
          f"between nodes; char GPT ({workload.total_params / 1e6:.2f} M parameters), global batch {args.batch}, "
          f"{args.steps} steps ({args.skip} left out)", flush=True)
    print(_plan_line("blind", blind, cluster))
    print(_plan_line("joint", joint, cluster))
    for token, p in result.by_choice.items():
        print(f"    joint search, inter-node {token:<4}: {p.predicted['step_time_s'] * 1e3:7.1f} ms/step on "
              f"{len(p.used_devices)} devices")
    back = result.brought_back()
    print(f"  the joint plan brings back into use: {back or 'none'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="joint_planning_") as tmp:
        blind_source = sub_cluster(source, list(blind.used_devices))
        blind_cluster = cluster_from_dict(blind_source)
        blind_plan = plans(blind_cluster, workload, args.batch).plan
        runs = {"blind": _run(blind_source, blind_plan, "adaptive", args, Path(tmp), "blind"),
                "joint": _run(source, joint, "planned", args, Path(tmp), "joint")}
    errors = {}
    for label, run in runs.items():
        errors[label] = abs(run["predicted_step_s"] - run["step_s"]) / run["step_s"]
        print(f"  {label:<6} measured {run['step_s'] * 1e3:7.1f} ms/step {run['samples_per_s']:6.1f} samples/s "
              f"(predicted {run['predicted_step_s'] * 1e3:.1f} ms, error {errors[label] * 100:.1f}%); "
              f"{_compression_text(run)}; "
              f"{run['crossed_mb']:.1f} MB between nodes", flush=True)
    ratio = runs["joint"]["samples_per_s"] / runs["blind"]["samples_per_s"]
    print(f"  joint vs blind + adaptive: {ratio:.2f}x measured "
          f"({joint.predicted['samples_per_s'] / blind.predicted['samples_per_s']:.2f}x predicted)")
    print(f"RESULT ratio={ratio:.3f} model_error={max(errors.values()):.3f} blind_error={errors['blind']:.3f} "
          f"joint_error={errors['joint']:.3f}")


if __name__ == "__main__":
    main()
