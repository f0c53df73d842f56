"""A 2-stage pipeline of the char GPT on emulated speeds (1, 0.4): planned boundaries vs DeepSpeed's "parameters".

Three plans of the same model, global batch and micro-batch size, each run for
real (``PlanRunner``, DeepSpeed's pipeline engine, gloo; every stage's forward
and backward padded to its emulated device, ``emulation.stage_padding``) one
after the other in this script:

- planned:    the planner's 2-stage pipeline (``planner.mode=pipeline``): the
              cost model's boundaries, more layers on the fast device;
- parameters: the same two devices split as DeepSpeed's
              ``partition_method="parameters"`` splits (``partition_balanced``
              over each layer's parameter count: equal parameters per stage);
- single:     the whole model on the fast device alone (what pipelining buys).

ratio = planned samples/s / parameters samples/s; model_error_X = |measured -
predicted| / predicted step time of plan X (``CostModel.score``).  Last line:
``RESULT ratio=... model_error_planned=... model_error_parameters=... vs_single=...``.
"""

from __future__ import annotations

import argparse

from _pipeline_common import emulated_cluster, run_plan

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import TransformerConfig, transformer_workload
from het_strategy.planning import search_plan as make_plan


def parameters_bounds(model_kwargs: dict, num_stages: int) -> list[int]:
    """The boundaries DeepSpeed's ``partition_method="parameters"`` gives the char GPT's pipeline layers."""
    from deepspeed.runtime.utils import partition_balanced

    from het_strategy.demo.char_gpt import CharGPT

    model = CharGPT.from_workload_config(TransformerConfig(name="char_gpt", **model_kwargs))
    counts = [sum(p.numel() for p in layer.parameters() if p.requires_grad) for layer in model.pipeline_layers()]
    return [int(b) for b in partition_balanced(weights=counts, num_parts=num_stages)]


def with_bounds(base: Plan, devices: list[str], bounds: list[int]) -> Plan:
    pipe = base.pipelines[0]
    stages = tuple(Stage((d,), (a, b)) for d, a, b in zip(devices, bounds, bounds[1:]))
    return Plan(cluster=base.cluster, cluster_devices=base.cluster_devices, model=base.model,
                global_batch_size=base.global_batch_size, dtype=base.dtype, mode="manual", zero_stage=base.zero_stage,
                pipelines=(Pipeline(stages, micro_batch_size=pipe.micro_batch_size, samples=base.global_batch_size),))


def describe(p: Plan) -> str:
    return " -> ".join(f"{s.devices[0]}[{s.layers[0]}, {s.layers[1]})" for s in p.pipelines[0].stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--slow-speed", type=float, default=0.4)
    args = ap.parse_args()
    model = {"num_layers": args.blocks, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
    raw = emulated_cluster("pipe_1_0.4", [("fast", 1.0, 16.0), ("slow", args.slow_speed, 16.0)])
    cluster = load_cluster(raw)
    workload = transformer_workload(TransformerConfig(name="char_gpt", **model), dtype="fp32")
    # tp 1: this compares pipeline boundaries (tensor_parallel.py measures tp)
    settings = TrainSettings(global_batch_size=args.batch, dtype="fp32", micro_batch_sizes=(args.micro,), max_tp=1)
    planned = make_plan(cluster, workload, settings, mode="pipeline")
    order = [s.devices[0] for s in planned.pipelines[0].stages]
    parameters = with_bounds(planned, order, parameters_bounds(model, 2))
    single = with_bounds(planned, ["fast"], [0, workload.num_layers])
    cm = CostModel(cluster, workload, settings)
    rows = {}
    for name, p in (("planned", planned), ("parameters", parameters), ("single", single)):
        measured = run_plan(p, raw, model, steps=args.steps, warmup=args.warmup)
        predicted = cm.score(p).step_time_s
        rows[name] = (p, measured["step_s"], predicted)
    print(f"char GPT {args.blocks} blocks (hidden 128, seq 64; {workload.num_layers} pipeline layers), global batch "
          f"{args.batch} as {args.batch // args.micro} micro-batches of {args.micro}; emulated speeds fast 1, slow "
          f"{args.slow_speed}; {args.steps} steps after {args.warmup} warm-up")
    print(f"  {'plan':<11} {'stages':<36} {'measured s/step':>15} {'predicted':>10} {'error':>7} {'samples/s':>10}")
    for name, (p, meas, pred) in rows.items():
        print(f"  {name:<11} {describe(p):<36} {meas:15.3f} {pred:10.3f} {abs(meas - pred) / pred:7.1%} "
              f"{args.batch / meas:10.2f}")
    ratio = rows["parameters"][1] / rows["planned"][1]
    vs_single = rows["single"][1] / rows["planned"][1]
    err = {k: abs(m - p) / p for k, (_, m, p) in rows.items()}
    print(f"  planned vs parameters: {ratio:.3f}x (predicted {rows['parameters'][2] / rows['planned'][2]:.3f}x); "
          f"planned pipeline vs the fast device alone: {vs_single:.3f}x")
    print(f"RESULT ratio={ratio:.3f} model_error_planned={err['planned']:.3f} "
          f"model_error_parameters={err['parameters']:.3f} vs_single={vs_single:.3f} "
          f"model_error_single={err['single']:.3f}")


if __name__ == "__main__":
    main()
