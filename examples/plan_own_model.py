"""Plan your own nn.Module with ``het-plan``, then train with that plan on your own cluster.

Two steps, as you would run them by hand:

1. ``het-plan`` profiles the model this file's ``make_model`` builds (FLOPs,
   parameters and activation bytes per block, counted by torch) and plans the
   uneven data-parallel split on ``examples/clusters/three_cpus.yaml`` (three
   CPU processes playing devices of relative speeds 1, 0.5, 0.5)::

       het-plan model=examples/plan_own_model.py:make_model model_input.shape=[16,1,8,8] \\
           cluster=examples/clusters/three_cpus.yaml planner.mode=dp settings.global_batch_size=48 \\
           settings.dtype=fp32 output.dir=runs/own_plan

   It prints the plan table and writes ``runs/own_plan/plan.json`` and
   ``runs/own_plan/plan.model.json`` (the profiled workload the plan was made for).

2. ``Trainer(strategy=HeteroStrategy(cluster=..., plan="runs/own_plan/plan.json",
   workload=...))`` trains with exactly that plan on three CPU ranks; the strategy
   checks the plan against the cluster, the model and the global batch first.

This script does both (small settings; from the repository root, after
``bash scripts/setup.sh``)::

    .venv/bin/python examples/plan_own_model.py                  # 1 epoch
    .venv/bin/python examples/plan_own_model.py --epochs 2

It prints the planned shares, the shares the run used and the final validation accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

from _run import QUIET_RUN, epochs_parser  # examples/_run.py

HERE = Path(__file__).resolve().parent
CLUSTER = HERE / "clusters" / "three_cpus.yaml"
_PLAN_DIR_ENV = "HET_EXAMPLE_PLAN_DIR"
GLOBAL_BATCH = 48  # 16 per rank as a plain DDP DataLoader would take it; the plan splits it by speed


def make_model() -> nn.Module:
    """The user's own model: what ``model=examples/plan_own_model.py:make_model`` names."""
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 8 * 8, 10))


def het_plan(out_dir: Path) -> None:
    """Step 1, as a command: het-plan on the model above (the same as the ``het-plan`` console script)."""
    cmd = [sys.executable, "-m", "het_strategy.cli.plan_cli", f"model={Path(__file__).resolve()}:make_model",
           "model_input.shape=[16,1,8,8]", "model_input.dtype=float32", f"cluster={CLUSTER}", "planner.mode=dp",
           f"settings.global_batch_size={GLOBAL_BATCH}", "settings.dtype=fp32", f"output.dir={out_dir}"]
    subprocess.run(cmd, check=True)


def train(plan_dir: Path, epochs: int) -> None:
    """Step 2: the plan file handed to the strategy, on three CPU ranks."""
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from _digits import digits  # examples/_digits.py
    from het_strategy import HeteroStrategy
    from het_strategy.profiling.model_factory import load_profile_file

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return F.cross_entropy(self(x), y)

        def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.Adam(self.parameters(), lr=3e-3)

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    x, y = digits()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train_set, val_set = TensorDataset(x[order[:1500]], y[order[:1500]]), TensorDataset(x[order[1500:]], y[order[1500:]])
    # the workload the plan was made for (het-plan wrote it next to the plan): the strategy checks the plan against it
    workload = load_profile_file(plan_dir / "plan.model.json").workload
    strategy = HeteroStrategy(cluster=str(CLUSTER), plan=str(plan_dir / "plan.json"), workload=workload)
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_epochs=epochs, **QUIET_RUN)
    model = Classifier()
    per_rank = GLOBAL_BATCH // 3
    trainer.fit(model, DataLoader(train_set, batch_size=per_rank, shuffle=True), DataLoader(val_set, batch_size=per_rank))
    result = trainer.validate(model, DataLoader(val_set, batch_size=per_rank), verbose=False)
    if trainer.global_rank == 0:
        print(f"trained with shares {strategy.run.current_shares()}; final validation accuracy {result[0]['val_acc']:.3f}")


def main() -> None:
    ap = epochs_parser(__doc__, epochs=1, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-dir", type=Path, default=None, help="where het-plan writes (default: a temporary folder)")
    args = ap.parse_args()
    # Lightning starts ranks 1 and 2 by running this script again: they find the plan rank 0 made in the environment
    made_here = _PLAN_DIR_ENV not in os.environ
    plan_dir = Path(os.environ.get(_PLAN_DIR_ENV) or args.plan_dir or tempfile.mkdtemp(prefix="own_plan_"))
    if made_here:
        het_plan(plan_dir)
        shares = json.loads((plan_dir / "plan.json").read_text())["rank_shares"]
        print(f"planned shares {shares}")
        os.environ[_PLAN_DIR_ENV] = str(plan_dir)
    try:
        train(plan_dir, args.epochs)
    finally:
        if made_here and args.plan_dir is None:
            shutil.rmtree(plan_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
