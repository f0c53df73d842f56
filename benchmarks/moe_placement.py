"""Planned (uneven) expert placement vs uniform placement, HeteroMoE under the ``hetero`` strategy.

Three runs of the main job (``het-train model=moe_gpt_tiny cluster=local_cpu4_moe``),
one after the other in this script: 4 emulated CPU ranks of speeds (1, 1,
0.5, 0.5); a char GPT whose every 2nd block is 12 top-2 experts of width 2048
(experts about 85% of the FLOPs):

* ``planned``  ``moe.placement=planned``: 4 / 4 / 2 / 2 experts (by device speed);
* ``uniform``  ``moe.placement=uniform``: 3 per rank (DeepSpeed's only option);
* ``uniform, seed 1``: the same with another ``train.seed``, for the seed noise.

Same tokens and steps in the first two (same seed; expert e starts from the
same weights wherever it lives).  In all three the dense part is balanced by
the uneven data split (shares 8/8/4/4 of 24); each rank's experts are padded
to its emulated device inside the MoE layer, so a slow rank holding 3 experts
holds up every rank at the combine all-to-all.

ideal = (max_r uniform experts_r / speed_r) / (max_r planned experts_r / speed_r)
= 1.5 for expert-bound compute.  ratio = planned samples/s / uniform samples/s
(means over the steps after warm-up).  expert share = rank 0's time inside
the MoE layers per step / step time (planned run).  loss_gap = |planned -
uniform| final validation loss; seed_noise = |uniform - uniform seed 1|.
Last line: ``RESULT ratio=... ideal=... loss_gap=... seed_noise=... expert_share=...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cluster", default="local_cpu4_moe")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=24, help="global batch (24: shares 8/8/4/4 exactly)")
    args = ap.parse_args()
    speeds = [d.emulated_speed or 1.0 for d in load_cluster(args.cluster).devices]
    common = ["model=moe_gpt_tiny", f"cluster={args.cluster}", f"train.max_steps={args.steps}",
              f"train.global_batch_size={args.batch}", f"train.val_every_n_steps={args.steps}",
              "train.val_batches=1", "data.max_bytes=600000"]
    runs = {"planned": ["moe.placement=planned", "train.seed=0"], "uniform": ["moe.placement=uniform", "train.seed=0"],
            "uniform_seed1": ["moe.placement=uniform", "train.seed=1"]}
    with tempfile.TemporaryDirectory(prefix="moe_placement_") as tmp:
        results = {name: run_het_train([*common, *extra], Path(tmp) / name) for name, extra in runs.items()}
    planned, uniform, noise_run = results["planned"], results["uniform"], results["uniform_seed1"]

    def bound(counts: list[int]) -> float:
        return max(n / s for n, s in zip(counts, speeds))

    ideal = bound(uniform["experts_per_rank"][0]) / bound(planned["experts_per_rank"][0])
    print(f"cluster {args.cluster} (speeds {speeds}), model moe_gpt_tiny, global batch {args.batch}, "
          f"{args.steps} steps, shares {planned['shares']}")
    for name, r in results.items():
        share = r["moe_s_per_batch"] / r["step_s"]
        print(f"  {name:<14} experts per rank {r['experts_per_rank'][0]}  " + describe(r)
              + f"; time in MoE layers {share:.0%} of the step (rank 0)")
    ratio = planned["samples_per_s"] / uniform["samples_per_s"]
    gap = abs(planned["final_val_loss"] - uniform["final_val_loss"])
    noise = abs(uniform["final_val_loss"] - noise_run["final_val_loss"])
    expert_share = planned["moe_s_per_batch"] / planned["step_s"]
    print(f"  planned / uniform throughput {ratio:.3f} of ideal {ideal:.3f} ({100 * ratio / ideal:.1f}%); "
          f"val loss gap {gap:.6f} (seed noise {noise:.4f})")
    print(f"RESULT ratio={ratio:.3f} ideal={ideal:.3f} loss_gap={gap:.6f} seed_noise={noise:.4f} "
          f"expert_share={expert_share:.2f}")


if __name__ == "__main__":
    main()
