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
        state = self.trainer.strategy.compression_state
        self.restored = {k: float(v.norm()) for k, v in state.residuals.items()}

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def on_train_end(self) -> None:
        strategy = self.trainer.strategy
        state = strategy.compression_state
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
    strategy = HeteroStrategy(cluster=CLUSTER, compression={"method": "quantize", "bits": 4, "warmup_steps": 1},
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
