"""No rebalancing on a steady run, quiet or beside a CPU-heavy process; a real 3x slowdown still found fast.

Three runs of the main job (``het-train``, hetero, ``straggler.enabled=true``
with its default sensitivity) on local_cpu4_equal with ``emulation_noise: 0.1``
(each rank's compute time of each step x a uniform factor in [0.9, 1.1]) on
top of this shared machine's own jitter:

1. quiet: ``--steps`` steady steps; every decision is a false alarm;
2. busy: the same, while ``--busy`` processes spin (``while True: pass``) on
   the same cores — the ranks' real compute then overruns their emulated time
   by varying amounts, slowing every rank alike;
3. detect: busy again, rank2 ``--factor`` x slower from step ``--slow-from``:
   detect_steps = from the first slow step to the first step run with shares
   that moved work off rank2 (detection + the exchange period + the steps
   already prefetched); decisions before the slowdown count as false alarms.

The load average before each run is printed (other work on the machine counts
too).  Last line: ``RESULT false_alarms=<quiet> false_alarms_busy=<busy>
detect_steps=<steps> ...``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster


def _run(raw: dict[str, Any], steps: int, batch: int, tmp: Path, label: str, busy: int) -> dict[str, Any]:
    """One het-train run of ``steps`` on cluster ``raw``, with ``busy`` spinning processes beside it."""
    path = tmp / f"{label}.yaml"
    path.write_text(yaml.safe_dump(raw))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        load = os.getloadavg()
        summary = run_het_train([f"cluster={path}", f"train.max_steps={steps}", f"train.global_batch_size={batch}",
                                 f"train.val_every_n_steps={steps}", "train.val_batches=1", "model.num_layers=2",
                                 "model.hidden_size=64", "model.seq_len=64", "strategy=hetero",
                                 "straggler.enabled=true"], tmp / label)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    summary["load_before"] = load
    return summary


def _report(label: str, summary: dict[str, Any], decisions: list[dict[str, Any]], note: str = "") -> None:
    durations = summary["step_durations_s"][5:]
    spread = (max(durations) - min(durations)) / (sum(durations) / len(durations))
    load = ", ".join(f"{x:.2f}" for x in summary["load_before"])
    print(f"{label}: load average before {load}; step time range / mean {spread:.2f}{note}")
    print("  " + describe(summary))
    for d in decisions:
        print(f"  FALSE ALARM after step {d['step']}: {d['shares_before']} -> {d['shares_after']}; {d['reason']}")


def _num_devices(raw: dict[str, Any]) -> int:
    return sum(len(n["devices"]) for n in raw["nodes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--busy", type=int, default=2, help="spinning processes beside the busy runs")
    ap.add_argument("--slow-from", type=int, default=60)
    ap.add_argument("--detect-steps", type=int, default=120, help="steps of the detection run")
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--rank", type=int, default=2)
    args = ap.parse_args()
    raw = load_cluster("local_cpu4_equal").to_dict()
    raw["emulation_noise"] = args.noise
    slow_dev = raw["nodes"][0]["devices"][args.rank]["name"]
    slowed = dict(raw, slowdowns=[{"device": slow_dev, "factor": args.factor, "start_step": args.slow_from}])
    with tempfile.TemporaryDirectory(prefix="straggler_fa_") as tmp:
        quiet = _run(raw, args.steps, args.batch, Path(tmp), "quiet", 0)
        busy = _run(raw, args.steps, args.batch, Path(tmp), "busy", args.busy)
        detect = _run(slowed, args.detect_steps, args.batch, Path(tmp), "detect", args.busy)

    print(f"{args.steps} steps, noise +-{args.noise:.0%} per rank and step, global batch {args.batch}; "
          f"busy: {args.busy} spinning process(es) on {os.cpu_count()} cores")
    _report("quiet", quiet, quiet["straggler_decisions"])
    _report("busy", busy, busy["straggler_decisions"])
    even = args.batch // _num_devices(raw)
    decisions = detect["straggler_decisions"]
    early = [d for d in decisions if d["effective_step"] <= args.slow_from]
    moved = [d for d in decisions if d["effective_step"] > args.slow_from and d["shares_after"][args.rank] < even]
    detect_steps = moved[0]["effective_step"] - args.slow_from if moved else None
    _report("detect", detect, early, f"; {slow_dev} {args.factor:g}x slower from step {args.slow_from}")
    for d in moved[:1]:
        print(f"  after step {d['step']} (effective {d['effective_step']}) {d['action']}: {d['shares_before']} -> "
              f"{d['shares_after']}; {d['reason']}")
    load = os.getloadavg()[0]
    print(f"RESULT false_alarms={len(quiet['straggler_decisions'])} false_alarms_busy="
          f"{len(busy['straggler_decisions'])} detect_steps={detect_steps} false_alarms_detect={len(early)} "
          f"steps={args.steps} busy_procs={args.busy} load_avg_1min={load:.2f}")


if __name__ == "__main__":
    main()
