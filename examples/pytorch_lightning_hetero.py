"""The ``pytorch_lightning`` flavour: the same ``strategy="hetero"`` in the other Lightning package.

``lightning.pytorch`` and ``pytorch_lightning`` are separate packages with
separate strategy registries; ``import het_strategy`` registers ``"hetero"``
in both (whichever is imported first), built on each package's own
``DDPStrategy`` (``het_strategy.HeteroStrategyPL`` here).  Two CPU processes
play the shipped ``local_cpu2`` cluster (speeds 1 and 0.5), a logistic
regression on a small 10-class image set (examples/_digits.py), and the shares follow the speeds.  For a
model this small the strategy notes that its costs are a rough estimate (no
workload given) and warns that the cluster's emulated time is far below the
real compute (local_cpu2 is sized for the char GPT): both are the strategy's
checks at work.

Run (from the repository root)::

    .venv/bin/python examples/pytorch_lightning_hetero.py
    .venv/bin/python examples/pytorch_lightning_hetero.py --epochs 1
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from _digits import flat_digits  # examples/_digits.py
from _run import QUIET_RUN, epochs_parser  # examples/_run.py
import het_strategy


class Digits(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 10)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self.linear(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        self.log("val_acc", (self.linear(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main() -> None:
    args = epochs_parser(__doc__, epochs=3).parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, val = flat_digits()
    strategy = het_strategy.HeteroStrategyPL(cluster="local_cpu2")
    assert isinstance(strategy, pl.strategies.DDPStrategy)  # this package's own DDPStrategy
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs, **QUIET_RUN)
    model = Digits()
    trainer.fit(model, DataLoader(train, batch_size=24, shuffle=True), DataLoader(val, batch_size=24))
    result = trainer.validate(model, DataLoader(val, batch_size=24), verbose=False)
    if trainer.global_rank == 0:
        print(f"pytorch_lightning {pl.__version__}: shares per rank {strategy.run.current_shares()}; "
              f"final validation accuracy {result[0]['val_acc']:.3f}")


if __name__ == "__main__":
    main()
