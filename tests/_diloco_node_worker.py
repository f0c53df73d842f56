"""One rank of the hetero_diloco namespace test: ``python _diloco_node_worker.py OUT_DIR``.

Two emulated nodes of one CPU device each (``run_script_ranks(..., nodes=...)``); a 262,656-parameter MLP
trains 8 steps with ``HeteroDiLoCoStrategy`` (H = 4, q8), so two outer steps cross the link and no gradient
does.  Rank 0 writes ``OUT_DIR/result.json`` (the parameter count and the bytes rank 0 sent per round).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from het_strategy import HeteroDiLoCoStrategy

CLUSTER = {"name": "two_nodes", "inter_node_bandwidth_gbs": 0.0125, "nodes": [
    {"name": "a", "devices": [{"name": "a0", "type": "CPU", "tflops": {"fp32": 1.0}}]},
    {"name": "b", "devices": [{"name": "b0", "type": "CPU", "tflops": {"fp32": 1.0}}]}]}


class Wide(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Tanh(),
                                       torch.nn.Linear(512, 1, bias=False))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return (self.net(x).squeeze(-1) - y).pow(2).mean()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 512, generator=g), torch.randn(64, generator=g))
    strategy = HeteroDiLoCoStrategy(cluster=CLUSTER, inner_steps=4, outer_codec="q8", verbose=False,
                                    global_batch_size=8, heartbeat_timeout_s=None, timeout=timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy=strategy, max_steps=8, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Wide()
    trainer.fit(model, DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        records = strategy.run.extension.outer.records
        (out / "result.json").write_text(json.dumps({
            "params": sum(p.numel() for p in model.parameters()), "rounds": len(records),
            "bytes_sent": [r.bytes_sent for r in records]}))
    torch.distributed.barrier()  # both ranks end together, their gloo pairs closed in order
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
