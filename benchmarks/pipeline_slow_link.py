"""Pipelines whose stages sit on emulated nodes joined by a slow link: the cost model's pipeline time against the
measured one, and the plan the planner picks there.

Each stage is a node of its own (a network namespace, ``node_network.emulated_nodes``; one device, or two as a
tp-2 stage), the nodes joined by a link shaped to ``rate`` Mbit/s each way; the char GPT (6 blocks, hidden 128,
seq 64, fp32) runs on ``hetero_deepspeed``'s engine (``PlanRunner``: DeepSpeed's pipeline schedule, its blocking
``p2p.send``/``recv``), every stage padded to its emulated device's compute time (``emulation.stage_padding``).

Part 1, the sends' pricing.  Per case (rate, stages, tp, micro-batch) the layers are split evenly and the plan is run;
``predicted`` is ``CostModel.score`` (a stage pays its compute and the sends at both its boundaries, one after
another), ``overlapped`` is the rule the model had before, computed from the very same stage costs (per
micro-batch the larger of a stage's compute and its send).  ``error = measured / predicted - 1``.

Part 2, the pick.  Two equal one-device nodes at ``--pick-rate`` Mbit/s: ``search_plan`` picks between one
device alone, data parallelism across the link and a 2-stage pipeline across it.  Both the picked plan and the
best 2-stage pipeline (the plan the overlapped rule ranks first) are run; ``pick_ratio`` = the pipeline's measured
step / the picked plan's (> 1: the pick is the faster one).

What this checks: the schedule and the link (gloo over TCP through ``tc htb``, one frame at a time, a bucket of
one timer tick), not a GPU's speed or NCCL's; per-step compute is emulated.  Last line: ``RESULT model_error_max=...
overlapped_error_max=... pick=... pick_ratio=...``.  Needs root (network namespaces, ``tc``) and DeepSpeed.
"""

from __future__ import annotations

import argparse

from _emulated_nodes import require_netns
from _pipeline_common import run_plan

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel, fill_s
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.plan_score import StageCost
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import TransformerConfig, transformer_workload
from het_strategy.planning import search_plan

MODEL = {"num_layers": 6, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
BATCH = 32
CASES = [(100.0, 2, 1, 4), (20.0, 2, 1, 4), (5.0, 2, 1, 8), (10.0, 3, 1, 4), (40.0, 3, 1, 4), (10.0, 3, 1, 16),
         (20.0, 2, 2, 4)]
"""(Mbit/s, stages, tp, micro-batch): a boundary's sends from a third of a stage's compute to 7x it; the last
case has two-device nodes and tp-2 stages (partitioned sends: each rank half the activation, then an
all-gather on the receiving node)."""


def node_devices(node: int, per_node: int) -> tuple[str, ...]:
    return tuple(f"d{node}" if per_node == 1 else f"d{node}{chr(ord('a') + k)}" for k in range(per_node))


def nodes_cluster(num_nodes: int, rate_mbit: float, per_node: int = 1) -> dict:
    """``num_nodes`` nodes of ``per_node`` emulated CPU devices each, joined at ``rate_mbit``."""
    return {"name": f"slow_{num_nodes}x{per_node}_{rate_mbit:g}mbit", "inter_node_bandwidth_gbs": rate_mbit / 8000,
            "nodes": [{"name": f"n{i}", "intra_bandwidth_gbs": 1, "devices": [
                {"name": name, "type": "CPU", "tflops": {"fp32": 0.016 / per_node}, "efficiency": 1.0,
                 "emulated_speed": 1.0, "memory_gb": 16} for name in node_devices(i, per_node)]}
                for i in range(num_nodes)]}


def even_split(base: Plan, num_stages: int, micro_batch: int, tp: int = 1) -> Plan:
    """``base``'s cluster and model, its layers split evenly over the nodes' devices (tp per node), one pipeline."""
    layers = base.model["num_layers"]
    bounds = [round(i * layers / num_stages) for i in range(num_stages + 1)]
    stages = tuple(Stage(node_devices(i, tp), (bounds[i], bounds[i + 1])) for i in range(num_stages))
    return Plan(cluster=base.cluster, cluster_devices=base.cluster_devices, model=base.model,
                global_batch_size=BATCH, dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline(stages, micro_batch_size=micro_batch, samples=BATCH),))


