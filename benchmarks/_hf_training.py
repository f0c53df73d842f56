"""Hugging Face causal LMs on ``hetero_deepspeed``, cut by their own plans: exact training and planned speed.

A section of ``benchmarks/hf_models.py`` (``run()`` returns its RESULT keys); it also runs alone:
``python benchmarks/_hf_training.py``.

1. Exactness: ``tests/_hf_pipeline_worker.py`` on 3 gloo ranks trains a tiny Llama (4 layers, hidden 32, GQA 4:2)
   3 AdamW steps per case on padded variable-length rows (each micro-batch weighted by its counted tokens;
   ``--unpadded``: full rows), each against the single-process Hugging Face model on the same batch, in float64: an
   aligned pipeline (run per replica, as every float64 model: DeepSpeed's grid reduces no float64 gradient), an
   asymmetric pipeline, a tp-2 stage sending to a tp-1 stage, the same for a tiny Qwen3 (per-head norms)
   (``exact_max_diff``: the worst loss or parameter difference over them).
2. Speed: a Llama-shaped model (8 layers, hidden 128, GQA 8:2 = 4:1, SwiGLU, byte vocabulary), its units run by
   ``PlanRunner`` on two emulated devices of speeds 1 and 0.4 (each stage's compute padded to its device's time,
   ``emulation.stage_padding``; sends and reductions real gloo).  The planner's 2-stage pipeline for the model's
   workload (``core.hf_config.hf_workload`` of its config) against the same devices split as DeepSpeed's
   ``partition_method="parameters"`` (equal parameters per stage): ``ratio`` = parameters step time / planned step
   time; ``model_error`` = |measured - predicted| / predicted step time of the planned plan (``CostModel.score``).

What it cannot show: the compute is emulated (a CPU core padded to a device's speed), so the ratio is that of the
cost model's devices, not of real GPUs; what it does show is that the units run the planned boundaries at the
predicted pace, with the model's own masks, rotary embeddings and loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pipeline_common import REPO, emulated_cluster  # noqa: E402  (benchmarks/ helper)

SPEED_CONFIG = {"model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 352,
                "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
                "max_position_embeddings": 256, "tie_word_embeddings": False, "hidden_act": "silu",
                "rms_norm_eps": 1e-5}
"""The speed part's model: Llama-shaped, 8 layers, GQA 4:1, SwiGLU (``intermediate_size`` 352 = 2.75 h)."""
SEQ_LEN = 64
SLOW_SPEED = 0.4
_ENV = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}


def _ranks(cmd: list[str], world: int, out: Path, timeout_s: float) -> None:
    from het_strategy.emulation.local_ranks import run_script_ranks

    codes = run_script_ranks(cmd, world, out, timeout_s, _ENV)
    if codes != [0] * world:
        tails = "\n----\n".join((out / f"log{r}.txt").read_text()[-2500:] for r in range(world))
        raise RuntimeError(f"ranks exited {codes}:\n{tails}")


def exactness(padded: bool) -> dict[str, dict[str, float]]:
    """Per case, the worst loss and parameter difference from the single-process model over the 3 ranks."""
    worker = REPO / "tests" / "_hf_pipeline_worker.py"
    with tempfile.TemporaryDirectory(prefix="het_hf_exact_") as tmp:
        out = Path(tmp)
        args = ["aligned,asym,tp,qwen3_tp", str(out)] + (["padded"] if padded else [])
        _ranks([sys.executable, str(worker), *args], 3, out, 600)
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]
    rows = {}
    for case in ranks[0]:
        loss = max(abs(a - b) for r in ranks for a, b in zip(r[case]["losses"], r[case]["ref_losses"]))
        params = max(max(r[case]["param_diffs"].values()) for r in ranks if r[case]["param_diffs"])
        rows[case] = {"loss": loss, "params": params}
    return rows


def _bounds_by_parameters(num_stages: int) -> list[int]:
    """The boundaries DeepSpeed's ``partition_method="parameters"`` gives the model's units."""
    import torch
    from deepspeed.runtime.utils import partition_balanced
    from transformers import AutoConfig, AutoModelForCausalLM

    from het_strategy.hf.pipeline_units import hf_pipeline_units

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SPEED_CONFIG))
    counts = [sum(q.numel() for q in unit.parameters()) for unit in hf_pipeline_units(model)]
    return [int(b) for b in partition_balanced(weights=counts, num_parts=num_stages)]


def _with_bounds(base: Any, devices: list[str], bounds: list[int]) -> Any:
    from het_strategy.core.plan import Pipeline, Plan, Stage

    pipe = base.pipelines[0]
    stages = tuple(Stage((d,), (a, b)) for d, a, b in zip(devices, bounds, bounds[1:]))
    return Plan(cluster=base.cluster, cluster_devices=base.cluster_devices, model=base.model,
                global_batch_size=base.global_batch_size, dtype=base.dtype, mode="manual", zero_stage=base.zero_stage,
                pipelines=(Pipeline(stages, micro_batch_size=pipe.micro_batch_size, samples=base.global_batch_size),))


