"""The Lightning data-loading cases the compatibility tests run under ``ddp`` and under ``hetero``.

Each case is a module (and its loaders) that records, per rank and step, the sample indices it trained on and
its batch shapes, and at the end its parameters; ``run_case`` fits it on 2 CPU ranks (Lightning's fork launcher)
and returns every rank's record.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Subset

from tests._strategy_worker import IndexedData, make_net

N = 32
"""Samples of every case's dataset (a multiple of the global batch: DDP's sampler then repeats none)."""

FAST_SLOW_CLUSTER = {"name": "fast_slow", "inter_node_bandwidth_gbs": 10,
                     "nodes": [{"name": "local", "devices": [
                         {"name": "fast", "type": "CPU", "tflops": {"fp32": 3.0}},
                         {"name": "slow", "type": "CPU", "tflops": {"fp32": 1.0}}]}]}
"""Speeds 3 : 1: the planned shares of a global batch of 8 are 6 and 2."""

EQUAL_CLUSTER = {"name": "two_equal", "inter_node_bandwidth_gbs": 10,
                 "nodes": [{"name": "local", "devices": [{"name": f"cpu{i}", "type": "CPU", "tflops": {"fp32": 1.0}}
                                                         for i in range(2)]}]}


class TaggedLoader(DataLoader):
    """A DataLoader subclass with an argument and a method of its own."""

    def __init__(self, dataset: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag

    def describe(self) -> str:
        return f"tagged:{self.tag}"


class FeatureLoader(DataLoader):
    """A DataLoader subclass with a required argument it only checks and never stores (Lightning rebuilds such a
    class from the arguments it recorded)."""

    def __init__(self, dataset: Any, num_features: int, **kwargs: Any) -> None:
        if num_features != 4:
            raise ValueError(f"num_features {num_features}")
        super().__init__(dataset, **kwargs)


class LengthBuckets(BatchSampler):
    """A bucketing batch sampler: each batch's indices ordered by a (fake) sequence length, longest first."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        for batch in super().__iter__():
            yield sorted(batch, key=lambda i: (-(i % 5), i))


class FixedFour(BatchSampler):
    """A batch sampler whose class fixes its batch size at 4 (it takes no batch_size argument)."""

    def __init__(self, sampler: Any, drop_last: bool = False) -> None:
        super().__init__(sampler, 4, drop_last)


def _parts(batch: Any) -> list[Any]:
    """The (x, y, index) batches in ``batch`` (a combined loader's dict or list of them; None: exhausted)."""
    parts = list(batch.values()) if isinstance(batch, dict) else (
        list(batch) if isinstance(batch, (list, tuple)) and isinstance(batch[0], (list, tuple, type(None)))
        else [batch])
    return [p for p in parts if p is not None]


def _indices(batch: Any) -> list[int]:
    return [i for part in _parts(batch) for i in part[2].tolist()]


def _xy(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    parts = _parts(batch)
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


EVAL_CASES = ("val_shuffle", "val_overfit", "combined_sequential", "combined_eval_max_size_cycle",
              "combined_eval_max_size", "combined_eval_min_size", "subclass_unstored", "uneven_val")
"""The cases that also record their evaluation (samplers, samples per rank, synced metrics) and run
``trainer.test`` after ``fit``."""


def sampler_attributes(loader: Any) -> dict[str, Any]:
    """What a user reads of a loader's sampler (the batch sampler's sampler for a custom batch sampler)."""
    sampler = loader.sampler
    inner = getattr(loader.batch_sampler, "sampler", None)
    if type(loader.batch_sampler) is not BatchSampler and inner is not None:
        sampler = inner
    return {"class": type(sampler).__name__, **{name: getattr(sampler, name, None)
                                                for name in ("shuffle", "seed", "num_replicas", "rank",
                                                             "drop_last")}}


def _eval_loaders(loaders: Any) -> list[Any]:
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]


