"""Run a Plan of the char GPT for real on emulated local ranks and read back its step times (benchmarks' helper).

``run_plan`` starts one process per device of the plan (gloo on loopback,
one thread each), each building ``PlanRunner`` (``hetero_deepspeed``'s
engine) with the cluster's emulation on: every stage's forward and backward
are padded to its emulated device's time (``emulation.stage_padding``).  The
script is its own worker: ``python _pipeline_common.py SPEC.json``.

Timing: rank 0 times each ``train_step`` (the whole global batch: every
pipeline's schedule, the gradient reduction, the optimizer step, the loss
broadcast); the figure is the mean over the steps after ``warmup``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def emulated_cluster(name: str, devices: list[tuple[str, float, float]], tflops: float = 0.016) -> dict[str, Any]:
    """A one-node cluster mapping: ``(name, emulated_speed, memory_gb)`` per device, CPU at ``tflops`` x speed."""
    return {"name": name, "inter_node_bandwidth_gbs": 1,
            "nodes": [{"name": "local", "intra_bandwidth_gbs": 1, "devices": [
                {"name": n, "type": "CPU", "tflops": {"fp32": tflops}, "efficiency": 1.0, "emulated_speed": speed,
                 "memory_gb": mem} for n, speed, mem in devices]}]}


def run_plan(plan: Any, cluster: dict[str, Any], model: dict[str, Any], steps: int, warmup: int = 2,
             timeout_s: float = 900, rate_mbit: float | None = None) -> dict[str, Any]:
    """Train ``steps + warmup`` steps of ``plan``; rank 0's ``{"step_s", "times", "loss"}``.

    With ``rate_mbit`` every node the plan uses (as many devices each, in rank order) is an emulated node, a network
    namespace, joined to the others by a link shaped to that rate each way (``node_network.emulated_nodes``)."""
    from het_strategy.emulation.local_ranks import run_script_ranks

    world = len(plan.used_devices)
    with tempfile.TemporaryDirectory(prefix="het_pipe_") as tmp:
        out = Path(tmp)
        spec = {"plan": json.loads(plan.to_json()), "cluster": cluster, "model": model, "steps": steps, "warmup": warmup,
                "out": str(out / "result.json")}
        (out / "spec.json").write_text(json.dumps(spec))
        env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, __file__, str(out / "spec.json")]
        node_of = {d["name"]: n["name"] for n in cluster["nodes"] for d in n["devices"]}
        num_nodes = len({node_of[d] for d in plan.used_devices})
        if rate_mbit is None or num_nodes == 1:  # one node: its ranks talk over loopback
            codes = run_script_ranks(cmd, world, out, timeout_s, env)
        else:
            from het_strategy.emulation.netshape import LinkShape
            from het_strategy.emulation.node_network import emulated_nodes

            with emulated_nodes(num_nodes, LinkShape(rate_mbit)) as net:
                tx0 = [net.uplink_tx_bytes(n) for n in range(len(net.nodes))]
                codes = run_script_ranks(cmd, world, out, timeout_s, env, nodes=net)
                crossed = [net.uplink_tx_bytes(n) - tx0[n] for n in range(len(net.nodes))]
        logs = [out / f"log{rank}.txt" for rank in range(world)]
        if codes != [0] * world:
            tails = "\n----\n".join(path.read_text()[-2500:] for path in logs)
            raise RuntimeError(f"ranks exited {codes}:\n{tails}")
        if os.environ.get("HET_BENCH_VERBOSE"):  # each rank's per-step times, padding and reduction
            for path in logs:
                print("\n".join(line for line in path.read_text().splitlines() if line.startswith("rank ")))
        result = json.loads((out / "result.json").read_text())
        if rate_mbit is not None and num_nodes > 1:
            result["crossed_bytes"] = crossed
        return result


def _worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import TransformerConfig, transformer_workload
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.ds_runtime.engine import PlanRunner

    spec = json.loads(Path(spec_path).read_text())
    plan = Plan.from_dict(spec["plan"])
    cluster = load_cluster(spec["cluster"])
    cfg = TransformerConfig(name="char_gpt", **spec["model"])
    torch.manual_seed(0)
    model = CharGPT.from_workload_config(cfg)
    runner = PlanRunner(plan, model.pipeline_layers(), CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=1e-3), emulated_cluster=cluster,
                        workload=transformer_workload(cfg, dtype="fp32"), timeout_s=120)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (plan.global_batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (plan.global_batch_size, cfg.seq_len), generator=g)
    times, reduce_s, slept_s, loss = [], [], [], 0.0
    torch.distributed.barrier()
    for _ in range(spec["warmup"] + spec["steps"]):
        slept = runner.padding.slept_s if runner.padding else 0.0
        t0 = time.perf_counter()
        loss = runner.train_step(x, y)
        times.append(time.perf_counter() - t0)
        slept_s.append((runner.padding.slept_s if runner.padding else 0.0) - slept)
        reduce_s.append(runner.reducer.last_reduce_s if runner.reducer else 0.0)
    torch.distributed.barrier()
    if os.environ.get("HET_BENCH_VERBOSE"):
        print(f"rank {runner.rank}: step {times} slept {slept_s} reduce {reduce_s}", file=sys.stderr, flush=True)
    if runner.rank == 0:
        measured = times[spec["warmup"]:]
        tmp = spec["out"] + ".tmp"
        Path(tmp).write_text(json.dumps({"step_s": statistics.fmean(measured), "times": times, "loss": loss}))
        os.replace(tmp, spec["out"])
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])