def _measure(plan: Any, cluster: dict[str, Any], steps: int, warmup: int) -> float:
    """Rank 0's mean ``train_step`` time over ``steps`` after ``warmup``, the plan run for real (``_worker``)."""
    with tempfile.TemporaryDirectory(prefix="het_hf_speed_") as tmp:
        out = Path(tmp)
        spec = {"plan": json.loads(plan.to_json()), "cluster": cluster, "steps": steps, "warmup": warmup,
                "out": str(out / "result.json")}
        (out / "spec.json").write_text(json.dumps(spec))
        _ranks([sys.executable, __file__, "--worker", str(out / "spec.json")], len(plan.used_devices), out, 900)
        return float(json.loads((out / "result.json").read_text())["step_s"])


def speed(steps: int, warmup: int, batch: int, micro: int) -> dict[str, Any]:
    """The planned and the parameters-balanced pipelines, measured and predicted."""
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.hf_config import hf_workload
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.planning import search_plan

    raw = emulated_cluster("hf_1_0.4", [("fast", 1.0, 16.0), ("slow", SLOW_SPEED, 16.0)])
    cluster = load_cluster(raw)
    workload = hf_workload(SPEED_CONFIG, SEQ_LEN, dtype="fp32")
    settings = TrainSettings(global_batch_size=batch, dtype="fp32", micro_batch_sizes=(micro,), max_tp=1)
    planned = search_plan(cluster, workload, settings, mode="pipeline")
    order = [s.devices[0] for s in planned.pipelines[0].stages]
    parameters = _with_bounds(planned, order, _bounds_by_parameters(len(order)))
    cm = CostModel(cluster, workload, settings)
    rows = {}
    for name, p in (("planned", planned), ("parameters", parameters)):
        rows[name] = {"plan": p, "measured": _measure(p, raw, steps, warmup), "predicted": cm.score(p).step_time_s}
    return rows


def _describe(plan: Any) -> str:
    return " -> ".join(f"{s.devices[0]}[{s.layers[0]}, {s.layers[1]})" for s in plan.pipelines[0].stages)


def run(steps: int = 4, warmup: int = 2, batch: int = 32, micro: int = 4, padded: bool = True) -> dict[str, str]:
    """Both parts; prints the tables; returns ``exact_max_diff``, ``ratio`` and ``model_error``."""
    exact = exactness(padded)
    print(f"exact training: tiny Llama / Qwen3 (4 layers, hidden 32, GQA 4:2), 3 ranks, 3 AdamW steps, "
          f"{'padded variable-length' if padded else 'unpadded'} batches, against the single-process HF model")
    print(f"  {'case':<9} {'dtype':<8} {'loss diff':>10} {'param diff':>11}")
    for case, row in exact.items():
        print(f"  {case:<9} {'float64':<8} {row['loss']:10.2e} {row['params']:11.2e}")
    exact_max = max(max(r.values()) for r in exact.values())
    rows = speed(steps, warmup, batch, micro)
    print(f"speed: Llama-shaped 8 layers (hidden 128, GQA 4:1, SwiGLU; 10 units), seq {SEQ_LEN}, global batch {batch} "
          f"as micro-batches of {micro}; emulated speeds fast 1, slow {SLOW_SPEED}; {steps} steps after {warmup}")
    print(f"  {'plan':<11} {'stages':<32} {'measured s':>10} {'predicted':>10} {'error':>7}")
    for name, r in rows.items():
        err = abs(r["measured"] - r["predicted"]) / r["predicted"]
        print(f"  {name:<11} {_describe(r['plan']):<32} {r['measured']:10.3f} {r['predicted']:10.3f} {err:7.1%}")
    ratio = rows["parameters"]["measured"] / rows["planned"]["measured"]
    model_error = abs(rows["planned"]["measured"] - rows["planned"]["predicted"]) / rows["planned"]["predicted"]
    print(f"  planned vs parameters: {ratio:.3f}x (predicted "
          f"{rows['parameters']['predicted'] / rows['planned']['predicted']:.3f}x)")
    return {"exact_max_diff": f"{exact_max:.1e}", "ratio": f"{ratio:.3f}", "model_error": f"{model_error:.3f}"}


def _worker(spec_path: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.hf_config import hf_workload
    from het_strategy.core.plan import Plan
    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.hf.causal_lm_loss import CausalLMLoss
    from het_strategy.hf.pipeline_units import hf_pipeline_units

    spec = json.loads(Path(spec_path).read_text())
    plan = Plan.from_dict(spec["plan"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SPEED_CONFIG))
    runner = PlanRunner(plan, hf_pipeline_units(model), CausalLMLoss(model),
                        lambda params: torch.optim.AdamW(params, lr=1e-3),
                        emulated_cluster=load_cluster(spec["cluster"]),
                        workload=hf_workload(model.config.to_dict(), SEQ_LEN, dtype="fp32"), timeout_s=120)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SPEED_CONFIG["vocab_size"], (plan.global_batch_size, SEQ_LEN), generator=g)
    times = []
    torch.distributed.barrier()
    for _ in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        runner.train_step((ids, torch.ones_like(ids)), ids)
        times.append(time.perf_counter() - t0)
    torch.distributed.barrier()
    if runner.rank == 0:
        Path(spec["out"]).write_text(json.dumps({"step_s": statistics.fmean(times[spec["warmup"]:]), "times": times}))
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--unpadded", action="store_true", help="full rows in the exactness part (default: padded)")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    result = run(args.steps, args.warmup, args.batch, args.micro, not args.unpadded)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
