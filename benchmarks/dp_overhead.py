"""The cost of the hetero machinery where there is nothing to balance: hetero vs plain ``ddp`` on equal devices.

Runs of the main job (``het-train``), alternating hetero / ddp for ``--rounds``
rounds, same model, global batch, steps and seed:

* on the emulated ``local_cpu4_equal`` cluster (4 processes, all at speed 1,
  compute padded to the emulated device): the figure the issue asks for;
* on the same 4 processes without emulation (real compute only, a smaller
  model), where the per-step work of the strategy — its batch sampler, loss
  weighting, timed comm hook, weighted logging — is a larger part of a step.

overhead = median hetero step time / median ddp step time - 1 (a fraction;
negative when hetero was faster).  Per-step times on this shared 2-core
machine vary 20-30%, so each run's figure is a mean over its steps after
warm-up and the rounds alternate.  Last line: ``RESULT overhead=... overhead_real=...``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from _het_train import describe, run_het_train

from het_strategy.core.cluster import load_cluster


def _overhead(common: list[str], rounds: int, tmp: Path, label: str) -> float:
    times: dict[str, list[float]] = {"hetero": [], "ddp": []}
    for r in range(rounds):
        for strategy in ("hetero", "ddp") if r % 2 == 0 else ("ddp", "hetero"):
            summary = run_het_train([*common, f"strategy={strategy}"], tmp / f"{label}-{strategy}-{r}")
            times[strategy].append(summary["step_s"])
            print(f"  {label} round {r}: " + describe(summary), flush=True)
    het, ddp = statistics.median(times["hetero"]), statistics.median(times["ddp"])
    print(f"  {label}: median step hetero {het:.4f} s, ddp {ddp:.4f} s -> overhead {het / ddp - 1:+.4f}")
    return het / ddp - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--real-steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=44)
    args = ap.parse_args()
    val = ["train.val_batches=1"]
    with tempfile.TemporaryDirectory(prefix="dp_overhead_") as tmp_name:
        tmp = Path(tmp_name)
        print(f"emulated local_cpu4_equal, global batch {args.batch}, {args.steps} steps per run:")
        emulated = _overhead(["cluster=local_cpu4_equal", f"train.max_steps={args.steps}",
                              f"train.val_every_n_steps={args.steps}", f"train.global_batch_size={args.batch}", *val],
                             args.rounds, tmp, "emulated")
        plain = tmp / "cpu4_real.yaml"
        plain.write_text(yaml.safe_dump(load_cluster("local_cpu4_equal").without_emulation().to_dict()))
        print(f"real compute (no emulation), 2-block GPT, global batch {args.batch}, {args.real_steps} steps per run:")
        real = _overhead([f"cluster={plain}", f"train.max_steps={args.real_steps}",
                          f"train.val_every_n_steps={args.real_steps}", f"train.global_batch_size={args.batch}",
                          "model.num_layers=2", "model.hidden_size=64", "model.seq_len=64", *val],
                         args.rounds, tmp, "real")
    print(f"RESULT overhead={emulated:.4f} overhead_real={real:.4f}")


if __name__ == "__main__":
    main()
