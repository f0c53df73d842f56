"""A model too big for the small device, trained on a mixed cluster with ``strategy=HeteroFSDPStrategy(...)``.

Three CPU processes play devices of speeds 1, 1, 0.5 and memories 48, 32 and 10 MiB (emulated).  The char GPT
(4 blocks, h 128: 0.87 M parameters) needs 13.2 MiB for its parameters, gradients and AdamW state alone, more than
the small device holds, so ``hetero`` (a whole replica per rank) cannot run it there, nor can even sharding with
the activations on top.  ``hetero_fsdp`` plans each rank's shard of every block from its free memory and its share
of every batch from its speed; each rank keeps only its shard, gathering one block at a time.

The emulated memory is enforced: a callback counts what each rank holds (``emulation.memory_cap.MemoryMeter``:
shards, gradients, optimizer state, gathered blocks, saved activations) and raises an emulated out-of-memory error
above the device's memory.  The example prints the plan, each rank's counted peak against its memory, and the
loss.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/fsdp_unequal_memory.py               # 12 steps
    .venv/bin/python examples/fsdp_unequal_memory.py --steps 4     # quicker
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from _run import QUIET_RUN  # examples/_run.py
import het_strategy  # noqa: F401  (registers strategy="hetero_fsdp")
from het_strategy import HeteroFSDPStrategy
from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.workload import transformer_workload
from het_strategy.demo.char_gpt import CharGPT
from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
from het_strategy.emulation.memory_cap import MemoryMeter, format_bytes

MIB = 2**20 / 2**30  # GiB per MiB
CLUSTER = {"name": "mixed_memory", "inter_node_bandwidth_gbs": 1, "nodes": [{"name": "local", "intra_bandwidth_gbs": 1,
           "devices": [{"name": name, "type": "CPU", "tflops": {"fp32": 0.005}, "efficiency": 1.0,
                        "emulated_speed": speed, "memory_gb": mib * MIB}
                       for name, speed, mib in (("big", 1.0, 48), ("mid", 1.0, 32), ("small", 0.5, 10))]}]}
"""Speeds 1, 1, 0.5; memories 48, 32, 10 MiB (emulated: each rank's compute padded, its memory counted)."""
GLOBAL_BATCH = 12


class EmulatedMemory(pl.Callback):
    """Counts each rank's bytes on its emulated device from the start of training (``MemoryMeter``, capped at the
    device's ``memory_gb``): the saved activations of every training batch, the shards, their gradients, AdamW's
    state and the gathered blocks."""

    def __init__(self) -> None:
        self.meter: MemoryMeter | None = None
        self._tracking = contextlib.ExitStack()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        device = CLUSTER["nodes"][0]["devices"][rank]["name"]
        self.meter = MemoryMeter.for_device(cluster_from_dict(CLUSTER), device, rank,
                                            sharded=trainer.strategy.run.extension.sharded,
                                            optimizer=trainer.optimizers[0])

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._tracking.enter_context(self.meter.track())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._tracking.close()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's peak, printed by rank 0 with the plan."""
        meter = self.meter
        every: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(every, (trainer.global_rank, meter.device, meter.peak_bytes, meter.cap_bytes))
        if trainer.global_rank != 0:
            return
        plan = trainer.strategy.plan
        shares = {p.stages[0].devices[0]: p.samples for p in plan.pipelines}
        params = sum(u.numel for u in trainer.strategy.run.extension.sharded.units)
        # whole: fp32 values, their gradients and AdamW's two moments, 16 bytes a parameter
        print(f"char GPT: {params / 1e6:.2f} M parameters; whole, with gradients and AdamW state: "
              f"{format_bytes(params * 16)}, more than the small device's {format_bytes(every[-1][3])}")
        for rank, device, peak, cap in every:
            print(f"  rank {rank} {device:<6} shard {plan.shards[device]:.3f} of every block, {shares[device]} of "
                  f"{GLOBAL_BATCH} samples a step; counted peak {format_bytes(peak)} of its {format_bytes(cap)}")
        print(f"trained {trainer.global_step} steps with hetero_fsdp; last train loss "
              f"{float(trainer.callback_metrics['train_loss']):.3f} (ln 256 = 5.545 at the start)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = CharGPT(num_layers=4, hidden_size=128, num_heads=4, seq_len=64, lr=3e-3)
    corpus = stdlib_corpus(max_bytes=300_000)
    train = DataLoader(CharDataset(corpus.train, seq_len=64), batch_size=GLOBAL_BATCH // 3, shuffle=True)
    memory = EmulatedMemory()
    # workload=: the model's analytic costs (its activations too), so the shards are planned from free memory
    strategy = HeteroFSDPStrategy(cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, start_method="fork",
                                  workload=transformer_workload(model.workload_config(), dtype="fp32"),
                                  timeout=datetime.timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, max_steps=args.steps, callbacks=[memory],
                         num_sanity_val_steps=0, limit_val_batches=0, **QUIET_RUN)
    trainer.fit(model, train)


if __name__ == "__main__":
    main()
