"""Does uneven data parallelism train the same model?  hetero vs plain ``ddp``, same batch, steps and seeds.

Both strategies compute the gradient of the mean loss over a global batch of
the same size each step (hetero weights each rank's loss by its sample count).
With the same seed they even see the same global batches: Lightning's
DistributedSampler and hetero's order are the same seeded permutation, which
ddp deals round robin and hetero cuts into uneven contiguous slices, and the
union of a step's slices is the same 44 samples either way.  So the two runs
differ only in the order of floating-point sums — which chaotic training
amplifies over many steps.  The main job (``het-train``: char GPT on the standard library's
source, emulated local_cpu4_mixed) runs for each strategy and seed (model
initialisation and data order; the held-out files stay the same); the final
validation loss is over every held-out sequence.

"Within noise" is judged against the seed-to-seed spread of the same
strategy: gap = |mean hetero - mean ddp|, noise = the largest difference
between two seeds of one strategy.  Last line:
``RESULT hetero_val_loss=... ddp_val_loss=... rel_gap=... seed_noise=...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _het_train import describe, run_het_train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=44)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--model", nargs="*", default=["model.num_layers=2", "model.hidden_size=64", "model.seq_len=64"])
    args = ap.parse_args()
    common = ["cluster=local_cpu4_mixed", f"train.max_steps={args.steps}", f"train.global_batch_size={args.batch}",
              f"train.val_every_n_steps={args.steps}", "train.val_batches=1", *args.model]
    losses: dict[str, list[float]] = {"hetero": [], "ddp": []}
    with tempfile.TemporaryDirectory(prefix="dp_convergence_") as tmp:
        for seed in args.seeds:
            for strategy in ("hetero", "ddp"):
                summary = run_het_train([*common, f"strategy={strategy}", f"train.seed={seed}"],
                                        Path(tmp) / f"{strategy}-{seed}")
                losses[strategy].append(summary["final_val_loss"])
                print(f"  seed {seed}: " + describe(summary), flush=True)
    het, ddp = statistics.fmean(losses["hetero"]), statistics.fmean(losses["ddp"])
    noise = max(max(v) - min(v) for v in losses.values())
    gap = abs(het - ddp)
    print(f"{args.steps} steps, global batch {args.batch}, seeds {args.seeds}, {' '.join(args.model)}")
    print(f"  final validation loss: hetero {losses['hetero']} (mean {het:.4f}), ddp {losses['ddp']} "
          f"(mean {ddp:.4f})")
    print(f"  gap {gap:.4f} ({100 * gap / ddp:.2f}% of ddp's); seed-to-seed noise {noise:.4f} -> "
          f"{'within' if gap <= noise else 'OUTSIDE'} noise")
    print(f"RESULT hetero_val_loss={het:.4f} ddp_val_loss={ddp:.4f} rel_gap={gap / ddp:.4f} seed_noise={noise:.4f}")


if __name__ == "__main__":
    main()
