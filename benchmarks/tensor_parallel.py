"""Tensor parallelism where it pays: the planner's tp-2 plan against its best tp-1 plan, both run for real.

The case: the char GPT on two emulated devices of one node, each with memory
for 80% of the model's training state beside the framework's reserve (the cap
is computed from the cost model's own memory estimate), and a global batch of 4.  No
device holds the whole model, so without tensor parallelism the only plans
are 2-stage pipelines; with one or two micro-batches a 2-stage pipeline is
at best two thirds busy (one fill step in three).  At tp 2 both
devices compute every micro-batch, each half of every block (Megatron's
split, ``tensor_parallel``), paying 4 all-reduces per block and an
all-gather of the logits instead.  The planner (``planner.runtime=deepspeed``)
chooses each plan: ``max_tp=2`` and ``max_tp=1``.

Both run for real, one after the other (``PlanRunner``: DeepSpeed's pipeline
engine with this project's tp split and partitioned sends, gloo over
loopback, one thread per rank), every stage's forward and backward padded to
its emulated device's time at its tp (``emulation.stage_padding``: the
cost model's compute of the shard plus its priced all-reduces, which the
real all-reduces run inside).  What this checks: the schedule (pipeline
fill, tp overlap of the two devices), the real collectives and sends, and the
cost model's arithmetic for both plans.  What it cannot: a GPU's compute or
NVLink's speed (emulated compute stands in; the real all-reduces here are
loopback gloo).

ratio = tp-1 step time / tp-2 step time (measured); predicted_ratio the same
from ``CostModel.score``; model_error = the larger of the two plans' |measured -
predicted| / predicted.  Last line: ``RESULT ratio=... predicted_ratio=...
model_error=... model_error_tp1=... model_error_tp2=...``.
"""

from __future__ import annotations

import argparse

from _pipeline_common import emulated_cluster, run_plan

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.memory import GiB
from het_strategy.core.plan import Plan
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import TransformerConfig, transformer_workload
from het_strategy.planning import PlanRequest, plan as make_plan


def describe(p: Plan) -> str:
    pipe = p.pipelines[0]
    stages = " -> ".join(f"{'+'.join(s.devices)}[{s.layers[0]}, {s.layers[1]}) tp {s.tp}" for s in pipe.stages)
    return f"{stages}; {pipe.num_micro_batches} x {pipe.micro_batch_size}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--tflops", type=float, default=0.002, help="emulated sustained TFLOPS of each device")
    args = ap.parse_args()
    model = {"num_layers": args.blocks, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
    workload = transformer_workload(TransformerConfig(name="char_gpt", **model), dtype="fp32")
    # micro-batches of 2 or 4: one or two of them per step, where a 2-stage pipeline is at best 2/3 busy
    settings = TrainSettings(global_batch_size=args.batch, dtype="fp32", micro_batch_sizes=(2, 4), max_tp=2)
    # memory: 80% of the whole model's training state at micro-batch 2, so no device holds it alone
    probe = CostModel(load_cluster(emulated_cluster("probe", [("a", 1.0, 1e3), ("b", 1.0, 1e3)], args.tflops)),
                      workload, settings)
    whole = probe.stage_memory_bytes(0, workload.num_layers, 1, min(settings.micro_batch_sizes), 1, 1)
    reserve = settings.memory_reserve_gb * GiB
    cap_gb = (reserve + 0.8 * (whole - reserve)) / GiB
    raw = emulated_cluster("tp_pays", [("gpu0", 1.0, cap_gb), ("gpu1", 1.0, cap_gb)], args.tflops)
    cluster = load_cluster(raw)
    request = PlanRequest(runtime="deepspeed")
    tp2 = make_plan(cluster, workload, settings, request).plan
    tp1 = make_plan(cluster, workload, TrainSettings(**{**settings.__dict__, "max_tp": 1}), request).plan
    if not any(s.tp == 2 for s in tp2.pipelines[0].stages):
        raise SystemExit(f"the planner's max_tp=2 plan does not use tp 2 here: {describe(tp2)}")
    cm = CostModel(cluster, workload, settings)
    rows = {}
    for name, p in (("tp1", tp1), ("tp2", tp2)):
        measured = run_plan(p, raw, model, steps=args.steps, warmup=args.warmup)
        rows[name] = (p, measured["step_s"], cm.score(p).step_time_s)
    print(f"char GPT {args.blocks} blocks (hidden 128, 4 heads, seq 64), global batch {args.batch}; two emulated "
          f"devices of {args.tflops} TFLOPS on one node with {cap_gb:.3f} GiB each (the whole model needs "
          f"{whole / GiB:.3f} GiB); {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'plan':<5} {'stages':<48} {'measured s/step':>15} {'predicted':>10} {'error':>7}")
    for name, (p, meas, pred) in rows.items():
        print(f"  {name:<5} {describe(p):<48} {meas:15.3f} {pred:10.3f} {abs(meas - pred) / pred:7.1%}")
    ratio = rows["tp1"][1] / rows["tp2"][1]
    predicted = rows["tp1"][2] / rows["tp2"][2]
    err = {k: abs(m - p) / p for k, (_, m, p) in rows.items()}
    print(f"  tp 2 over tp 1: {ratio:.3f}x measured, {predicted:.3f}x predicted "
          f"({abs(ratio - predicted) / predicted:.1%} apart)")
    print(f"RESULT ratio={ratio:.3f} predicted_ratio={predicted:.3f} model_error={max(err.values()):.3f} "
          f"model_error_tp1={err['tp1']:.3f} model_error_tp2={err['tp2']:.3f}")


if __name__ == "__main__":
    main()
