"""The workers ``benchmarks/elastic.py`` starts under torchrun's elastic agent, one per agent (benchmarks' helper).

``python _elastic_workers.py hetero|hetero_deepspeed OUT MAX_STEPS``: the char GPT (``MODEL``) on ``SAMPLES``
sequences of the standard library's source, global batches of ``BATCH``, SGD with momentum, a checkpoint every
``EVERY`` steps into OUT/ckpt and a final one on SIGTERM (``PreemptionCheckpoint``, exit 143), resuming from the
newest one there at every (re)start.  The device is the agent's ``HET_STRATEGY_DEVICE``.  Rank 0 of every worker
group broadcasts a token naming the group; each training step appends a row to OUT/steps.jsonl (the group, the
step, the epoch, the world, the device and the ids of the samples trained there).  At the end rank 0 (``hetero``)
or every rank (``hetero_deepspeed``, each its stage's layers) writes its parameters to OUT/final*.json.

- ``hetero``: ``local_cpu4_mixed`` (emulated speeds 1, 1, 0.5, 0.25), float64, asynchronous checkpoints; every
  rank logs the ids of its own share (the dataset returns them beside each sample).
- ``hetero_deepspeed``: ``DS_CLUSTER``, four CPU devices that each hold about half the model (memory), planned
  at every (re)start for the devices present at tp 1 (two 2-stage pipelines on four, one 3-stage pipeline on
  three), fp32, DeepSpeed's synchronous checkpoint directories.  Every rank loads the whole global batch as
  ``(inputs, labels)``, so the ids are read back from the inputs (``corpus_dataset`` keeps distinct ones) and
  rank 0 logs them.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MODEL = dict(num_layers=4, hidden_size=128, num_heads=4, seq_len=32)
SAMPLES, BATCH, EVERY = 400, 16, 10
DS_CLUSTER = {"name": "four", "nodes": [{"name": "local", "intra_bandwidth_gbs": 1, "devices": [
    {"name": f"rank{i}", "type": "CPU", "tflops": {"fp32": 0.02}, "memory_gb": 0.02} for i in range(4)]}]}
"""Four CPU devices of 20 MB: the char GPT's 0.86M parameters (24 bytes each with SGD's state and DeepSpeed's
copies) do not fit one of them, so the planner splits it into stages."""


def optimizer(params: Any) -> Any:
    """SGD with momentum: Adam would turn the last bit of a near-zero gradient (one sum order against another)
    into a whole step, and the comparison with one process would measure that, not the bookkeeping.  At lr 0.1
    the run is chaotic: one process in fp32 ends 6e-4 away from one in float64 after 40 steps (measured), so an
    fp32 runtime could not be compared with one process; at 0.02 they stay within 1e-6."""
    import torch

    return torch.optim.SGD(params, lr=0.02, momentum=0.9)


def corpus_dataset() -> Any:
    """``SAMPLES`` distinct sequences of the char dataset, the first ones in its order, as ``(inputs, labels)``
    (distinct, so a sample's id can be read back from its inputs)."""
    from torch.utils.data import Subset

    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus

    data = CharDataset(stdlib_corpus(max_bytes=400_000).train, MODEL["seq_len"])
    first: dict[bytes, int] = {}
    for i in range(len(data)):
        first.setdefault(data[i][0].numpy().tobytes(), i)
        if len(first) == SAMPLES:
            return Subset(data, list(first.values()))
    raise SystemExit(f"the corpus holds {len(first)} distinct sequences, fewer than {SAMPLES}")


def _log_step(out: Path, group: str, trainer: Any, ids: list[int]) -> None:
    row = {"t": time.time(), "group": group, "step": trainer.global_step, "epoch": trainer.current_epoch,
           "world": trainer.world_size, "device": os.environ["HET_STRATEGY_DEVICE"], "ids": ids}
    with open(out / "steps.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _callbacks(out: Path) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from het_strategy.callbacks.preemption import PreemptionCheckpoint

    return [ModelCheckpoint(dirpath=str(out / "ckpt"), filename="step_{step}", auto_insert_metric_name=False,
                            every_n_train_steps=EVERY, save_top_k=-1),
            PreemptionCheckpoint(out / "ckpt", "step_{step}.ckpt", exit_code=143)]


def hetero_worker(out: Path, max_steps: int) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader, Dataset

    from het_strategy import HeteroStrategy
    from het_strategy.core.shipped import config_file
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.strategy.elastic import latest_checkpoint

    class Numbered(Dataset):
        def __init__(self) -> None:
            self.data = corpus_dataset()

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> Any:
            x, y = self.data[i]
            return x, y, i

    class Logged(CharGPT):
        group = ""

        def on_train_start(self) -> None:
            self.group = self.trainer.strategy.broadcast(f"{os.getpid()}-{time.time()}")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y, ids = batch
            loss = super().training_step((x, y), batch_idx)
            _log_step(out, self.group, self.trainer, ids.tolist()[:self.trainer.strategy.run.current_local_samples])
            return loss

        def configure_optimizers(self) -> Any:
            return optimizer(self.parameters())

        def on_train_end(self) -> None:
            if self.global_rank == 0:
                params = {n: p.detach().flatten().tolist() for n, p in self.named_parameters()}
                (out / "final.json").write_text(json.dumps(params))

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Logged(**MODEL).double()  # Lightning restores a checkpoint before it converts the module to 64-bit
    strategy = HeteroStrategy(cluster=config_file("cluster", "local_cpu4_mixed"), global_batch_size=BATCH,
                              verbose=False, heartbeat_timeout_s=5, timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                         precision="64-true", max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, plugins=[AsyncCheckpointIO()],
                         callbacks=_callbacks(out))
    resume = latest_checkpoint(out / "ckpt")
    trainer.fit(model, DataLoader(Numbered(), batch_size=4, shuffle=True),
                ckpt_path=None if resume is None else str(resume))


def deepspeed_worker(out: Path, max_steps: int) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from het_strategy import HeteroDeepSpeedStrategy
    from het_strategy.core.workload import TransformerConfig, transformer_workload
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.strategy.elastic import latest_checkpoint

    data = corpus_dataset()
    ids_of = {data[i][0].numpy().tobytes(): i for i in range(SAMPLES)}

    class Logged(CharGPT):
        group = ""

        def on_train_start(self) -> None:
            self.group = self.trainer.strategy.broadcast(f"{os.getpid()}-{time.time()}")
            if self.global_rank == 0:
                plan = self.trainer.strategy.plan
                shape = " + ".join(" -> ".join(f"{s.devices[0]}{list(s.layers)}" for s in pipe.stages)
                                   for pipe in plan.pipelines)
                with open(out / "plans.jsonl", "a") as fh:
                    fh.write(json.dumps({"group": self.group, "world": self.trainer.world_size,
                                         "step": self.trainer.global_step, "plan": shape}) + "\n")

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.global_rank == 0:
                _log_step(out, self.group, self.trainer, [ids_of[x.numpy().tobytes()] for x in batch[0]])

        def configure_optimizers(self) -> Any:
            return optimizer(self.parameters())

        def on_train_end(self) -> None:
            params = {n: p.flatten().tolist() for n, p in self.trainer.strategy.run.runner.named_parameters().items()}
            (out / f"final{self.global_rank}.json").write_text(json.dumps(params))

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Logged(**MODEL)
    workload = transformer_workload(TransformerConfig(name="char_gpt", vocab_size=256, **MODEL), "fp32")
    strategy = HeteroDeepSpeedStrategy(cluster=DS_CLUSTER, workload=workload, global_batch_size=BATCH, max_tp=1,
                                       heartbeat_timeout_s=5, timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]), strategy=strategy,
                         max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=_callbacks(out))
    resume = latest_checkpoint(out / "ckpt")
    trainer.fit(model, DataLoader(data, batch_size=BATCH, shuffle=True),
                ckpt_path=None if resume is None else str(resume))


if __name__ == "__main__":
    kind, folder, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    (hetero_worker if kind == "hetero" else deepspeed_worker)(folder, steps)
