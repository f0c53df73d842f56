"""Does compression cost accuracy?  Uncompressed vs adaptive vs uniform 4-bit, same steps and seeds.

1. **Char GPT (the main job)** — ``het-train`` (Lightning, ``strategy=hetero``)
   on 4 CPU ranks without emulated speeds, ``--gpt-steps`` steps at learning
   rate ``--gpt-lr`` (1e-3), the same seed and data order for all three (mean
   over ``--gpt-seeds`` seeds); ``compression=none``, ``compression=q4``
   and ``compression=adaptive`` with ``compression.link_mbit=100``: on this
   machine's loopback the adaptive controller would (rightly) switch itself
   off, so it is told to plan for a 100 Mbit/s link, the link of
   ``compression_speed.py``, and then compresses as it would there.  Figure:
   the final validation loss over every held-out sequence.  Why 1e-3 and not
   het-train's default 3e-3: at 3e-3 this run is chaotic — measured here,
   300 steps, fp16 compression alone moved the final loss by 0.8% and seed 1
   vs seed 0 by 5% — so a single run's gap would measure chaos, not
   compression; at 1e-3 fp16 moves it by 0.01% (and the loss is lower: 2.08
   against 2.38).
2. **MLP on scikit-learn's bundled digits** (8x8 images, 10 classes; 1437
   train / 360 test, stratified) — plain DDP on 4 gloo ranks with
   ``compression_hook``, ``--digits-epochs`` epochs, the same three settings
   (adaptive with ``link_mbit=100``); figure: test accuracy, averaged over
   ``--digits-seeds`` seeds.

gap = the largest difference between a compressed run and the uncompressed one:
relative for the GPT's loss, in accuracy points for the digits.  Last line:
``RESULT gpt_rel_loss_gap=... digits_acc_gap=...`` (the issue asks <= 0.01 and
<= 0.5).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _het_train import describe, run_het_train  # noqa: E402

from het_strategy.compression import CompressionState, compression_hook  # noqa: E402

SETTINGS = {
    "uncompressed": {"method": "none"},
    "quantize4": {"method": "q4"},
    "adaptive": {"method": "adaptive", "link_mbit": 100.0},
}
GPT_OVERRIDES = {"uncompressed": ["compression=none"], "quantize4": ["compression=q4"],
                 "adaptive": ["compression=adaptive", "compression.link_mbit=100"]}


def _plain_cluster(path: Path) -> Path:
    """4 CPU ranks without emulated speeds (real compute only: quality does not need the emulated pace)."""
    devices = [{"name": f"rank{r}", "type": "CPU", "tflops": {"fp32": 0.05}, "efficiency": 1.0} for r in range(4)]
    path.write_text(yaml.safe_dump({"name": "local_cpu4_plain", "inter_node_bandwidth_gbs": 1,
                                    "nodes": [{"name": "local", "intra_bandwidth_gbs": 1, "devices": devices}]}))
    return path


def gpt_quality(steps: int, lr: float, seeds: int, tmp: Path) -> dict[str, float]:
    cluster = _plain_cluster(tmp / "cluster.yaml")
    losses: dict[str, list[float]] = {label: [] for label in GPT_OVERRIDES}
    for seed in range(seeds):
        common = [f"cluster={cluster}", f"train.max_steps={steps}", f"train.val_every_n_steps={steps}",
                  "train.val_batches=1", f"train.seed={seed}", f"train.lr={lr}"]
        for label, overrides in GPT_OVERRIDES.items():
            summary = run_het_train([*common, *overrides], tmp / f"{label}-{seed}")
            losses[label].append(summary["final_val_loss"])
            extra = ""
            if summary.get("compression_choices"):
                used = sorted(set(summary["compression_choices"].values()))
                extra = f"; wire saving {summary['compression_wire_ratio']:.2f}x, methods {used}"
            print(f"  gpt seed {seed} {label:<12} " + describe(summary) + extra, flush=True)
    return {label: statistics.fmean(values) for label, values in losses.items()}


def _digits_rank(rank: int, world: int, setting: dict, epochs: int, seed: int) -> float:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    x_train, x_test = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    y_train, y_test = torch.tensor(y_train), torch.tensor(y_test)
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                 torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = DDP(module)
    state = CompressionState(model, {**setting, "verbose": False, "warmup_steps": 10, "resolve_every": 20})
    model.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = 16
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(x_train), generator=gen)
        for start in range(0, len(order) - per_rank * world + 1, per_rank * world):
            idx = order[start + rank * per_rank:start + (rank + 1) * per_rank]
            opt.zero_grad()
            F.cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((module(x_test).argmax(1) == y_test).float().mean()) * 100


def digits_quality(epochs: int, seeds: int) -> dict[str, float]:
    from het_strategy.emulation.local_ranks import run_local_ranks

    accuracy = {}
    for label, setting in SETTINGS.items():
        runs = [run_local_ranks(_digits_rank, 4, setting, epochs, seed)[0] for seed in range(seeds)]
        accuracy[label] = statistics.fmean(runs)
        print(f"  digits {label:<12} test accuracy {accuracy[label]:.2f}% (seeds: "
              + ", ".join(f"{a:.2f}" for a in runs) + ")", flush=True)
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpt-steps", type=int, default=300)
    parser.add_argument("--gpt-lr", type=float, default=1e-3)
    parser.add_argument("--gpt-seeds", type=int, default=1)
    parser.add_argument("--digits-epochs", type=int, default=30)
    parser.add_argument("--digits-seeds", type=int, default=3)
    parser.add_argument("--skip-gpt", action="store_true")
    args = parser.parse_args()
    gpt_gap = float("nan")
    if not args.skip_gpt:
        with tempfile.TemporaryDirectory() as tmp:
            print(f"char GPT, het-train, 4 ranks, {args.gpt_steps} steps, lr {args.gpt_lr:g}, "
                  f"{args.gpt_seeds} seed(s)", flush=True)
            losses = gpt_quality(args.gpt_steps, args.gpt_lr, args.gpt_seeds, Path(tmp))
        base = losses["uncompressed"]
        gpt_gap = max(abs(losses[k] - base) / base for k in ("quantize4", "adaptive"))
        print("  gpt val loss: " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
              + f" -> largest relative gap {gpt_gap:.4f}", flush=True)
    print(f"MLP on sklearn digits, 4 ranks, {args.digits_epochs} epochs x {args.digits_seeds} seeds", flush=True)
    acc = digits_quality(args.digits_epochs, args.digits_seeds)
    digits_gap = max(abs(acc[k] - acc["uncompressed"]) for k in ("quantize4", "adaptive"))
    print("  digits accuracy: " + ", ".join(f"{k} {v:.2f}%" for k, v in acc.items())
          + f" -> largest gap {digits_gap:.2f} points", flush=True)
    print(f"RESULT gpt_rel_loss_gap={gpt_gap:.4f} digits_acc_gap={digits_gap:.3f}")


if __name__ == "__main__":
    main()
