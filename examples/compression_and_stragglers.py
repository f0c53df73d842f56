"""Your own LightningModule with gradient compression and straggler mitigation, on your own cluster YAML.

The CNN of examples/own_model_hetero.py on three CPU processes of speeds 1, 0.5, 0.5, one of which
(``slow_b``) becomes 3x slower from step 20 (``examples/clusters/three_cpus_slowdown.yaml``).  Two additions
to the plain ``strategy="hetero"`` run:

- ``compression={"method": "q4"}``: after 5 uncompressed warm-up steps every large
  gradient (here the 10 240-weight head) crosses the wire in 4 bits with error feedback; the strategy
  registers the comm hook on CPU/gloo too;
- ``rebalance=StragglerMitigation()``: every 2 steps the ranks exchange their per-sample compute times; when
  ``slow_b`` has been slower for 4 consecutive steps, the shares are re-planned from the measured speeds and
  switched at a step boundary, the update staying exact.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/compression_and_stragglers.py                # 2 epochs
    .venv/bin/python examples/compression_and_stragglers.py --epochs 1     # quicker

It prints the shares before and after the rebalance, the decision's reason, the wire saving and the final
validation accuracy (measured with ``--epochs 1``: the rebalance after step 24, shares [24, 12, 12] ->
[29, 14, 5], "slow_b (rank2) per-sample compute 2.50 -> 7.50 ms (+200%)"; 3.5x fewer gradient bytes over
the epoch, warm-up and the uncompressed small tensors included; accuracy 0.967).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

import het_strategy  # noqa: F401  (registers strategy="hetero")
from het_strategy import HeteroStrategy
from het_strategy.callbacks.straggler import StragglerMitigation
from _run import QUIET_RUN, epochs_parser  # examples/_run.py
from own_model_hetero import DigitsCNN, datasets  # examples/own_model_hetero.py

CLUSTER = Path(__file__).parent / "clusters" / "three_cpus_slowdown.yaml"


def main() -> None:
    args = epochs_parser(__doc__, epochs=2).parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, val = datasets()
    straggler = StragglerMitigation(verbose=False)
    strategy = HeteroStrategy(cluster=str(CLUSTER), compression={"method": "q4", "warmup_steps": 5},
                              rebalance=straggler)
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_epochs=args.epochs, **QUIET_RUN)
    model = DigitsCNN()
    first_shares = None

    class FirstShares(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            nonlocal first_shares
            first_shares = strategy.run.current_shares()

    trainer.callbacks.append(FirstShares())
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16))
    result = trainer.validate(model, DataLoader(val, batch_size=16), verbose=False)
    if trainer.global_rank == 0:
        for d in straggler.decisions:
            print(f"after step {d.step}: {d.action} {d.shares_before} -> {d.shares_after}: {d.reason}")
        print(f"shares {first_shares} -> {strategy.run.current_shares()}; {len(straggler.decisions)} decision(s); "
              f"gradients {strategy.run.compression_state.wire_ratio:.1f}x fewer bytes on the wire; "
              f"final validation accuracy {result[0]['val_acc']:.3f}")


if __name__ == "__main__":
    main()