def overlapped_time_s(costs: list[StageCost], num_micro_batches: int) -> float:
    """The rule the model had before: fill, then per further micro-batch the largest compute or send."""
    return fill_s(costs) + (num_micro_batches - 1) * max(max(c.compute_s, c.send_s) for c in costs)


def describe(plan: Plan) -> str:
    if len(plan.pipelines) > 1:
        return f"data parallel x{len(plan.pipelines)}"
    stages = plan.pipelines[0].stages
    return "one device" if len(stages) == 1 else f"{len(stages)}-stage pipeline " + " ".join(
        f"{'+'.join(s.devices)}{list(s.layers)}" for s in stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--pick-rate", type=float, default=20.0, help="Mbit/s between the two nodes of part 2")
    args = ap.parse_args()
    require_netns("pipeline_slow_link.py")
    workload = transformer_workload(TransformerConfig(name="char_gpt", **MODEL), dtype="fp32")

    print(f"(1) char GPT {MODEL['num_layers']} blocks, a stage per node (one device; two at tp 2), global batch "
          f"{BATCH}, even layer split; {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'Mbit/s':>6} {'stages':>6} {'tp':>2} {'mbs':>4} {'send/compute':>12} {'measured':>9} {'predicted':>9} "
          f"{'error':>7} {'overlapped':>10} {'error':>7}")
    errors, overlapped_errors = [], []
    for rate, num_stages, tp, mbs in CASES:
        raw = nodes_cluster(num_stages, rate, tp)
        cluster = load_cluster(raw)
        settings = TrainSettings(global_batch_size=BATCH, dtype="fp32", micro_batch_sizes=(mbs,), max_tp=tp)
        base = search_plan(cluster, workload, settings, mode="pipeline")
        plan = even_split(base, num_stages, mbs, tp)
        score = CostModel(cluster, workload, settings).score(plan)
        costs = score.stage_costs[0]
        old = overlapped_time_s(costs, BATCH // mbs) + score.update_time_s
        measured = run_plan(plan, raw, MODEL, steps=args.steps, warmup=args.warmup, rate_mbit=rate)["step_s"]
        err, old_err = measured / score.step_time_s - 1, measured / old - 1
        errors.append(abs(err))
        overlapped_errors.append(abs(old_err))
        ratio = max(c.send_s for c in costs) / max(c.compute_s for c in costs)
        print(f"  {rate:6g} {num_stages:6d} {tp:2d} {mbs:4d} {ratio:12.2f} {measured:9.3f} {score.step_time_s:9.3f} "
              f"{err:+7.1%} {old:10.3f} {old_err:+7.1%}")

    print(f"(2) two one-device nodes at {args.pick_rate:g} Mbit/s, micro-batch 4: the planner's pick against the "
          f"best 2-stage pipeline")
    raw = nodes_cluster(2, args.pick_rate)
    cluster = load_cluster(raw)
    settings = TrainSettings(global_batch_size=BATCH, dtype="fp32", micro_batch_sizes=(4,), max_tp=1)
    cm = CostModel(cluster, workload, settings)
    picked = search_plan(cluster, workload, settings)
    pipeline = search_plan(cluster, workload, settings, mode="pipeline")
    rows = {}
    for name, plan in (("picked", picked), ("pipeline", pipeline)):
        score = cm.score(plan)
        old = (overlapped_time_s(score.stage_costs[0], plan.pipelines[0].num_micro_batches)
               + score.update_time_s) if len(plan.pipelines) == 1 else score.step_time_s
        measured = run_plan(plan, raw, MODEL, steps=args.steps, warmup=args.warmup, rate_mbit=args.pick_rate)["step_s"]
        rows[name] = measured
        print(f"  {name:<9} {describe(plan):<38} measured {measured:7.3f} s  predicted {score.step_time_s:7.3f} s  "
              f"overlapped rule {old:7.3f} s")
    pick_ratio = rows["pipeline"] / rows["picked"]
    print(f"  the pipeline's measured step / the pick's: {pick_ratio:.3f}")
    print(f"RESULT model_error_max={max(errors):.3f} overlapped_error_max={max(overlapped_errors):.3f} "
          f"pick={describe(picked).split(' ')[0].replace('-', '_')} pick_ratio={pick_ratio:.3f}")


if __name__ == "__main__":
    main()
