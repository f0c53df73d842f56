"""Shared pieces of the multi-process strategy tests: a float64 model that records what each rank saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset


class IndexedData(Dataset):
    """Regression data whose items carry their own index, so tests can see which rank used which sample."""

    def __init__(self, n: int, dim: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):  # type: ignore[no-untyped-def]
        return self.x[i], self.y[i], i


def float64_trainer(tmp: Path, strategy: Any, devices: int = 3, **kwargs: Any) -> pl.Trainer:
    """A quiet float64 Trainer on ``devices`` CPU ranks (no logger, checkpoints or sanity check unless given)."""
    torch.set_num_threads(1)
    defaults = dict(accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", logger=False,
                    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                    num_sanity_val_steps=0)
    defaults.update(kwargs)
    return pl.Trainer(default_root_dir=str(tmp), **defaults)


def rank_rows(out: Path, ranks: int) -> list[list[dict]]:
    """Every rank's rows as ``Recorder`` wrote them, in rank order."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


def make_net(dim: int = 4) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(dim, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


class Recorder(pl.LightningModule):
    """Records (epoch, batch, indices, counted samples, weighted mean loss) per training batch, per rank."""

    def __init__(self, out_dir: str, lr: float = 0.1, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.net = make_net().to(dtype)
        self.out_dir = out_dir
        self.lr = lr
        self.rows: list[dict] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y, idx = batch
        x, y = x.to(self.net[0].weight.dtype), y.to(self.net[0].weight.dtype)
        loss = (self.net(x).squeeze(-1) - y).pow(2).mean()
        strategy = self.trainer.strategy
        counted = getattr(strategy.run, "current_local_samples", None)
        synced = strategy.reduce(loss.detach().clone(), reduce_op="mean")
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True, batch_size=len(y))
        logged = self.trainer.callback_metrics.get("train_loss_step")  # what self.log just synced
        self.rows.append({"epoch": self.current_epoch, "batch": batch_idx, "indices": idx.tolist(),
                          "logged": None if logged is None else float(logged),
                          "counted": counted, "synced_loss": float(synced), "local_loss": float(loss)})
        return loss

    def validation_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y, _ = batch
        x, y = x.to(self.net[0].weight.dtype), y.to(self.net[0].weight.dtype)
        self.log("val_loss", (self.net(x).squeeze(-1) - y).pow(2).mean(), sync_dist=True, batch_size=len(y))

    def on_train_end(self) -> None:
        path = Path(self.out_dir) / f"rank{self.global_rank}.json"
        existing = json.loads(path.read_text()) if path.exists() else []
        path.write_text(json.dumps(existing + self.rows))
        strategy = self.trainer.strategy
        plan = getattr(strategy, "plan", None)
        if plan is not None:
            profile = getattr(strategy.run, "profile", None)
            (Path(self.out_dir) / f"strategy{self.global_rank}.json").write_text(json.dumps({
                "plan": plan.to_dict(), "profiled_types": sorted(t for t, _ in profile.times) if profile else [],
                "workload_layers": [layer.name for layer in strategy.run.workload.layers]}))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