def _combined(pl: Any, mode: str) -> Any:
    """A ``CombinedLoader`` over two loaders of different sizes (each sample carries its index)."""
    package = __import__("lightning.pytorch" if pl.__name__.startswith("lightning") else "pytorch_lightning",
                         fromlist=["utilities"])
    loaders = {"a": DataLoader(IndexedData(N), batch_size=4), "b": DataLoader(IndexedData(N // 2, seed=1),
                                                                              batch_size=2)}
    return package.utilities.CombinedLoader(loaders, mode)


def make_module(case: str, out_dir: str, pl: Any) -> Any:
    """The case's LightningModule on ``pl`` (``lightning.pytorch`` or ``pytorch_lightning``)."""
    class Recorded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()
            self.rows: list[dict[str, Any]] = []
            self.val_rows: list[dict[str, Any]] = []
            self.info: dict[str, Any] = {}

        def training_step(self, batch: Any, batch_idx: int, *rest: Any) -> torch.Tensor:
            x, y = _xy(batch)
            self.rows.append({"epoch": self.current_epoch, "step": batch_idx, "indices": _indices(batch),
                              "shape": list(x.shape)})
            return (self.net(x).squeeze(-1) - y).pow(2).mean()

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.05)
            if case != "one_cycle":
                return opt
            total = self.trainer.estimated_stepping_batches
            self.info["estimated_in_configure_optimizers"] = total
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=int(total))
            return [opt], [{"scheduler": sched, "interval": "step"}]

        def train_dataloader(self) -> Any:
            data = IndexedData(N)
            if case == "own_shards":
                r = self.global_rank
                return DataLoader(Subset(data, list(range(r * N // 2, (r + 1) * N // 2))), batch_size=4)
            if case == "uneven_shards":  # rank 0: 4 batches, rank 1: 2
                return DataLoader(Subset(data, list(range(16 if self.global_rank == 0 else 8))), batch_size=4)
            if case == "planned_shards":  # the user shards by the plan: rank r gets its share of every step
                share = self.trainer.strategy.planned_batch_size(8)
                shares = self.trainer.strategy.run.current_shares()
                start = 4 * sum(shares[:self.global_rank])
                self.info["planned_batch_size"] = share
                return DataLoader(Subset(data, list(range(start, start + 4 * share))), batch_size=share)
            if case == "subclass":
                return TaggedLoader(data, tag="mine", batch_size=4)
            if case == "subclass_unstored":
                return FeatureLoader(data, 4, batch_size=4)
            if case == "bucketing":
                return DataLoader(data, batch_sampler=LengthBuckets(torch.utils.data.SequentialSampler(data), 4,
                                                                    drop_last=False))
            if case == "fixed_size":
                return DataLoader(data, batch_sampler=FixedFour(torch.utils.data.SequentialSampler(data)))
            if case in ("combined_max_size_cycle", "combined_max_size"):
                return _combined(pl, case.removeprefix("combined_"))
            return DataLoader(data, batch_size=4)

        def val_dataloader(self) -> Any:
            if case == "combined_sequential":
                return _combined(pl, "sequential")
            if case.startswith("combined_eval_"):
                return _combined(pl, case.removeprefix("combined_eval_"))
            if case in ("val_shuffle", "val_overfit"):
                return DataLoader(IndexedData(N, seed=2), batch_size=4, shuffle=True)
            if case == "subclass_unstored":
                return FeatureLoader(IndexedData(N, seed=2), 4, batch_size=4)
            if case == "uneven_val":
                return DataLoader(IndexedData(N, seed=2), batch_size=4)
            return []

        def test_dataloader(self) -> Any:
            return self.val_dataloader()

        def _eval_step(self, stage: str, batch: Any, batch_idx: int, dataloader_idx: int) -> None:
            x, y = _xy(batch)
            loss = (self.net(x).squeeze(-1) - y).pow(2).mean()
            self.log(f"{stage}_loss", loss, sync_dist=True, batch_size=len(y))
            self.val_rows.append({"stage": stage, "epoch": self.current_epoch, "loader": dataloader_idx,
                                  "step": batch_idx, "indices": _indices(batch), "shape": list(x.shape)})

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self._eval_step("val", batch, batch_idx, dataloader_idx)

        def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self._eval_step("test", batch, batch_idx, dataloader_idx)

        def _eval_end(self, stage: str, loaders: Any) -> None:
            metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith(stage)}
            self.info.setdefault(f"{stage}_metrics", []).append(metrics)
            self.info[f"{stage}_samplers"] = [sampler_attributes(dl) for dl in _eval_loaders(loaders)]

        def on_validation_epoch_end(self) -> None:
            self._eval_end("val", self.trainer.val_dataloaders)

        def on_test_epoch_end(self) -> None:
            self._eval_end("test", self.trainer.test_dataloaders)
            self._write("test")

        def on_train_start(self) -> None:
            loader = self.trainer.train_dataloader
            self.info["loader_class"] = type(loader).__name__
            self.info["describe"] = loader.describe() if isinstance(loader, TaggedLoader) else None

        def on_train_end(self) -> None:
            self._write("rank")

        def _write(self, prefix: str) -> None:
            """``rank<r>.json`` after fit; ``test<r>.json`` after ``trainer.test`` (its own launch of the ranks)."""
            params = [p.detach().flatten().tolist() for p in self.net.parameters()]
            out = {"rows": self.rows, "val_rows": self.val_rows, "params": params, "info": self.info}
            Path(out_dir, f"{prefix}{self.global_rank}.json").write_text(json.dumps(out))

    return Recorded()


def make_datamodule(pl: Any) -> Any:
    class IndexedDataModule(pl.LightningDataModule):
        def setup(self, stage: str) -> None:
            self.data = IndexedData(N)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=4)

    return IndexedDataModule()


def run_case(case: str, strategy: str, out: Path, package: str = "lightning",
             cluster: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Fit ``case`` under ``strategy`` ("ddp" or "hetero") on 2 CPU ranks; every rank's record."""
    import importlib

    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    import het_strategy

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=120)
    if strategy == "hetero":
        cls = het_strategy.HeteroStrategy if package == "lightning" else het_strategy.HeteroStrategyPL
        chosen = cls(cluster=cluster or EQUAL_CLUSTER, start_method="fork", verbose=False, telemetry=False,
                     timeout=timeout)
    else:
        chosen = pl.strategies.DDPStrategy(start_method="fork", timeout=timeout)
    kwargs: dict[str, Any] = dict(accelerator="cpu", devices=2, strategy=chosen, precision="64-true", max_epochs=2,
                                  logger=False, enable_progress_bar=False, enable_model_summary=False,
                                  enable_checkpointing=False, num_sanity_val_steps=0)
    if case in ("own_shards", "planned_shards", "uneven_shards"):
        kwargs["use_distributed_sampler"] = False
    if case in ("overfit_batches", "val_overfit"):
        kwargs["overfit_batches"] = 2
    if case == "limit_train_batches":
        kwargs["limit_train_batches"] = 3
    trainer = pl.Trainer(default_root_dir=str(out), **kwargs)
    out.mkdir(parents=True, exist_ok=True)
    module = make_module(case, str(out), pl)
    datamodule = make_datamodule(pl) if case == "datamodule" else None
    trainer.fit(module, datamodule=datamodule)
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    if case in EVAL_CASES:
        trainer.test(module, verbose=False)
        for r, record in enumerate(records):
            record["test"] = json.loads((out / f"test{r}.json").read_text())
    return records
