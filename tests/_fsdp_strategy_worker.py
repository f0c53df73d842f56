"""A ``hetero_fsdp`` fit on forked CPU ranks (Lightning's fork launcher) that records what each rank trained on
and, at the end, the whole model gathered (``HeteroFSDPStrategy.full_state_dict``)."""

from __future__ import annotations

import datetime
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from tests._strategy_worker import IndexedData, make_net

N = 50
"""Samples of the training set: 5 global batches of 10."""

GLOBAL_BATCH = 10

MIXED_CLUSTER = {"name": "mem_4_2_1", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": "big", "type": "CPU", "tflops": {"fp32": 2.0}, "memory_gb": 4},
    {"name": "mid", "type": "CPU", "tflops": {"fp32": 2.0}, "memory_gb": 2},
    {"name": "small", "type": "CPU", "tflops": {"fp32": 1.0}, "memory_gb": 1}]}]}
"""Memories 4 : 2 : 1 and speeds 1 : 1 : 0.5: shards 4/7, 2/7, 1/7 and shares 4, 4, 2 of a global batch of 10."""

TWO_CLUSTER = {"name": "two_equal", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": f"cpu{i}", "type": "CPU", "tflops": {"fp32": 1.0}, "memory_gb": 2} for i in range(2)]}]}


def make_module(pl: Any, out_dir: str, save_to: Path | None = None) -> Any:
    class Recorded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.rows: list[dict[str, Any]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, idx = batch
            self.rows.append({"step": self.global_step, "indices": idx.tolist()})
            return (self.net(x).squeeze(-1) - y).pow(2).mean()

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y, _ = batch
            self.log("val_loss", (self.net(x).squeeze(-1) - y).pow(2).mean(), sync_dist=True, batch_size=len(y))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(IndexedData(N), batch_size=GLOBAL_BATCH // 2)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(IndexedData(12, seed=3), batch_size=2)

        def on_train_end(self) -> None:
            strategy = self.trainer.strategy
            if save_to is not None:
                self.trainer.save_checkpoint(str(save_to))  # every rank: its chunks
            full = strategy.full_state_dict()  # a collective: every rank
            record = {"rows": self.rows, "shards": strategy.plan.shards,
                      "shares": [p.samples for p in strategy.plan.pipelines],
                      "val_loss": float(self.trainer.callback_metrics.get("val_loss", float("nan"))),
                      "own_elements": sum(p.numel() for p in self.parameters())}
            if self.global_rank == 0:
                record["full"] = {k: v.flatten().tolist() for k, v in full.items()}
            Path(out_dir, f"rank{self.global_rank}.json").write_text(json.dumps(record))

    return Recorded()


def _trainer(out: Path, package: str, cluster: dict[str, Any] | None, **kwargs: Any) -> tuple[Any, Any, int]:
    """(the Lightning package, a quiet float64 Trainer of ``HeteroFSDPStrategy`` on as many forked CPU ranks as
    ``cluster`` has devices, that world size); ``kwargs`` go to the Trainer."""
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    import het_strategy

    torch.set_num_threads(1)
    cluster = cluster or MIXED_CLUSTER
    world = sum(len(node["devices"]) for node in cluster["nodes"])
    cls = het_strategy.HeteroFSDPStrategy if package == "lightning" else het_strategy.HeteroFSDPStrategyPL
    strategy = cls(cluster=cluster, global_batch_size=GLOBAL_BATCH, start_method="fork", verbose=False,
                   telemetry=False, timeout=datetime.timedelta(seconds=120))
    out.mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, precision="64-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         limit_val_batches=3, default_root_dir=str(out), **kwargs)
    return pl, trainer, world


def fit(out: Path, package: str = "lightning", cluster: dict[str, Any] | None = None, max_steps: int = 5,
        save_to: Path | None = None, resume_from: Path | None = None) -> list[dict[str, Any]]:
    """Fit on as many ranks as ``cluster`` has devices; every rank's record (``full``: rank 0's)."""
    pl, trainer, world = _trainer(out, package, cluster, max_steps=max_steps, num_sanity_val_steps=0,
                                  val_check_interval=max_steps)
    module = make_module(pl, str(out), save_to)
    trainer.fit(module, ckpt_path=None if resume_from is None else str(resume_from))
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    ranks[0]["main_state"] = {k: v.flatten().tolist() for k, v in module.state_dict().items()}  # handed back
    return ranks


def validate(out: Path, state: dict[str, list[float]], package: str = "lightning",
             cluster: dict[str, Any] | None = None, ckpt_path: Path | None = None) -> float:
    """``trainer.validate`` of a fresh module holding ``state`` (or the checkpoint's, with ``ckpt_path``): the
    synced validation loss."""
    pl, trainer, _ = _trainer(out, package, cluster)
    module = make_module(pl, str(out))
    module.load_state_dict({k: torch.tensor(v, dtype=torch.float64).view_as(p) for (k, v), p in
                            zip(state.items(), module.state_dict().values())})
    results = trainer.validate(module, ckpt_path=None if ckpt_path is None else str(ckpt_path), verbose=False)
    return float(results[0]["val_loss"])
