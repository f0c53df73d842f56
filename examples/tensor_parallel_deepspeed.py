"""Your own blocks split over two devices (tensor parallelism in ``HeteroDeepSpeedStrategy``).

A residual MLP classifies a small 10-class image set (examples/_digits.py) on one pipeline stage split over
two CPU processes (``examples/clusters/two_equal.yaml``): each rank holds half of every block's two linears
and computes half of every block, as Megatron-LM splits a transformer's MLP.  What the model gives is one
method per block, ``tensor_parallel_plan()``: its first linear splits by output columns (``Colwise``), its
second by input rows (``Rowwise``, whose partial outputs the ranks all-reduce).  The first and last layers have
no plan and run whole on both ranks.  The plan here is written by hand (one stage of both devices at tp 2);
``HeteroDeepSpeedStrategy(max_tp=...)`` lets the planner choose tensor parallelism where it pays instead.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/tensor_parallel_deepspeed.py                # 2 epochs
    .venv/bin/python examples/tensor_parallel_deepspeed.py --epochs 1     # quicker

It prints each rank's share of a block (half its hidden width: fc1 weight (128, 64) of (256, 64)) and the
validation loss after each epoch (0.28 after 1 epoch, from 2.30 at chance).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator on import

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from _digits import digits  # examples/_digits.py
from _epoch_loss import EpochLoss  # examples/_epoch_loss.py
from _run import QUIET_RUN, epochs_parser  # examples/_run.py
import het_strategy  # noqa: F401  (registers strategy="hetero_deepspeed")
from het_strategy import Colwise, HeteroDeepSpeedStrategy, Rowwise, TensorParallelPlan
from het_strategy.core.plan import Pipeline, Plan, Stage

CLUSTER = Path(__file__).parent / "clusters" / "two_equal.yaml"
GLOBAL_BATCH = 48
WIDTH = 64
BLOCKS = 4


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): the MLP half of a transformer block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """fc1 by output columns, fc2 by input rows: each rank runs its half of the hidden width."""
        return TensorParallelPlan(linears={"fc1": Colwise(), "fc2": Rowwise()})


def build_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    first = nn.Sequential(nn.Flatten(), nn.Linear(64, WIDTH))
    return [first, *[Block(WIDTH) for _ in range(BLOCKS)], nn.Linear(WIDTH, 10)]


class SplitMLP(pl.LightningModule):
    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.layers = nn.ModuleList(build_layers())

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.layers)

    def pipeline_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels)

    def training_step(self, batch, batch_idx):  # Lightning requires it; the strategy runs the step itself
        raise AssertionError("not called under hetero_deepspeed")

    def validation_step(self, batch, batch_idx):  # turns Lightning's validation loop on; not called either
        raise AssertionError("not called under hetero_deepspeed")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def tp_plan() -> Plan:
    """One stage of both devices at tp 2 holding every layer, the global batch in micro-batches of 12."""
    num_layers = len(build_layers())
    return Plan(cluster="two_equal", cluster_devices=("left", "right"),
                model={"name": "split_mlp", "num_layers": num_layers}, global_batch_size=GLOBAL_BATCH,
                dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline((Stage(("left", "right"), (0, num_layers)),), micro_batch_size=12,
                                    samples=GLOBAL_BATCH),))


def main() -> None:
    args = epochs_parser(__doc__.split("\n")[0], epochs=2).parse_args()
    torch.set_num_threads(1)

    images, labels = digits(n=1200)
    train, val = TensorDataset(images[:960], labels[:960]), TensorDataset(images[960:], labels[960:])
    strategy = HeteroDeepSpeedStrategy(cluster=str(CLUSTER), plan=tp_plan())
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.epochs,
                         num_sanity_val_steps=0, callbacks=[EpochLoss()], **QUIET_RUN)
    trainer.fit(SplitMLP(), DataLoader(train, batch_size=GLOBAL_BATCH, drop_last=True),
                DataLoader(val, batch_size=GLOBAL_BATCH, drop_last=True))
    shard = strategy.run.runner.named_parameters()["1.fc1.weight"]  # layer 1: the first block
    print(f"rank {trainer.global_rank}: block fc1 weight {tuple(shard.shape)} of {(4 * WIDTH, WIDTH)}; last train "
          f"loss {strategy.run.last_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
