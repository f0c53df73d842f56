"""A rank becomes 3x slower mid-run: how fast the straggler callback notices, how close it gets, how it recovers.

One run of the main job (``het-train``, hetero strategy with
``straggler.enabled=true``) and one of plain ``ddp``, same model, batch, steps
and seed, on local_cpu4_equal (4 processes, speed 1) with a scheduled slowdown:
rank2 3x slower from step ``--slow-from`` until step ``--slow-until``.

* detect_steps: from the first slow step to the first step run with shares that
  moved work off rank2 (detection + the exchange period + the steps already
  prefetched);
* recovered / restore_steps: whether, after the slowdown ends, the shares went
  back to the even split, and how many steps after its end that took effect;
* throughput after detection vs ideal: the mean step time from two steps after
  the new shares took effect until the slowdown ends, against the ideal for the
  new speeds — the even split of the global batch over speeds 1, 1, 1/3, 1
  (continuous) plus the non-compute part of a step measured before the
  slowdown;
* vs_ddp: samples/s of the whole run, hetero with mitigation / ddp.

Last line: ``RESULT recovered=... detect_steps=... restore_steps=... vs_ddp=... after_vs_ideal=...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster
from het_strategy.emulation.speeds import emulated_seconds_per_sample
from het_strategy.core.workload import TransformerConfig, transformer_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=140)
    ap.add_argument("--slow-from", type=int, default=40)
    ap.add_argument("--slow-until", type=int, default=100)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--batch", type=int, default=48)
    args = ap.parse_args()
    model = {"num_layers": 2, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
    raw = load_cluster("local_cpu4_equal").to_dict()
    slow_dev = raw["nodes"][0]["devices"][args.rank]["name"]
    raw["slowdowns"] = [{"device": slow_dev, "factor": args.factor, "start_step": args.slow_from,
                         "end_step": args.slow_until}]
    cluster = load_cluster(raw)
    world = cluster.num_devices
    t1 = emulated_seconds_per_sample(cluster, slow_dev, transformer_workload(TransformerConfig("m", **model), "fp32"))
    common = [f"train.max_steps={args.steps}", f"train.global_batch_size={args.batch}",
              f"train.val_every_n_steps={args.steps}", "train.val_batches=1",
              *(f"model.{k}={v}" for k, v in model.items() if k != "vocab_size")]
    with tempfile.TemporaryDirectory(prefix="straggler_") as tmp:
        path = Path(tmp) / "cpu4_slowdown.yaml"
        path.write_text(yaml.safe_dump(raw))
        het = run_het_train([f"cluster={path}", *common, "strategy=hetero", "straggler.enabled=true"],
                            Path(tmp) / "hetero")
        ddp = run_het_train([f"cluster={path}", *common, "strategy=ddp"], Path(tmp) / "ddp")

    even = [args.batch // world] * world
    decisions = het["straggler_decisions"]
    print(f"{slow_dev} {args.factor:g}x slower for steps [{args.slow_from}, {args.slow_until}); global batch "
          f"{args.batch}, {args.steps} steps; emulated {t1 * 1e3:.2f} ms/sample at speed 1")
    for d in decisions:
        print(f"  after step {d['step']:>3} (effective {d['effective_step']:>3}) {d['action']}: "
              f"{d['shares_before']} -> {d['shares_after']}; {d['reason']}")
    moved = [d for d in decisions if d["effective_step"] > args.slow_from and d["shares_after"][args.rank] < even[args.rank]]
    back = [d for d in decisions if d["effective_step"] > args.slow_until and d["shares_after"] == even]
    detect = moved[0]["effective_step"] - args.slow_from if moved else None
    restore = back[0]["effective_step"] - args.slow_until if back else None
    recovered = bool(back) and decisions[-1]["shares_after"] == even
    durations = het["step_durations_s"]
    before = statistics.fmean(durations[5: args.slow_from])
    overhead = max(before - args.batch * t1 / world, 0.0)
    speeds = [1.0] * world
    speeds[args.rank] = 1.0 / args.factor
    ideal_after = args.batch * t1 / sum(speeds) + overhead
    after_ratio = None
    if moved and moved[0]["effective_step"] + 2 < args.slow_until:
        after = statistics.fmean(durations[moved[0]["effective_step"] + 2: args.slow_until])
        after_ratio = ideal_after / after
        print(f"  before the slowdown {before:.4f} s/step (non-compute part {overhead:.4f} s); after detection "
              f"{after:.4f} s/step, ideal for the new speeds {ideal_after:.4f} s/step -> {after_ratio:.1%} of ideal")
    ddp_slow = statistics.fmean(ddp["step_durations_s"][args.slow_from + 2: args.slow_until])
    print(f"  ddp during the slowdown {ddp_slow:.4f} s/step (every step waits for {slow_dev})")
    for r in (het, ddp):
        print("  " + describe(r))
    vs_ddp = het["samples_per_s"] / ddp["samples_per_s"]
    print(f"RESULT recovered={int(recovered)} detect_steps={detect} restore_steps={restore} vs_ddp={vs_ddp:.3f} "
          f"after_vs_ideal={after_ratio if after_ratio is None else round(after_ratio, 3)}")


if __name__ == "__main__":
    main()
