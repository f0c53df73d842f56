"""No rebalancing on a steady run: 500 steps with +-10% emulated noise per step, straggler mitigation on.

The main job (``het-train``, hetero, ``straggler.enabled=true`` with its
default sensitivity) on local_cpu4_equal with ``emulation_noise: 0.1`` (each
rank's compute time of each step x a uniform factor in [0.9, 1.1]) on top of
this shared machine's own jitter.  Every decision the callback takes is a false
alarm.  Last line: ``RESULT false_alarms=... steps=...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml
from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    raw = load_cluster("local_cpu4_equal").to_dict()
    raw["emulation_noise"] = args.noise
    with tempfile.TemporaryDirectory(prefix="straggler_fa_") as tmp:
        path = Path(tmp) / "cpu4_noisy.yaml"
        path.write_text(yaml.safe_dump(raw))
        summary = run_het_train([f"cluster={path}", f"train.max_steps={args.steps}",
                                 f"train.global_batch_size={args.batch}", f"train.val_every_n_steps={args.steps}",
                                 "train.val_batches=1", "model.num_layers=2", "model.hidden_size=64",
                                 "model.seq_len=64", "strategy=hetero", "straggler.enabled=true"], Path(tmp) / "run")
    decisions = summary["straggler_decisions"]
    durations = summary["step_durations_s"][5:]
    spread = (max(durations) - min(durations)) / (sum(durations) / len(durations))
    print(f"{args.steps} steps, noise +-{args.noise:.0%} per rank and step; step time range / mean {spread:.2f}")
    print("  " + describe(summary))
    for d in decisions:
        print(f"  FALSE ALARM after step {d['step']}: {d['shares_before']} -> {d['shares_after']}; {d['reason']}")
    print(f"RESULT false_alarms={len(decisions)} steps={args.steps}")


if __name__ == "__main__":
    main()
