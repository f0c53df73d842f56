"""HeteroMoE under the hetero strategy (3 gloo ranks, Lightning's fork launcher): planned uneven experts, uneven
shares, token dropping — every parameter equals a single-process reference holding every expert."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from het_strategy import HeteroStrategy  # noqa: E402
from het_strategy.moe import HeteroMoE  # noqa: E402
from tests._strategy_worker import IndexedData  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("fresh_master_port"),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")]

CLUSTER = {"name": "three_speeds", "inter_node_bandwidth_gbs": 10,
           "nodes": [{"name": "local", "devices": [{"name": n, "type": "CPU", "tflops": {"fp32": t}} for n, t in
                                                   (("fast", 5.0), ("mid", 2.0), ("slow", 1.0))]}]}
EXPERTS, AUX = 6, 0.05


class _MoENet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.inp = torch.nn.Linear(4, 8)
        self.moe = HeteroMoE(8, lambda: torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(),
                                                            torch.nn.Linear(12, 8)),
                             num_experts=EXPERTS, k=2, capacity_factor=0.75, min_capacity=0, expert_seed=11)
        self.out = torch.nn.Linear(8, 1)
        self.double()

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, aux, _ = self.moe(torch.tanh(self.inp(x)))
        return (self.out(h).squeeze(-1) - y).pow(2).mean() + AUX * aux


class _Module(pl.LightningModule):
    def __init__(self, out_dir: str) -> None:
        super().__init__()
        self.net, self.out_dir, self.rows = _MoENet(), out_dir, []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y, idx = batch
        self.rows.append({"batch": batch_idx, "indices": idx.tolist()})
        return self.net.loss(x, y)

    def on_train_end(self) -> None:
        # every rank saves (a collective: each rank's experts are gathered into rank 0's file)
        self.trainer.save_checkpoint(str(Path(self.out_dir) / "moe.ckpt"))
        strategy = self.trainer.strategy
        experts = {e: [p.detach().tolist() for p in self.net.moe.experts[str(e)].parameters()]
                   for e in self.net.moe.local_experts}
        dense = {n: p.detach().tolist() for n, p in self.net.named_parameters() if ".experts." not in n}
        (Path(self.out_dir) / f"rank{self.global_rank}.json").write_text(json.dumps({
            "rows": self.rows, "experts": experts, "dense": dense, "plan_experts": strategy.plan.to_dict()["experts"],
            "counts": [p.counts for p in strategy.run.experts.placements]}))

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_planned_uneven_experts_train_exactly_and_checkpoints_hold_every_expert(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    data = IndexedData(48)  # 3 global batches of 16, split 10 / 4 / 2 by speed
    module = _Module(str(tmp_path))
    strategy = HeteroStrategy(cluster=CLUSTER, global_batch_size=16, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, precision="64-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         max_epochs=1, default_root_dir=str(tmp_path))
    trainer.fit(module, DataLoader(data, batch_size=5, shuffle=True))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]

    counts = ranks[0]["counts"][0]
    assert counts != [2, 2, 2] and sorted(counts, reverse=True) == counts and sum(counts) == EXPERTS
    assert ranks[0]["plan_experts"] == {"1": {"fast": list(range(counts[0])),
                                              "mid": list(range(counts[0], counts[0] + counts[1])),
                                              "slow": list(range(counts[0] + counts[1], EXPERTS))}}

    # Reference: one process, every expert; each step = sum over ranks of (n_r / N) x rank r's loss on its own
    # samples (its own capacity, so the same choices are dropped).
    ref = _MoENet()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        parts = [r["rows"][step]["indices"] for r in ranks]
        assert [len(p) for p in parts] == [10, 4, 2]
        for indices in parts:
            (ref.loss(data.x[indices], data.y[indices]) * len(indices) / 16).backward()
        opt.step()
    for r in ranks:
        for name, value in r["dense"].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64),
                                       dict(ref.named_parameters())[name].detach(), rtol=0, atol=1e-12, msg=name)
        for e, params in r["experts"].items():
            for got, want in zip(params, ref.moe.experts[e].parameters()):
                torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want.detach(), rtol=0, atol=1e-12)

    state = torch.load(tmp_path / "moe.ckpt", weights_only=False)["state_dict"]
    for e in range(EXPERTS):
        for (name, want) in ref.moe.experts[str(e)].named_parameters():
            torch.testing.assert_close(state[f"net.moe.experts.{e}.{name}"], want.detach(), rtol=0, atol=1e-12)

    # resuming is refused, with the reason (each rank's optimizer state covers its own experts only)
    again = pl.Trainer(accelerator="cpu", devices=3, precision="64-true", logger=False, enable_progress_bar=False,
                       enable_model_summary=False, enable_checkpointing=False, max_epochs=2,
                       default_root_dir=str(tmp_path),
                       strategy=HeteroStrategy(cluster=CLUSTER, global_batch_size=16, start_method="fork",
                                               verbose=False))
    with pytest.raises(Exception, match="resuming a run with HeteroMoE layers is not supported"):
        again.fit(_Module(str(tmp_path / "again")), DataLoader(data, batch_size=5, shuffle=True),
                  ckpt_path=str(tmp_path / "moe.ckpt"))
