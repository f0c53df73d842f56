"""(a) bf16 and fp16 pipelines on ``hetero_deepspeed``'s runtime against fp32, on the same samples: the validation
loss; (b) per-device precision on ``hetero`` and ``hetero_deepspeed`` against uniform bf16: speed and loss.

The char GPT (4 blocks, hidden 128, sequence 64: 6 pipeline layers) trains on the standard library's source
(``demo.stdlib_text``) through ``ds_runtime.PlanRunner`` on 4 CPU ranks, the same global batches in the same
order and the same initial weights in every run, with AdamW at ``--lr`` 1e-3 and the gradients clipped to a
global norm of ``--clip`` (1.0, as GPT recipes do).  At lr 3e-3 this model trains chaotically: it spiked now and
then without clipping, and with it two runs that differ only in rounding still ended 1-2% apart after 400 steps
(and at a higher loss, 2.41 against 2.03), more than any precision moves it; at 1e-3 they end within a few
hundredths of a percent:

- **aligned**: 2 pipelines x 2 stages split at layer 3 (DeepSpeed's own grid), in fp32 and bf16 at ZeRO 0
  and in fp16 at ZeRO 1 (DeepSpeed's own grid trains fp16 at ZeRO >= 1 only: ``core.runtime_rules``);
- **asymmetric**: one rank holding every layer, a pipeline of two ranks split at layer 2, one more rank
  holding every layer (``ds_runtime.replica_engine``), in fp32 and bf16 at ZeRO 0 (its fp16 is tested, not run
  here), and in fp32 and bf16 at ZeRO 1 (AdamW's moments, and bf16's fp32 master weights, sharded within the
  holder sets: ``ds_runtime.holder_sharding``).

After the last step, the mean loss over ``--val-batches`` held-out batches (files the training set does not
have), their sequences spread evenly over the whole held-out text.  Every run is repeated for each of ``--seeds``
(weights and batch order), so a gap is read between means.  ``loss_gap_<dtype>`` is the
largest relative gap between the mean validation loss of a run in that dtype (any ZeRO stage) and the fp32 ZeRO-0
mean of the same plan, over the same seeds; ``zero1_gap`` that of the asymmetric fp32 ZeRO-1 run to the ZeRO-0 one
(seed 0 only: it is exact, not noisy);
``seed_noise`` is the relative standard deviation of the aligned fp32 run's validation loss across the seeds,
the scale a precision gap is read against.  It checks that the mixed-precision paths train like fp32 on the same
samples; it cannot say anything about speed (a CPU has no fast bf16/fp16 units).

(b) The main job (het-train, ``strategy=hetero`` and ``strategy=hetero_deepspeed``, the tiny char GPT) on an
emulated 2-rank cluster: one device
with fast bf16 units only (an A100-like ``{fp32: 0.001, bf16: 0.004}`` TFLOPS) and one with fast fp16 units only
(a V100-like ``{fp32: 0.001, fp16: 0.004}``), each rank's compute padded to its emulated time in the dtype it
computes in.  Uniform ``bf16-mixed`` runs the second device at its fp32 rate (the planner gives it a fifth of
the batch); ``per_device`` runs it in fp16 with loss scaling (half the batch).  ``per_device_ratio`` is the
measured samples/s of per_device over bf16 (means over the steps after warm-up), against the cost model's
``predicted_ratio``; ``per_device_loss_gap`` the relative gap of their final validation losses over every
held-out sequence, against ``seed_noise_b``, the gap between two bf16 runs of different seeds; the ``ds_`` keys
are the same on ``hetero_deepspeed`` (DeepSpeed's bf16 against the runtime's own fp32 masters under
per_device: ``core.runtime_rules`` deepspeed rule 7).  The emulation
checks the schedule (who computes how much in which dtype, the fp32 all-reduce, the agreed skip), not a GPU's
bf16/fp16 speed: the CPU's real 16-bit compute is kept below the padded time.
Last line: ``RESULT loss_gap_bf16=... loss_gap_fp16=... zero1_gap=... per_device_ratio=... predicted_ratio=...
per_device_loss_gap=... seed_noise_b=... ds_per_device_ratio=... ds_predicted_ratio=... ds_per_device_loss_gap=...
ds_seed_noise_b=... seed_noise=... val_fp32=...``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
UNITS = {"name": "bf16_beside_fp16", "inter_node_bandwidth_gbs": 1, "nodes": [{"name": "local", "intra_bandwidth_gbs": 1,
         "devices": [{"name": "bf16_units", "type": "CPU", "tflops": {"fp32": 0.001, "bf16": 0.004}, "efficiency": 1.0,
                      "emulated_speed": 1.0},
                     {"name": "fp16_units", "type": "CPU", "tflops": {"fp32": 0.001, "fp16": 0.004},
                      "efficiency": 1.0, "emulated_speed": 1.0}]}]}
"""Part (b)'s cluster: one device with fast bf16 units only, one with fast fp16 units only (rates x4 over fp32)."""
MODEL = {"num_layers": 4, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
DEVICES = tuple(f"cpu{i}" for i in range(4))


def plans(batch: int, micro: int) -> dict[str, Any]:
    """The aligned and the asymmetric plan of the module docstring, over 6 layers and ``batch`` samples."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    layers = MODEL["num_layers"] + 2

    def pipe(devices: tuple[str, ...], bounds: tuple[int, ...], samples: int) -> Pipeline:
        return Pipeline(tuple(Stage((d,), (a, b)) for d, a, b in zip(devices, bounds, bounds[1:])),
                        micro_batch_size=micro, samples=samples)

    def plan(pipes: tuple[Pipeline, ...]) -> Plan:
        return Plan(cluster="local", cluster_devices=DEVICES, model={"name": "char_gpt", "num_layers": layers},
                    global_batch_size=batch, pipelines=pipes, dtype="fp32", mode="manual")

    half = batch // 2
    quarter = batch // 4
    # rank = stage * dp + pipeline on DeepSpeed's grid: pipeline 0 on cpu0 -> cpu2, pipeline 1 on cpu1 -> cpu3
    aligned = plan((pipe(("cpu0", "cpu2"), (0, 3, layers), half), pipe(("cpu1", "cpu3"), (0, 3, layers), half)))
    asymmetric = plan((pipe(("cpu0",), (0, layers), quarter), pipe(("cpu1", "cpu2"), (0, 2, layers), half),
                       pipe(("cpu3",), (0, layers), batch - half - quarter)))
    return {"aligned": aligned, "asymmetric": asymmetric}


def run(plan: Any, dtype: str, zero_stage: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train ``plan`` in ``dtype`` on 4 ranks; rank 0's ``{"val_loss"}``."""
    import dataclasses

    from het_strategy.emulation.local_ranks import run_script_ranks

    chosen = dataclasses.replace(plan, dtype=dtype, zero_stage=zero_stage)
    with tempfile.TemporaryDirectory(prefix="het_mixed_") as tmp:
        out = Path(tmp)
        spec = {"plan": json.loads(chosen.to_json()), "steps": args.steps, "val_batches": args.val_batches,
                "seed": seed, "lr": args.lr, "clip": args.clip, "out": str(out / "result.json")}
        (out / "spec.json").write_text(json.dumps(spec))
        env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        world = len(chosen.used_devices)
        codes = run_script_ranks([sys.executable, __file__, "--worker", str(out / "spec.json")], world, out,
                                 args.timeout, env)
        if codes != [0] * world:
            tails = "\n----\n".join((out / f"log{r}.txt").read_text()[-2500:] for r in range(world))
            raise RuntimeError(f"ranks exited {codes}:\n{tails}")
        return json.loads((out / "result.json").read_text())


def _worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import TransformerConfig
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy.ds_runtime.engine import PlanRunner

    spec = json.loads(Path(spec_path).read_text())
    plan = Plan.from_dict(spec["plan"])
    if plan.dtype == "fp16":
        # DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (most CPUs); the path measured
        # (loss scaling, overflow skips, the reduction) is the same on torch's CPU fp16 kernels
        from deepspeed.accelerator import get_accelerator

        type(get_accelerator()).is_fp16_supported = lambda self: True
    cfg = TransformerConfig(name="char_gpt", **MODEL)
    torch.manual_seed(spec["seed"])
    model = CharGPT.from_workload_config(cfg)
    runner = PlanRunner(plan, model.pipeline_layers(), CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=spec["lr"]), timeout_s=300,
                        gradient_clipping=spec["clip"])
    corpus = stdlib_corpus(max_bytes=2_000_000)
    train, val = CharDataset(corpus.train, cfg.seq_len), CharDataset(corpus.val, cfg.seq_len)
    batch = plan.global_batch_size
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(spec["seed"]))

    def stacked(data: CharDataset, indices: Any) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(data[int(i)] for i in indices))
        return torch.stack(xs), torch.stack(ys)

    for step in range(spec["steps"]):
        runner.train_step(*stacked(train, order[step * batch:(step + 1) * batch]))
    # held-out sequences spread evenly over the whole validation text (every held-out file), not its first files
    spread = torch.linspace(0, len(val) - 1, spec["val_batches"] * batch).long()
    val_losses = [runner.eval_step(*stacked(val, spread[k * batch:(k + 1) * batch]))
                  for k in range(spec["val_batches"])]
    if runner.rank == 0:
        tmp = spec["out"] + ".tmp"
        Path(tmp).write_text(json.dumps({"val_loss": sum(val_losses) / len(val_losses)}))
        os.replace(tmp, spec["out"])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def per_device_part(args: argparse.Namespace) -> dict[str, float]:
    """Part (b), on each strategy of ``--strategies-b``: het-train in bf16-mixed (seeds 0 and 1) and per_device
    (seed 0); the ratios and loss gaps (keys prefixed ``ds_`` for ``hetero_deepspeed``)."""
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _het_train import run_het_train

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="het_per_device_") as tmp:
        cluster = Path(tmp) / "cluster.yaml"
        cluster.write_text(yaml.safe_dump(UNITS))
        for strategy in args.strategies_b.split(","):
            runs: dict[str, dict[str, Any]] = {}
            common = [f"cluster={cluster}", f"strategy={strategy}", f"train.max_steps={args.steps_b}",
                      f"train.global_batch_size={args.batch_b}", f"train.val_every_n_steps={args.steps_b}",
                      "train.val_batches=1"]
            print(f"  {strategy}:")
            for name, precision, seed in (("bf16", "bf16-mixed", 0), ("per_device", "per_device", 0),
                                          ("bf16_seed1", "bf16-mixed", 1)):
                runs[name] = run_het_train([*common, f"train.precision={precision}", f"train.seed={seed}"],
                                           Path(tmp) / strategy / name)
                r = runs[name]
                shares = r.get("shares", r.get("plan_samples"))
                print(f"    {name:<11} shares {shares}  {r['step_s']:.3f} s/step (predicted "
                      f"{r['predicted_step_s']:.3f})  {r['samples_per_s']:.2f} samples/s  val loss "
                      f"{r['final_val_loss']:.4f}", flush=True)
            bf16, per_device = runs["bf16"], runs["per_device"]
            ratio = per_device["samples_per_s"] / bf16["samples_per_s"]
            predicted = bf16["predicted_step_s"] / per_device["predicted_step_s"]
            gap = abs(per_device["final_val_loss"] - bf16["final_val_loss"]) / bf16["final_val_loss"]
            noise = abs(runs["bf16_seed1"]["final_val_loss"] - bf16["final_val_loss"]) / bf16["final_val_loss"]
            print(f"    per_device over bf16: measured {ratio:.3f}x, predicted {predicted:.3f}x (model error "
                  f"{abs(ratio - predicted) / predicted:.1%}); loss gap {gap:.2%} vs seed noise {noise:.2%}")
            prefix = "ds_" if strategy == "hetero_deepspeed" else ""
            out.update({f"{prefix}per_device_ratio": ratio, f"{prefix}predicted_ratio": predicted,
                        f"{prefix}per_device_loss_gap": gap, f"{prefix}seed_noise_b": noise})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (3e-3 trains chaotically here)")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient clipping: the global norm (0: none)")
    ap.add_argument("--val-batches", type=int, default=32)
    ap.add_argument("--seeds", default="0,1,2", help="part (a): comma-separated seeds, each run once per seed")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--steps-b", type=int, default=30, help="part (b): optimizer steps per het-train run")
    ap.add_argument("--batch-b", type=int, default=20, help="part (b): global batch (20: 16/4 in bf16, 10/10 per "
                    "device)")
    ap.add_argument("--strategies-b", default="hetero,hetero_deepspeed", help="part (b): comma-separated "
                    "strategies, each run in bf16 and per_device")
    ap.add_argument("--part", choices=("a", "b", "all"), default="all")
    args = ap.parse_args()
    b = per_device_part(args) if args.part in ("b", "all") else {}
    if args.part == "b":
        print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in b.items()))
        return
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = {"aligned": (("fp32", 0), ("bf16", 0), ("fp16", 1)),
            "asymmetric": (("fp32", 0), ("bf16", 0), ("fp32", 1), ("bf16", 1))}
    gaps: dict[str, float] = {}
    means: dict[str, float] = {}
    """Per plan, the fp32 ZeRO-0 mean."""
    print(f"char GPT {MODEL}, global batch {args.batch} (micro {args.micro}), {args.steps} steps of AdamW "
          f"lr {args.lr} clipped at norm {args.clip}, 4 CPU ranks; validation: {args.val_batches} held-out batches; "
          f"seeds {seeds}")
    print(f"  {'plan':<11} {'dtype':<5} {'ZeRO':>4} {'val loss per seed':<{8 * len(seeds)}} {'mean':>7} "
          f"{'gap to fp32':>11}")
    fp32_aligned: list[float] = []
    seed0_fp32: dict[str, float] = {}
    for name, plan in plans(args.batch, args.micro).items():
        for dtype, zero in runs[name]:
            exact = dtype == "fp32" and zero == 1  # ZeRO 1 against the ZeRO-0 fp32 run of the same seed
            vals = [run(plan, dtype, zero, seed, args)["val_loss"] for seed in (seeds[:1] if exact else seeds)]
            mean = statistics.fmean(vals)
            if (dtype, zero) == ("fp32", 0):
                means[name], seed0_fp32[name] = mean, vals[0]
                fp32_aligned = vals if name == "aligned" else fp32_aligned
            ref = seed0_fp32[name] if exact else means[name]
            gap = abs(mean - ref) / ref
            key = dtype if dtype != "fp32" else "zero1" if zero else None
            if key is not None:
                gaps[key] = max(gaps.get(key, 0.0), gap)
            cells = "".join(f"{v:>8.4f}" for v in vals).ljust(8 * len(seeds))
            print(f"  {name:<11} {dtype:<5} {zero:>4} {cells} {mean:>7.4f} {gap:>11.2%}", flush=True)
    base = statistics.fmean(fp32_aligned)
    noise = statistics.stdev(fp32_aligned) / base if len(fp32_aligned) > 1 else float("nan")
    print(f"  seed noise (aligned fp32, relative standard deviation over the seeds): {noise:.2%}")
    print(f"RESULT loss_gap_bf16={gaps['bf16']:.4f} loss_gap_fp16={gaps['fp16']:.4f} zero1_gap={gaps['zero1']:.4f} "
          + "".join(f"{k}={v:.4f} " for k, v in b.items()) + f"seed_noise={noise:.4f} "
          + f"val_fp32={base:.4f}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
