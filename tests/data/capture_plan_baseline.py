"""Dump what today's planning entry points give on the shipped clusters and models (the PlanRequest baseline).

Run from the repository root on the code before ``PlanRequest``:
``python tests/data/capture_plan_baseline.py`` writes ``tests/data/plan_request_baseline.json``.
Each case: cluster, model, TrainSettings fields, the planner keys het-plan takes, and what het-plan's
branch for them gives: the plan JSON (with the price figures het-plan adds) and the line it prints.
"""
import json, sys, time
from pathlib import Path

from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.pricing import plan_price
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import plan
from het_strategy.planning.joint import plan_jointly
from het_strategy.planning.objective import plan_for_objective
from het_strategy.planning.runtimes import plan_for_runtime
from het_strategy.planning.run_plan import data_parallel_plan

BASE = dict(global_batch_size=64, dtype="bf16")
CASES = [
    # (cluster, model, settings, planner)
    ("mixed_a100_v100_t4", "gpt_small", {}, {}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"mode": "dp"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"mode": "pipeline"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"mode": "hybrid"}),
    ("mixed_a100_v100_t4", "gpt_small", {"max_tp": 2}, {"runtime": "deepspeed"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"compression": "joint"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"objective": "cost"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"budget_per_hour": 8.0}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"min_throughput": 50.0, "objective": "cost"}),
    ("mixed_a100_v100_t4", "gpt_small", {}, {"objective": "cost", "compression": "joint"}),
    ("mixed_a100_v100_t4", "gpt_small", {"zero_stage": 1}, {"objective": "cost", "runtime": "deepspeed"}),
    ("mixed_vendors", "gpt_small", {}, {}),
    ("mixed_vendors", "gpt_small", {"dtype": "fp32"}, {"runtime": "deepspeed"}),
    ("mixed_vendors", "gpt_small", {}, {"compression": "joint"}),
    ("amp_v100_t4", "gpt2_amp", {"global_batch_size": 32}, {}),
    ("amp_v100_t4", "gpt2_amp", {"global_batch_size": 32}, {"mode": "dp", "compression": "joint"}),
    ("amp_v100_t4", "gpt2_amp", {"global_batch_size": 32}, {"runtime": "deepspeed"}),
    ("amp_v100_t4", "gpt2_amp", {"global_batch_size": 32, "zero_stage": 1}, {"runtime": "deepspeed"}),
    ("metis_t4_a100", "metis_gpt", {"global_batch_size": 128}, {}),
    ("metis_t4_a100", "metis_gpt", {"global_batch_size": 128, "zero_stage": 2}, {"runtime": "deepspeed"}),
    ("metis_t4_a100", "metis_gpt", {"global_batch_size": 128}, {"runtime": "deepspeed"}),
    ("sailor_a100_v100_32_96", "opt350", {"global_batch_size": 256}, {"mode": "dp"}),
    ("sailor_a100_v100_32_96", "opt350", {"global_batch_size": 256}, {"mode": "dp", "profile": "sailor"}),
    ("sailor_a100_v100_32_96", "opt350", {"global_batch_size": 256}, {"mode": "dp", "compression": "joint"}),
    ("sailor_a100_v100_80_240", "opt350", {"global_batch_size": 512}, {"mode": "dp"}),
    ("sailor_a100_v100_128_384", "opt350", {"global_batch_size": 1024}, {"mode": "dp"}),
    ("local_cpu2", "tiny_gpt", {"global_batch_size": 16, "dtype": "fp32"}, {}),
    ("local_cpu2_pipeline", "tiny_gpt", {"global_batch_size": 16, "dtype": "fp32"}, {"mode": "pipeline"}),
    ("local_cpu4_mixed", "tiny_gpt", {"global_batch_size": 16, "dtype": "fp32"}, {}),
    ("local_cpu4_mixed", "tiny_gpt", {"global_batch_size": 16, "dtype": "fp32"}, {"runtime": "deepspeed"}),
    ("local_cpu4_equal", "tiny_gpt", {"global_batch_size": 16, "dtype": "fp32"}, {"mode": "dp"}),
    ("local_cpu4_moe", "moe_gpt_tiny", {"global_batch_size": 16, "dtype": "fp32"}, {}),
]
DP_CASES = [  # data_parallel_plan: the hetero strategy's search
    ("local_cpu2", "tiny_gpt", 16, "fp32"),
    ("local_cpu4_mixed", "tiny_gpt", 16, "fp32"),
    ("local_cpu4_moe", "moe_gpt_tiny", 24, "fp32"),
    ("mixed_a100_v100_t4", "gpt_small", 64, "bf16"),
]


