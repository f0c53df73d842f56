"""A model of your own with a ``HeteroMoE`` layer: experts placed unevenly by device speed.

An MLP with one mixture-of-experts layer (12 experts, top-2) classifies
a small 10-class image set (examples/_digits.py) on the shipped ``local_cpu4_moe`` cluster: four CPU
processes playing devices of speeds 1, 1, 0.5 and 0.5.  The ``hetero``
strategy places the experts 4 / 4 / 2 / 2 (``moe_placement="planned"``, the
default; ``--uniform`` for 3 per rank), keeps them out of DDP's allreduce,
splits every batch by speed, and pads each rank's experts to its emulated
device inside the layer.  The placement is printed with the plan.

Run (from the repository root)::

    .venv/bin/python examples/moe_uneven_experts.py
    .venv/bin/python examples/moe_uneven_experts.py --uniform --epochs 1
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from _digits import flat_digits  # examples/_digits.py
from _run import QUIET_RUN, epochs_parser  # examples/_run.py
from het_strategy import HeteroStrategy
from het_strategy.moe import HeteroMoE


class DigitsMoE(pl.LightningModule):
    def __init__(self, hidden: int = 32, experts: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(64, hidden)
        self.moe = HeteroMoE(hidden, lambda: nn.Sequential(nn.Linear(hidden, 128), nn.GELU(), nn.Linear(128, hidden)),
                             num_experts=experts, k=2, capacity_factor=1.25, min_capacity=0)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.inp(x))
        out, aux_loss, _ = self.moe(h)
        return self.head(h + out), aux_loss

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        logits, aux = self(x)
        loss = F.cross_entropy(logits, y) + 0.01 * aux
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self(x)[0].argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main() -> None:
    ap = epochs_parser(__doc__, epochs=2)
    ap.add_argument("--uniform", action="store_true", help="3 experts per rank instead of the planned 4/4/2/2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, val = flat_digits()
    strategy = HeteroStrategy(cluster="local_cpu4_moe", moe_placement="uniform" if args.uniform else "planned")
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=args.epochs, **QUIET_RUN)
    model = DigitsMoE()
    trainer.fit(model, DataLoader(train, batch_size=12, shuffle=True), DataLoader(val, batch_size=12))
    result = trainer.validate(model, DataLoader(val, batch_size=12), verbose=False)
    if trainer.global_rank == 0:
        counts = strategy.run.experts.placements[0].counts
        print(f"experts per rank {counts}; shares per rank {strategy.run.current_shares()}; "
              f"final validation accuracy {result[0]['val_acc']:.3f}")


if __name__ == "__main__":
    main()
