"""Your own LightningModule on your own cluster YAML with ``strategy="hetero"``.

A small CNN classifies a small 10-class image set (examples/_digits.py) on three CPU processes that play
devices of speeds 1, 0.5, 0.5 (``examples/clusters/three_cpus.yaml``).  The
strategy plans how many samples of every global batch each rank takes (here
24 / 12 / 12 of 48), rebuilds the DataLoader so every sample is used once per
epoch, and weights each rank's loss so the update equals the single-process
one.  Nothing in the module knows about any of it.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/own_model_hetero.py                 # 2 epochs
    .venv/bin/python examples/own_model_hetero.py --epochs 1      # quicker

It prints the plan and the final validation accuracy (0.96 after 2 epochs, measured).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _digits import digits  # examples/_digits.py
from _run import QUIET_RUN, epochs_parser  # examples/_run.py
import het_strategy  # noqa: F401  (registers strategy="hetero")
from het_strategy import HeteroStrategy

CLUSTER = Path(__file__).parent / "clusters" / "three_cpus.yaml"


class DigitsCNN(pl.LightningModule):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.conv(x).flatten(1))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def datasets() -> tuple[TensorDataset, TensorDataset]:
    x, y = digits()
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(y), generator=g)
    train, val = order[:1500], order[1500:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


def main() -> None:
    args = epochs_parser(__doc__, epochs=2).parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, val = datasets()
    # batch_size is per rank, as in plain DDP: the global batch is 16 x 3 = 48, which the strategy splits by speed
    strategy = HeteroStrategy(cluster=str(CLUSTER))
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_epochs=args.epochs, **QUIET_RUN)
    model = DigitsCNN()
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16))
    result = trainer.validate(model, DataLoader(val, batch_size=16), verbose=False)
    if trainer.global_rank == 0:
        print(f"shares per rank: {strategy.run.current_shares()}; final validation accuracy {result[0]['val_acc']:.3f}")


if __name__ == "__main__":
    main()
