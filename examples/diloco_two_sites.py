"""Your own LightningModule across two sites joined by a slow link, with ``strategy="hetero_diloco"``.

The small CNN of ``own_model_hetero.py`` trains on four CPU processes split over two sites
(``examples/clusters/two_sites.yaml``: two devices of speed 1 at ``lab``, two of speed 0.5 at ``cloud``,
10 Mbit/s between them).  Each site is a group that trains on its own, its gradients all-reduced inside the
site only; every H steps the sites exchange their pseudo-gradients (in the planned codec, with error feedback)
and take an outer Nesterov step.  The planner chooses H and the codec from the devices, the declared link and
the quality budget (here at most 8 inner steps per outer step), and gives the faster site more samples per
step so neither waits.  Validation sees the outer (global) parameters.  Nothing in the module changes.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/diloco_two_sites.py                 # 2 epochs
    .venv/bin/python examples/diloco_two_sites.py --epochs 1      # quicker

It prints the plan's choice, the outer steps taken and the final validation accuracy (0.94 after 2 epochs,
measured).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from _run import QUIET_RUN, epochs_parser  # examples/_run.py
from own_model_hetero import DigitsCNN, datasets  # examples/own_model_hetero.py
import het_strategy  # noqa: F401  (registers strategy="hetero_diloco")
from het_strategy import HeteroDiLoCoStrategy

CLUSTER = Path(__file__).parent / "clusters" / "two_sites.yaml"


def main() -> None:
    args = epochs_parser(__doc__, epochs=2).parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    train, val = datasets()
    # one group per site; H and the outer codec planned within the budget (pin them with inner_steps= and
    # outer_codec=); the inner optimizer is the module's own Adam, the outer one Nesterov SGD (lr 0.7, momentum 0.9)
    strategy = HeteroDiLoCoStrategy(cluster=str(CLUSTER), max_inner_steps=8, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_epochs=args.epochs, **QUIET_RUN)
    model = DigitsCNN()
    trainer.fit(model, DataLoader(train, batch_size=16, shuffle=True), DataLoader(val, batch_size=16))
    result = trainer.validate(model, DataLoader(val, batch_size=16), verbose=False)
    if trainer.global_rank == 0:
        sync = strategy.plan.outer_sync
        last = strategy.run.extension.outer.records[-1]
        print(f"groups {[list(g) for g in sync.groups]}, shares per rank {strategy.run.current_shares()}, an outer step "
              f"every {sync.inner_steps} inner steps in {sync.codec}: {strategy.run.extension.outer.rounds} outer steps, "
              f"{last.bytes_sent} bytes sent per group in the last; final validation accuracy "
              f"{result[0]['val_acc']:.3f}")


if __name__ == "__main__":
    main()
