"""Your own model as a DeepSpeed pipeline over unequal devices (``HeteroDeepSpeedStrategy``).

An MLP of 8 blocks classifies a small 10-class image set (examples/_digits.py) as a two-stage pipeline
on two CPU processes that play a fast device and one at 0.4 of its speed
(``examples/clusters/fast_and_slow.yaml``).  The model's costs come from ``profile_module`` (FLOPs,
parameters and activation bytes per block, counted on one sample batch); rank 0 plans with them
(``planner_mode="pipeline"``), so the fast device gets more blocks than the slow one, and DeepSpeed's
own pipeline engine runs the plan.  The LightningModule gives its blocks (``pipeline_layers``) and a
loss (``pipeline_loss``); the strategy makes the steps.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/pipeline_deepspeed.py                # 2 epochs
    .venv/bin/python examples/pipeline_deepspeed.py --epochs 1     # quicker

It prints the planned stages (measured: blocks 0-4 on the fast device, 5-7 on the slow one) and the
validation loss after each epoch (1.80 after 1 epoch, from 2.30 at chance).
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
from het_strategy import HeteroDeepSpeedStrategy
from het_strategy.profiling.module_profile import profile_module

CLUSTER = Path(__file__).parent / "clusters" / "fast_and_slow.yaml"
GLOBAL_BATCH = 48
WIDTH = 128


def build_blocks() -> list[nn.Module]:
    """The whole model as an ordered list of blocks: the pipeline cuts between them."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Flatten(), nn.Linear(64, WIDTH), nn.ReLU())
    middle = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(6)]
    return [first, *middle, nn.Linear(WIDTH, 10)]


class PipelinedMLP(pl.LightningModule):
    def __init__(self, lr: float = 2e-3) -> None:
        super().__init__()
        self.lr = lr
        self.blocks = nn.ModuleList(build_blocks())

    def pipeline_layers(self) -> list[nn.Module]:
        return list(self.blocks)

    def pipeline_loss(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(outputs, labels)

    def training_step(self, batch, batch_idx):  # Lightning requires it; the strategy runs the step itself
        raise AssertionError("not called under hetero_deepspeed")

    def validation_step(self, batch, batch_idx):  # turns Lightning's validation loop on; not called either
        raise AssertionError("not called under hetero_deepspeed")

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def main() -> None:
    args = epochs_parser(__doc__.split("\n")[0], epochs=2).parse_args()
    torch.set_num_threads(1)

    images, labels = digits(n=1200)
    train, val = TensorDataset(images[:960], labels[:960]), TensorDataset(images[960:], labels[960:])
    # the planner's costs of *this* model: one LayerCost per block, counted on a micro-batch-sized sample
    workload = profile_module(nn.Sequential(*build_blocks()), images[:8], name="pipelined_mlp").workload
    strategy = HeteroDeepSpeedStrategy(cluster=str(CLUSTER), workload=workload, global_batch_size=GLOBAL_BATCH,
                                       planner_mode="pipeline")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=args.epochs,
                         num_sanity_val_steps=0, callbacks=[EpochLoss()], **QUIET_RUN)
    # the strategy's loaders: the whole global batch on every rank (each cuts out its own micro-batches)
    trainer.fit(PipelinedMLP(), DataLoader(train, batch_size=GLOBAL_BATCH, drop_last=True),
                DataLoader(val, batch_size=GLOBAL_BATCH, drop_last=True))
    if trainer.global_rank == 0:
        plan = strategy.plan
        stages = [f"{'+'.join(stage.devices)} blocks {stage.layers[0]}-{stage.layers[1] - 1}"
                  for pipe in plan.pipelines for stage in pipe.stages]
        print(f"planned stages: {'; '.join(stages)}; micro-batch {plan.pipelines[0].micro_batch_size}; "
              f"predicted {plan.predicted['step_time_s'] * 1e3:.0f} ms/step; last train loss "
              f"{strategy.run.last_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
