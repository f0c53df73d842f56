"""Compression through the hetero strategy on CPU/gloo (Lightning's fork launcher): the hook really is
registered (DDP's own logging data names it), it compresses, and its state travels in Lightning checkpoints."""

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from het_strategy import HeteroStrategy  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("fresh_master_port"),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")]

CLUSTER = {"name": "two_cpus", "inter_node_bandwidth_gbs": 10,
           "nodes": [{"name": "local", "devices": [{"name": f"r{i}", "type": "CPU"} for i in range(2)]}]}


class _Probe(pl.LightningModule):
    """A regression net with one compressible layer (64 x 32 = 2048 weights); records what the hook did."""

    def __init__(self, out_dir: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.out_dir = out_dir

    def on_train_start(self) -> None:
        state = self.trainer.strategy.run.compression_state
        self.restored = {k: float(v.norm()) for k, v in state.residuals.items()}

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        state = strategy.run.compression_state
        info = {"comm_hook": strategy.model._get_ddp_logging_data().get("comm_hook"),
                "step": state.step, "bytes_sent": state.bytes_sent, "wire_ratio": state.wire_ratio,
                "residuals": sorted(state.residuals), "restored": self.restored}
        (Path(self.out_dir) / f"rank{self.global_rank}.json").write_text(json.dumps(info))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(64, 32, generator=g), torch.randn(64, generator=g))


def _fit(root: Path, out: Path, max_steps: int, ckpt_path: str | None = None, callbacks=()) -> None:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster=CLUSTER, compression={"method": "q4", "warmup_steps": 1},
                              start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=max_steps, default_root_dir=str(root),
                         callbacks=list(callbacks))
    trainer.fit(_Probe(str(out)), DataLoader(_data(), batch_size=8), ckpt_path=ckpt_path)


def test_hetero_registers_compression_on_cpu_and_checkpoints_its_state(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    _fit(tmp_path / "a", first, max_steps=3, callbacks=[ckpt])
    for rank in range(2):
        info = json.loads((first / f"rank{rank}.json").read_text())
        assert "compression_hook" in info["comm_hook"]  # DDP's logging data: our hook, on a CPU/gloo model
        assert info["step"] == 3 and info["wire_ratio"] > 1.5
        assert info["residuals"] == ["module.net.0.weight"]  # only the 2-D layer with >= 1024 elements

    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)["het_strategy"]["compression"]["ranks"]
    assert len(saved) == 2  # error feedback is per rank: every rank's state, gathered into rank 0's file
    assert all(r["step"] == 3 and set(r["residuals"]) == {"module.net.0.weight"} for r in saved)
    norms = [float(r["residuals"]["module.net.0.weight"].norm()) for r in saved]
    assert norms[0] != norms[1]

    _fit(tmp_path / "b", second, max_steps=5, ckpt_path=str(path))
    for rank in range(2):
        info = json.loads((second / f"rank{rank}.json").read_text())
        assert info["step"] == 5  # counting on from the checkpoint's 3, not from 0
        assert info["restored"]["module.net.0.weight"] == pytest.approx(norms[rank], rel=1e-6)  # its own


TWO_NODES = {"name": "two_nodes", "inter_node_bandwidth_gbs": 0.0125,
             "nodes": [{"name": f"node{n}", "devices": [{"name": f"n{n}r{i}", "type": "CPU"} for i in range(2)]}
                       for n in range(2)]}


class _ParamProbe(_Probe):
    def on_train_end(self) -> None:
        super().on_train_end()
        path = Path(self.out_dir) / f"rank{self.global_rank}.json"
        info = json.loads(path.read_text())
        info["params"] = [float(p.double().sum()) for p in self.parameters()]
        info["hook"] = type(self.trainer.strategy.run.comm.run.hook_state).__name__
        path.write_text(json.dumps(info))


def test_inter_node_scope_compresses_only_the_leaders_exchange(tmp_path: Path) -> None:
    """compression.scope=inter_node on 2 nodes x 2 ranks: the hierarchical hook is registered; only each node's
    first rank sends compressed bytes to the other node; every rank ends with the same parameters."""
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster=TWO_NODES, compression={"method": "q4", "warmup_steps": 1,
                                                              "scope": "inter_node"},
                              start_method="fork", verbose=False, timeout=__import__("datetime").timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, max_steps=3,
                         default_root_dir=str(tmp_path))
    trainer.fit(_ParamProbe(str(tmp_path)), DataLoader(_data(), batch_size=4))
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["hook"] == "HierarchicalState" for r in rows)
    assert all(r["params"] == rows[0]["params"] for r in rows)  # bitwise the same model everywhere
    assert rows[0]["step"] == rows[2]["step"] == 3 and rows[0]["wire_ratio"] > 1.5  # the leaders compressed
    assert rows[1]["bytes_sent"] == rows[3]["bytes_sent"] == 0  # the others never crossed a node


def test_inter_node_scope_needs_equal_nodes() -> None:
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.errors import ConfigError
    from het_strategy.strategy.compression_run import ranks_per_node

    uneven = {**TWO_NODES, "nodes": [TWO_NODES["nodes"][0], {"name": "node1", "devices": [{"name": "x",
                                                                                         "type": "CPU"}]}]}
    assert ranks_per_node(load_cluster(TWO_NODES), 4) == 2
    with pytest.raises(ConfigError, match="compression.scope.*equal size.*\\[2, 1\\]"):
        ranks_per_node(load_cluster(uneven), 3)
