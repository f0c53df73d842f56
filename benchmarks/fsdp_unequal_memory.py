"""``hetero_fsdp``: shards sized by memory, shares by speed (char GPT on CPU ranks, gloo), against even FSDP.

Four sections, one run; the plans from the fsdp planner (``planning.strategy_plans.fsdp_plan``):

1. **Exact** (float64; ``het_strategy.fsdp.shard_model`` on forked ranks): 3 ranks with memories 4:2:1 and
   speeds 1:1:0.5, the planner's uneven shards and shares; the parameters after 5 Adam steps against one process
   on the whole batch (``exact_max_diff``).  A sharded checkpoint (``fsdp.checkpoint``) saved by the 3 ranks after
   those steps is loaded into 2 ranks with other fractions and shares; their next update against the 3 ranks' own
   (``reshard_diff``).
2. **Fits** (float32; forked ranks): the smallest device cannot hold an even shard with its activations.  The
   planner refuses even sharding (``even_fits=0``); forced, the emulated memory cap
   (``emulation.memory_cap.MemoryMeter``, capped at each device's ``memory_gb``) stops it; the planner's uneven
   plan trains under the same caps (``uneven_fits=1``).  Each rank's counted peak against the planner's estimate:
   ``mem_err`` the worst relative error, and the parts side by side (what each counts differently).
3. **Fast**: speeds 1, 1, 0.5, 0.25, the same model and memory.  ``Trainer(strategy=HeteroFSDPStrategy(...))``
   with the planner's uneven shares against the same strategy given the even plan (``fsdp_plan(even_shards=True,
   equal_shares=True)``: even shares and even shards, Lightning ``FSDPStrategy``'s layout), one after the other
   in this run, means over the batches after warm-up; each rank's batch padded to its emulated device's time (the
   ``hetero`` run's padding, after backward); collectives real.  ``vs_fsdp`` = even s/step / uneven s/step,
   ``model_error`` = |measured - predicted| / predicted for the uneven plan (``CostModel.score``).  Beside them, the
   runtime alone on forked ranks with each unit's forward and backward padded (``_fsdp_ranks.UnitPadding``).
4. **Overlap**: the share of the step each rank is blocked on communication (``ShardedModel.comm_wait_s``: waiting
   for a gather or a reduce-scatter, which includes waiting for a slower rank to join it), mean over ranks, with
   prefetch on (``comm_wait_frac``: the runtime alone, whose per-unit padding lets a prefetched gather overlap the
   emulated compute) and off; the Lightning runs' figures beside them (their padding comes after the backward, so a
   prefetch there overlaps only the real compute).

What it cannot check: Lightning's own ``FSDPStrategy`` as the baseline (Lightning 2.6 refuses it with a CPU
accelerator, "requires a GPU accelerator"; a subclass passes that check, and torch's ``FullyShardedDataParallel``
under it then raises "FSDP needs a non-CPU accelerator device"), so the even baseline is ``hetero_fsdp`` on the
even layout; a device allocator's peak (the meter counts tensors; what it leaves out is in
``emulation/memory_cap.py``); NCCL and a slow link (gloo on loopback, 1 GB/s declared).

Run: ``.venv/bin/python benchmarks/fsdp_unequal_memory.py`` (about 1.5 minutes on 2 cores).  Last line:
``RESULT exact_max_diff=... reshard_diff=... even_fits=... uneven_fits=... mem_err=... vs_fsdp=... model_error=...
comm_wait_frac=...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _fsdp_ranks as ranks  # noqa: E402
from _fsdp_lightning import lightning_fit  # noqa: E402

from het_strategy.core.cluster import cluster_from_dict  # noqa: E402
from het_strategy.core.cost_model import CostModel  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.fsdp_cost import FsdpCost, even_fractions  # noqa: E402
from het_strategy.core.workload import TransformerConfig, transformer_workload  # noqa: E402
from het_strategy.emulation.memory_cap import format_bytes  # noqa: E402
from het_strategy.planning.fsdp import plan_fsdp  # noqa: E402
from het_strategy.planning.strategy_plans import data_parallel_settings, fsdp_plan  # noqa: E402


def cluster_dict(name: str, devices: list[tuple[str, float, float]], tflops: float) -> dict:
    """One node of CPU devices ``(name, emulated_speed, memory_gb)`` at ``tflops`` x speed, 1 GB/s links."""
    return {"name": name, "inter_node_bandwidth_gbs": 1, "nodes": [{"name": "local", "intra_bandwidth_gbs": 1,
            "devices": [{"name": n, "type": "CPU", "tflops": {"fp32": tflops}, "efficiency": 1.0,
                         "emulated_speed": s, "memory_gb": m} for n, s, m in devices]}]}


def model(num_layers: int, hidden: int, heads: int, seq: int, vocab: int) -> TransformerConfig:
    # transformers' count of the saved activations: what torch's own modules (CharGPT's) keep
    return TransformerConfig(name="char_gpt", num_layers=num_layers, hidden_size=hidden, num_heads=heads, seq_len=seq,
                             vocab_size=vocab, implementation="transformers")


def layout(plan) -> tuple[list[str], list[int], list[int], list[float]]:
    devices = [p.stages[0].devices[0] for p in plan.pipelines]
    return (devices, [p.samples for p in plan.pipelines], [min(p.micro_batch_size, p.samples) for p in plan.pipelines],
            [plan.shards[d] for d in devices])


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b)


def failed(results: list) -> str | None:
    for r, res in enumerate(results):
        if "raised" in res:
            return f"rank {r}: {res['raised']}"
    return None


# -- 1. exact ---------------------------------------------------------------------------------------------------
def exact(args: argparse.Namespace) -> tuple[float, float]:
    cfg = model(3, 32, 2, 16, 64)
    n, steps = 10, 5
    raw = cluster_dict("exact_4_2_1", [("m4", 1.0, 0.04), ("m2", 1.0, 0.02), ("m1", 0.5, 0.01)], 0.01)
    plan = fsdp_plan(cluster_from_dict(raw), transformer_workload(cfg, dtype="fp32"), n, "fp32")
    devices, shares, micro, fractions = layout(plan)
    print(f"1. exact: char GPT {cfg.num_layers} blocks, float64, global batch {n}; memories 4:2:1, speeds 1:1:0.5")
    print(f"   planned shards {', '.join(f'{d} {f:.3f}' for d, f in zip(devices, fractions))}; shares {shares}, "
          f"micro-batches {micro}")
    with tempfile.TemporaryDirectory(prefix="het_fsdp_ckpt_") as tmp:
        ckpt = str(Path(tmp) / "ckpt")
        three = ranks.run_ranks(ranks.train_exact, 3, cfg, fractions, shares, micro, steps, ckpt)
        if (why := failed(three)) is not None:
            raise SystemExit(why)
        other = ([0.7, 0.3], [3, 7], [3, 4])
        two = ranks.run_ranks(ranks.resume_one_step, 2, cfg, *other, ckpt)
        if (why := failed(two)) is not None:
            raise SystemExit(why)
    ref = ranks.reference(cfg, n, steps + 1)
    diff = max_diff(three[0]["after"], ref[steps - 1])
    reshard = max_diff(two[0]["next"], three[0]["next"])
    print(f"   after {steps} steps, 3 ranks vs one process: max |diff| {diff:.2e}")
    print(f"   checkpoint of the 3 ranks loaded into 2 (shards {other[0]}, shares {other[1]}): loaded vs saved "
          f"{max_diff(two[0]['loaded'], three[0]['after']):.2e}; next update vs the 3 ranks' {reshard:.2e}, vs one "
          f"process {max_diff(two[0]['next'], ref[steps]):.2e}")
    return diff, reshard


# -- 2. fits ----------------------------------------------------------------------------------------------------
def fits(args: argparse.Namespace) -> tuple[int, int, float]:
    cfg = model(4, 128, 4, 64, 256)
    n = 12
    raw = cluster_dict("fits", [("big0", 1.0, 0.05), ("big1", 1.0, 0.05), ("small", 0.5, args.small_gb)], 0.01)
    cluster = cluster_from_dict(raw)
    workload = transformer_workload(cfg, dtype="fp32")
    cm = CostModel(cluster, workload, data_parallel_settings(n, "fp32"))
    cost = FsdpCost(cm)
    params = sum(u.params for u in cost.units)
    print(f"2. fits: char GPT {cfg.num_layers} blocks (h {cfg.hidden_size}, {params / 1e6:.2f} M parameters, "
          f"{format_bytes(params * cost.bytes_per_param)} of parameters, gradients and Adam state), float32, global "
          f"batch {n}; big0, big1 {format_bytes(0.05 * 2**30)}, small {format_bytes(args.small_gb * 2**30)} "
          "(emulated caps)")
    try:
        plan_fsdp(cm, even_shards=True)
        even_fits = 1
        print("   planner, even shards: fits")
    except ConfigError as exc:
        even_fits = 0
        print(f"   planner, even shards: refused: {exc}")
    plan = fsdp_plan(cluster, workload, n, "fp32")
    devices, shares, micro, fractions = layout(plan)
    print(f"   planner, hetero_fsdp: shards {', '.join(f'{d} {f:.3f}' for d, f in zip(devices, fractions))}; shares "
          f"{shares}, micro-batches {micro}")
    even = list(even_fractions(devices).values())
    forced = ranks.run_ranks(ranks.train_metered, 3, cfg, even, shares, micro, args.fit_steps, raw, devices)
    oom = [(r, res["error"]) for r, res in enumerate(forced) if res.get("error")]
    if oom:
        print(f"   forced even shards under the emulated caps: {oom[0][1]}")
    else:
        print(f"   forced even shards under the emulated caps: trained (no emulated out of memory); "
              f"{failed(forced) or ''}")
    run = ranks.run_ranks(ranks.train_metered, 3, cfg, fractions, shares, micro, args.fit_steps, raw, devices)
    why = failed(run) or next((res["error"] for res in run if res.get("error")), None)
    uneven_fits = int(why is None)
    print(f"   hetero_fsdp's plan under the same caps: {'trained ' + str(args.fit_steps) + ' steps' if uneven_fits else why}")
    if not uneven_fits:
        return even_fits, 0, float("nan")
    need = cost.memory(devices, micro, fractions)
    print("   peak per rank, planner's estimate vs counted (MemoryMeter), by part:")
    print(f"   {'rank':<12} {'planner':>10} {'counted':>10} {'error':>7} | planner (its peak phase): shard / gathered / "
          "in-flight collectives / activations | counted: params+grads+Adam / gathered / in-flight collectives / "
          "activations")
    errors = []
    for r, d in enumerate(devices):
        est, res = need[d], run[r]
        p = res["parts"]
        err = abs(res["peak"] - est.need) / est.need
        errors.append(err)
        state = p["parameters"] + p["gradients"] + p["optimizer"]
        print(f"   {r} {d:<10} {format_bytes(est.need):>10} {format_bytes(res['peak']):>10} {err:7.1%} | "
              f"({est.phase}) {format_bytes(est.shard)} / {format_bytes(est.gathered)} / "
              f"{format_bytes(est.collectives)} / {format_bytes(est.activations)} | "
              f"{format_bytes(state)} ({format_bytes(p['gradients'])} grads) / {format_bytes(p['gathered'])} / "
              f"{format_bytes(p['collectives'])} / {format_bytes(p['activations'])}")
    return even_fits, uneven_fits, max(errors)


# -- 3. fast, 4. overlap -----------------------------------------------------------------------------------------
def fast(args: argparse.Namespace) -> tuple[float, float, float]:
    cfg = model(4, 64, 4, 32, 128)
    n = args.fast_batch
    speeds = [("s1a", 1.0), ("s1b", 1.0), ("s05", 0.5), ("s025", 0.25)]
    raw = cluster_dict("fast_1_1_05_025", [(d, s, 1.0) for d, s in speeds], args.tflops)
    cluster = cluster_from_dict(raw)
    workload = transformer_workload(cfg, dtype="fp32")
    cm = CostModel(cluster, workload, data_parallel_settings(n, "fp32"))
    cost = FsdpCost(cm)
    plan = fsdp_plan(cluster, workload, n, "fp32")
    devices, shares, micro, fractions = layout(plan)
    even_shares = [n // 4 + (1 if r < n % 4 else 0) for r in range(4)]
    even_micro = [min(s, max(micro)) for s in even_shares]
    even = list(even_fractions(devices).values())

    def seconds(d: str, share: int, m: int) -> dict[int, list[float]]:
        sizes = {m, share - (-(-share // m) - 1) * m}
        return {b: cost.phase_compute_s(d, b) for b in sizes if b > 0}

    def run(shares_: list[int], micro_: list[int], fractions_: list[float], prefetch: bool) -> list[dict]:
        secs = [seconds(d, s, m) for d, s, m in zip(devices, shares_, micro_)]
        res = ranks.run_ranks(_timed_rank, 4, cfg, fractions_, shares_, micro_, secs, args.steps, args.warmup,
                              prefetch)
        if (why := failed(res)) is not None:
            raise SystemExit(why)
        return res

    predicted = cm.score(plan).step_time_s
    print(f"3. fast: char GPT {cfg.num_layers} blocks (h {cfg.hidden_size}), float32, global batch {n}, speeds "
          f"{', '.join(f'{d} {s:g}' for d, s in speeds)} (emulated compute, real collectives); "
          f"{args.steps} steps after {args.warmup} warm-up each")
    print(f"   hetero_fsdp plan: shares {shares}, micro-batches {micro}, shards "
          f"{', '.join(f'{f:.3f}' for f in fractions)}; even-share baseline: shares {even_shares}, even shards "
          "(hetero_fsdp itself on fsdp_plan(even_shards, equal_shares): Lightning's FSDPStrategy refuses a CPU "
          "accelerator, and torch's FullyShardedDataParallel under it needs a non-CPU device)")
    # the runtime alone: shard_model on forked ranks, each unit padded (the overlap of gathers with emulated compute)
    uneven = run(shares, micro, fractions, True)
    base = run(even_shares, even_micro, even, True)
    off = run(shares, micro, fractions, False)
    m_uneven, m_even, m_off = (statistics.fmean(r["step_s"] for r in res) for res in (uneven, base, off))
    # the Lightning strategy: Trainer(strategy=HeteroFSDPStrategy(...)), each rank's batch padded after backward
    even_plan = fsdp_plan(cluster, workload, n, "fp32", even_shards=True, equal_shares=True)
    spec = {"cluster": raw, "model": dataclasses.asdict(cfg), "steps": args.steps, "warmup": args.warmup,
            "global_batch": n}
    pl_runs = {"uneven": lightning_fit(dict(spec, prefetch=True)),
               "even": lightning_fit(dict(spec, prefetch=True, plan=even_plan.to_dict())),
               "off": lightning_fit(dict(spec, prefetch=False))}
    pl_step = {k: statistics.fmean(r["step_s"] for r in v) for k, v in pl_runs.items()}
    if pl_runs["even"][0]["shares"] != even_shares or pl_runs["uneven"][0]["shares"] != shares:
        raise SystemExit(f"the Lightning runs' shares {pl_runs['even'][0]['shares']} / {pl_runs['uneven'][0]['shares']}"
                         f" are not the plans' {even_shares} / {shares}")
    predicted_even = cm.score(even_plan).step_time_s
    vs = pl_step["even"] / pl_step["uneven"]
    err = abs(pl_step["uneven"] - predicted) / predicted
    print(f"   {'run':<52} {'measured s/step':>15} {'predicted':>10} {'error':>7}")
    rows = [("HeteroFSDPStrategy, planned shares", pl_step["uneven"], predicted),
            ("HeteroFSDPStrategy, even shares and shards (baseline)", pl_step["even"], predicted_even),
            ("runtime alone (per-unit padding), planned shares", m_uneven, predicted),
            ("runtime alone (per-unit padding), even shares", m_even, predicted_even)]
    for name, meas, pred in rows:
        print(f"   {name:<52} {meas:15.3f} {pred:10.3f} {abs(meas - pred) / pred:7.1%}")
    print(f"   hetero_fsdp vs even shares: measured {vs:.2f}x (HeteroFSDPStrategy), {m_even / m_uneven:.2f}x (runtime "
          f"alone); predicted {predicted_even / predicted:.2f}x")

    def wait_frac(res: list[dict]) -> float:
        return statistics.fmean(r["wait_s"] / r["step_s"] for r in res)

    # the runtime alone pads each unit, so a prefetched gather can hide behind the (emulated) compute of the unit
    # before it; the strategy pads a rank's whole batch after its backward, where a prefetch hides only behind the
    # real compute, and a rank's wait for a slower one to join the next step's first gather counts as blocked
    frac_on, frac_off = wait_frac(uneven), wait_frac(off)
    print("4. overlap: blocked on communication, share of the step (mean over ranks), prefetch on / off:")
    print(f"   runtime alone (per-unit padding): {frac_on:.1%} ({m_uneven:.3f} s/step) / {frac_off:.1%} "
          f"({m_off:.3f} s/step); per rank on " + ", ".join(f"{r['wait_s'] / r['step_s']:.1%}" for r in uneven))
    print(f"   HeteroFSDPStrategy (batch padded after backward): {wait_frac(pl_runs['uneven']):.1%} "
          f"({pl_step['uneven']:.3f} s/step) / {wait_frac(pl_runs['off']):.1%} ({pl_step['off']:.3f} s/step); per "
          "rank on " + ", ".join(f"{r['wait_s'] / r['step_s']:.1%}" for r in pl_runs["uneven"]))
    return vs, err, frac_on


def _timed_rank(rank: int, world: int, cfg, fractions, shares, micro, secs, steps, warmup, prefetch):
    return ranks.train_timed(rank, world, cfg, fractions, shares, micro, secs[rank], steps, warmup, prefetch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--small-gb", type=float, default=0.007, help="the fits section's smallest device memory")
    ap.add_argument("--fit-steps", type=int, default=2)
    ap.add_argument("--fast-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tflops", type=float, default=0.0005,
                    help="declared fp32 TFLOPS of a speed-1 device in the fast section: low enough that 4 ranks "
                         "on 2 cores stay inside their emulated time")
    args = ap.parse_args()
    t0 = time.perf_counter()
    diff, reshard = exact(args)
    even_fits, uneven_fits, mem_err = fits(args)
    vs, model_error, frac = fast(args)
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"RESULT exact_max_diff={diff:.2e} reshard_diff={reshard:.2e} even_fits={even_fits} "
          f"uneven_fits={uneven_fits} mem_err={mem_err:.3f} vs_fsdp={vs:.3f} model_error={model_error:.3f} "
          f"comm_wait_frac={frac:.3f}")


if __name__ == "__main__":
    main()