def het_plan_branch(cluster, workload, settings, planner, profile):
    """het-plan's if-ladder (cli/plan_cli.run_plan) as it reads before PlanRequest."""
    from het_strategy.planning.objective import ObjectiveSettings

    mode = planner.get("mode", "auto")
    joint = planner.get("compression", "none")
    goal = ObjectiveSettings(planner.get("objective", "time"), planner.get("budget_per_hour"),
                             planner.get("min_throughput"))
    line = None
    if not goal.is_default:
        result = plan_for_objective(cluster, workload, settings, "dp" if joint == "joint" else mode, profile,
                                    goal.objective, goal.budget_per_hour, goal.min_throughput,
                                    compression=joint, runtime=planner.get("runtime", "any"))
        p, line = result.plan, result.summary()
    elif joint == "joint":
        result = plan_jointly(cluster, workload, settings, mode="dp", profile=profile)
        blind = result.blind
        token = result.plan.compression.get("inter_node", "none")
        line = f"joint plan: {token} between nodes, {result.plan.predicted['step_time_s'] * 1e3:.1f} ms/step"
        if blind is not None:
            line += (f"; compression-blind plan {blind.predicted['step_time_s'] * 1e3:.1f} ms/step "
                     f"({blind.predicted['step_time_s'] / result.plan.predicted['step_time_s']:.2f}x slower)")
            back = result.brought_back()
            line += f"; devices brought back into use: {', '.join(back)}" if back else "; no device brought back"
        p = result.plan
    else:
        choice = plan_for_runtime(cluster, workload, settings, mode=mode, profile=profile,
                                  runtime=planner.get("runtime", "any"))
        p = choice.plan
        line = choice.summary() if choice.runtime != "any" else None
    score = CostModel(cluster, workload, settings, profile).score(p)
    if not p.predicted:
        p.predicted = score.to_dict()
    p.predicted.update(plan_price(p, cluster, score.step_time_s).to_dict())
    return p, line


def main() -> None:
    from het_strategy.core.reference_profiles import load_sailor_profile

    out = {"cases": [], "data_parallel": []}
    for cname, mname, extra, planner in CASES:
        t = time.perf_counter()
        s = TrainSettings(**{**BASE, **extra})
        cluster, workload = load_cluster(cname), load_workload(mname, dtype=s.dtype)
        profile = load_sailor_profile(model="OPT-350", workload=workload) if planner.get("profile") else None
        p, line = het_plan_branch(cluster, workload, s, planner, profile)
        out["cases"].append({"cluster": cname, "model": mname, "settings": {**BASE, **extra}, "planner": planner,
                             "plan": p.to_dict(), "line": line})
        print(f"{time.perf_counter() - t:6.2f}s {cname} {mname} {extra} {planner}", file=sys.stderr)
    for cname, mname, batch, dtype in DP_CASES:
        cluster, workload = load_cluster(cname), load_workload(mname, dtype=dtype)
        p = data_parallel_plan(cluster, workload, batch, dtype)
        out["data_parallel"].append({"cluster": cname, "model": mname, "global_batch_size": batch, "dtype": dtype,
                                     "plan": p.to_dict()})
    Path("tests/data/plan_request_baseline.json").write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
