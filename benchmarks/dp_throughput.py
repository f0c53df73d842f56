"""Uneven data parallelism (``hetero``) vs plain Lightning ``ddp`` on the emulated local_cpu4_mixed cluster.

Both runs are the main job (``het-train``: char GPT on the standard library's
source) with the same model, global batch, steps and seed, one after the other
in this script.  The cluster's four CPU processes play devices of relative
speeds 1, 1, 0.5, 0.25 (each batch's compute padded to the emulated device's
time; gloo collectives are real).  ``ddp`` splits the batch evenly, so every
step waits for the 0.25 device; ``hetero`` plans shares by speed.

ideal = sum of speeds / (world x slowest speed) = 2.75 when compute is all
that counts.  ratio = hetero samples/s / ddp samples/s (means over the steps
after warm-up).  Last line: ``RESULT ratio=... ideal=... hetero_sps=... ddp_sps=...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cluster", default="local_cpu4_mixed")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=44, help="global batch (44 = 4 x 11: both splits are whole)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    speeds = [d.emulated_speed or 1.0 for d in load_cluster(args.cluster).devices]
    ideal = sum(speeds) / (len(speeds) * min(speeds))
    common = [f"cluster={args.cluster}", f"train.max_steps={args.steps}", f"train.global_batch_size={args.batch}",
              f"train.seed={args.seed}", f"train.val_every_n_steps={args.steps}", "train.val_batches=1"]
    with tempfile.TemporaryDirectory(prefix="dp_throughput_") as tmp:
        results = {s: run_het_train([*common, f"strategy={s}"], Path(tmp) / s) for s in ("hetero", "ddp")}
    het, ddp = results["hetero"], results["ddp"]
    m = het["model"]
    print(f"cluster {args.cluster} (speeds {speeds}), global batch {args.batch}, {args.steps} steps, "
          f"model {m['name']} ({m['num_layers']} blocks, hidden {m['hidden_size']}, seq {m['seq_len']})")
    for r in (het, ddp):
        print("  " + describe(r))
    print(f"  hetero shares {het['shares']}; cost model predicted speed-up over an equal split "
          f"{het['predicted_speedup_vs_equal']:.3f}")
    ratio = het["samples_per_s"] / ddp["samples_per_s"]
    print(f"  ratio {ratio:.3f} of ideal {ideal:.3f} ({100 * ratio / ideal:.1f}%); "
          f"val loss hetero {het['final_val_loss']:.4f} vs ddp {ddp['final_val_loss']:.4f}")
    print(f"RESULT ratio={ratio:.3f} ideal={ideal:.3f} hetero_sps={het['samples_per_s']:.2f} "
          f"ddp_sps={ddp['samples_per_s']:.2f}")


if __name__ == "__main__":
    main()
