"""An asymmetric plan vs the best aligned one, both run for real on 5 emulated ranks (char GPT).

The cluster: one fast device (speed 1) that holds the whole model, and four
slow ones (speed 0.4) whose memory (30 MB each, emulated) holds only a part of
it, so a slow device can only serve inside a pipeline.  The global batch is
small for the stage count (8 samples, micro-batches of 4: a fixed micro-batch,
as when memory or a kernel's efficiency sets it).  Why asymmetry pays here:

- an aligned plan (every replica the same boundaries: what DeepSpeed's grid
  runs) must put all five devices in one pipeline, since no slow device
  holds a whole replica; with two micro-batches that pipeline is almost all
  fill, and every micro-batch crosses four slow stages;
- the asymmetric plan gives the fast device most samples as a replica of its
  own (no fill at all) and the slow devices a 4-stage pipeline of their own
  with the rest; each layer's gradients are averaged over its two holders.

Plans: ``asymmetric`` is the planner's best (``planner.mode=hybrid``); the
best aligned plan is the fastest, by the cost model, of the planner's
``pipeline`` and ``dp`` plans and the fast device alone (``single``, also run
as the baseline).  ratio = aligned s/step / asymmetric s/step (measured);
predicted_ratio the same from ``CostModel.score``; model_error = |ratio -
predicted_ratio| / predicted_ratio.  Last line:
``RESULT ratio=... predicted_ratio=... model_error=... ...``.
"""

from __future__ import annotations

import argparse

from _pipeline_common import emulated_cluster, run_plan
from pipeline import with_bounds

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Plan
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import TransformerConfig, transformer_workload
from het_strategy.ds_runtime.replicas import replica_layout
from het_strategy.planning import search_plan as make_plan


def describe(p: Plan) -> str:
    return " | ".join(" -> ".join(f"{s.devices[0]}[{s.layers[0]},{s.layers[1]})" for s in q.stages)
                      + f" x{q.samples}" for q in p.pipelines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--slow", type=int, default=4, help="number of slow devices")
    ap.add_argument("--slow-speed", type=float, default=0.4)
    ap.add_argument("--slow-memory-gb", type=float, default=0.03)
    ap.add_argument("--tflops", type=float, default=0.004,
                    help="declared fp32 TFLOPS of a speed-1 device: low enough that 5 ranks on 2 cores stay "
                         "well inside their emulated time")
    args = ap.parse_args()
    model = {"num_layers": 12, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
    devices = [("fast", 1.0, 16.0)] + [(f"slow{i}", args.slow_speed, args.slow_memory_gb) for i in range(args.slow)]
    raw = emulated_cluster("asym_1_4x0.4", devices, tflops=args.tflops)
    cluster = load_cluster(raw)
    workload = transformer_workload(TransformerConfig(name="char_gpt", **model), dtype="fp32")
    settings = TrainSettings(global_batch_size=args.batch, dtype="fp32", micro_batch_sizes=(args.micro,), max_tp=1,
                             memory_reserve_gb=0.0)
    cm = CostModel(cluster, workload, settings)
    best = make_plan(cluster, workload, settings, mode="hybrid")
    if replica_layout(best).is_aligned:
        raise SystemExit(f"the planner's best plan is aligned here ({describe(best)}): no asymmetric case")
    candidates = {}
    for mode in ("pipeline", "dp"):
        try:
            candidates[mode] = make_plan(cluster, workload, settings, mode=mode)
        except ConfigError as exc:  # dp: no slow device holds the model
            print(f"  aligned candidate `{mode}`: none ({str(exc).splitlines()[0][:110]})")
    single = with_bounds(best, ["fast"], [0, workload.num_layers])
    candidates["single"] = single
    for name, p in candidates.items():
        print(f"  aligned candidate `{name}`: {describe(p)}: predicted {cm.score(p).step_time_s:.3f} s/step")
    aligned_name = min(candidates, key=lambda k: cm.score(candidates[k]).step_time_s)
    aligned = candidates[aligned_name]
    runs = {"asymmetric": best, f"aligned ({aligned_name})": aligned}
    if aligned_name != "single":
        runs["single"] = single
    else:
        runs["pipeline"] = candidates["pipeline"]  # the aligned plan over every device, for the table
    rows = {}
    for name, p in runs.items():
        rows[name] = (p, run_plan(p, raw, model, steps=args.steps, warmup=args.warmup)["step_s"],
                      cm.score(p).step_time_s)
    print(f"char GPT 12 blocks on fast (1) + {args.slow} x slow ({args.slow_speed}, {args.slow_memory_gb * 1e3:g} MB): "
          f"global batch {args.batch}, micro-batch {args.micro}; {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'plan':<19} {'measured s/step':>15} {'predicted':>10} {'error':>7}  replicas")
    for name, (p, meas, pred) in rows.items():
        print(f"  {name:<19} {meas:15.3f} {pred:10.3f} {abs(meas - pred) / pred:7.1%}  {describe(p)}")
    (_, m_asym, p_asym), (_, m_al, p_al) = rows["asymmetric"], rows[f"aligned ({aligned_name})"]
    ratio, predicted = m_al / m_asym, p_al / p_asym
    error = abs(ratio - predicted) / predicted
    err_asym, err_al = abs(m_asym - p_asym) / p_asym, abs(m_al - p_al) / p_al
    vs_single = rows["single" if "single" in rows else f"aligned ({aligned_name})"][1] / m_asym
    print(f"  asymmetric vs best aligned ({aligned_name}): measured {ratio:.3f}x, predicted {predicted:.3f}x; "
          f"vs the fast device alone {vs_single:.3f}x")
    print(f"RESULT ratio={ratio:.3f} predicted_ratio={predicted:.3f} model_error={error:.3f} "
          f"step_error_asymmetric={err_asym:.3f} step_error_aligned={err_al:.3f} vs_single={vs_single:.3f}")


if __name__ == "__main__":
    main()
