"""The hetero strategy on real gloo processes (Lightning's fork launcher): exact updates, exactly-once data, resume."""

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
from het_strategy.strategy.checkpoint import CHECKPOINT_FORMAT  # noqa: E402
from tests._strategy_worker import IndexedData, Recorder, float64_trainer, make_net, rank_rows  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("fresh_master_port"),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")]

def _local_cluster(name: str, devices: dict[str, dict], **extra) -> dict:  # type: ignore[no-untyped-def]
    """A one-node cluster of CPU devices (``{device name: its fields}``) in the cluster YAML schema."""
    return {"name": name, "inter_node_bandwidth_gbs": 10, **extra,
            "nodes": [{"name": "local", "devices": [{"name": n, "type": "CPU", **d} for n, d in devices.items()]}]}


# Three CPU devices whose sustained speeds are 5 : 2 : 1, so the planner's shares of 16 are 10 / 4 / 2.
CLUSTER_521 = _local_cluster("three_speeds", {"fast": {"tflops": {"fp32": 5.0}}, "mid": {"tflops": {"fp32": 2.0}},
                                              "slow": {"tflops": {"fp32": 1.0}}})


def _trainer(tmp: Path, **kwargs) -> pl.Trainer:  # type: ignore[no-untyped-def]
    strategy = HeteroStrategy(cluster=CLUSTER_521, global_batch_size=16, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    return float64_trainer(tmp, strategy, **kwargs)


def _rows(out: Path) -> list[list[dict]]:
    return rank_rows(out, 3)


def _reference(data: IndexedData, steps: list[list[list[int]]], accumulate: int, lr: float = 0.1
               ) -> tuple[torch.nn.Module, list[float]]:
    """Single process: each optimizer step averages the mean-loss gradients of its global batches (Lightning
    divides every batch's loss by ``accumulate``)."""
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    losses = []
    for group in steps:
        opt.zero_grad()
        for indices in group:
            x, y = data.x[indices], data.y[indices]
            loss = (net(x).squeeze(-1) - y).pow(2).mean()
            losses.append(loss.item())
            (loss / accumulate).backward()
        opt.step()
    return net, losses


def test_three_ranks_uneven_shares_equal_single_process_update(tmp_path: Path) -> None:
    """Shares 10/4/2, a short last batch with a filler rank, 2 epochs, gradient accumulation 2: the parameters
    equal a single-process run's on the same global batches; every sample is used once per epoch."""
    data = IndexedData(34)  # global batches 16, 16, 2 -> the last one splits 1/1/0 (rank 2 gets a weight-0 filler)
    out = tmp_path / "rows"
    out.mkdir()
    model = Recorder(str(out))
    trainer = _trainer(tmp_path, max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(model, DataLoader(data, batch_size=5, shuffle=True))
    rows = _rows(out)

    # Same number of steps on every rank; the planned shares; the filler counted as 0.
    assert [len(r) for r in rows] == [6, 6, 6]
    assert [rows[r][0]["counted"] for r in range(3)] == [10, 4, 2]
    assert [rows[r][2]["counted"] for r in range(3)] == [1, 1, 0]

    # Exactly once per epoch across ranks (fillers excluded), and a different order in the two epochs.
    per_step: list[list[int]] = []
    for epoch in range(2):
        used: list[int] = []
        for b in range(3):
            step: list[int] = []
            for r in range(3):
                row = rows[r][3 * epoch + b]
                assert (row["epoch"], row["batch"]) == (epoch, b)
                step += row["indices"][: row["counted"]] if row["counted"] else []
            used += step
            per_step.append(step)
        assert sorted(used) == list(range(34))
    assert per_step[0] != per_step[3]

    # Single-process reference on the same global batches: steps after batches (0,1) and (2) of each epoch.
    groups = [[per_step[0], per_step[1]], [per_step[2]], [per_step[3], per_step[4]], [per_step[5]]]
    ref, ref_losses = _reference(data, groups, accumulate=2)
    for (name, p), q in zip(model.net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=name)
    # The weighted reduce of the per-rank mean losses is the global batch's mean loss.
    synced = [rows[0][i]["synced_loss"] for i in range(6)]
    assert synced == pytest.approx(ref_losses, abs=1e-12)
    # ... and so is what `self.log(..., sync_dist=True)` recorded for each step.
    assert [rows[0][i]["logged"] for i in range(6)] == pytest.approx(ref_losses, abs=1e-12)


CLUSTER_21 = _local_cluster("two_speeds", {"fast": {"tflops": {"fp32": 2.0}}, "slow": {"tflops": {"fp32": 1.0}}})


def _two_rank_trainer(tmp: Path, cluster: dict, global_batch: int, **kwargs) -> pl.Trainer:  # type: ignore[no-untyped-def]
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster=cluster, global_batch_size=global_batch, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    defaults = dict(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
                    enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    defaults.update(kwargs)
    return pl.Trainer(default_root_dir=str(tmp), **defaults)


def _losses(out: Path) -> list[tuple[int, int, float]]:
    rows = json.loads((out / "rank0.json").read_text())
    return [(r["epoch"], r["batch"], r["synced_loss"]) for r in rows]


CLUSTER_21_EMULATED = _local_cluster("two_speeds", {"fast": {"tflops": {"fp32": 1.0}, "emulated_speed": 1.0},
                                                    "slow": {"tflops": {"fp32": 1.0}, "emulated_speed": 0.5}})


def test_resume_mid_epoch_continues_identically(tmp_path: Path) -> None:
    """A run resumed from a mid-epoch checkpoint reproduces the uninterrupted run's batches and losses, through
    the short last batch and into the next epoch; the checkpoint carries the plan and the shares.  (An emulated
    cluster, speeds 1 : 0.5, so the resumed run also rebuilds its emulated devices.)"""
    data = IndexedData(40)  # shares 8/4 of 12: batches 12, 12, 12, 4 per epoch
    full_out, first_out, resumed_out = (tmp_path / n for n in ("full", "first", "resumed"))
    for d in (full_out, first_out, resumed_out):
        d.mkdir()

    _two_rank_trainer(tmp_path / "a", CLUSTER_21_EMULATED, 12, max_epochs=2, enable_checkpointing=False).fit(
        Recorder(str(full_out)), DataLoader(data, batch_size=6, shuffle=True))
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=3, save_top_k=-1)
    _two_rank_trainer(tmp_path / "b", CLUSTER_21_EMULATED, 12, max_steps=3, callbacks=[ckpt]).fit(
        Recorder(str(first_out)), DataLoader(data, batch_size=6, shuffle=True))
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    state = torch.load(path, weights_only=False)["het_strategy"]
    assert state["shares"] == [8, 4] and state["devices"] == ["fast", "slow"]
    assert state["format"] == CHECKPOINT_FORMAT
    assert state["plan"]["rank_shares"] == {"fast": 8, "slow": 4}

    _two_rank_trainer(tmp_path / "c", CLUSTER_21_EMULATED, 12, max_epochs=2, enable_checkpointing=False).fit(
        Recorder(str(resumed_out)), DataLoader(data, batch_size=6, shuffle=True), ckpt_path=str(path))

    full = _losses(full_out)
    assert len(full) == 8
    assert _losses(first_out) == full[:3]
    resumed = _losses(resumed_out)
    assert [(e, b) for e, b, _ in resumed] == [(e, b) for e, b, _ in full[3:]]
    assert [x for *_, x in resumed] == pytest.approx([x for *_, x in full[3:]], abs=1e-12)


def test_rank_with_no_share_never_hangs(tmp_path: Path) -> None:
    """A given plan that leaves a device idle: that rank runs weight-0 fillers in step with the other, and the
    update is the busy rank's alone (as a single process on its batches)."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    plan = Plan(cluster="two_speeds", cluster_devices=("fast", "slow"), model={"num_layers": 1},
                global_batch_size=8, pipelines=(Pipeline((Stage(("fast",), (0, 1)),), 8, 8),), dtype="fp32",
                mode="manual")
    plan.save(tmp_path / "plan.json")
    data = IndexedData(24)
    out = tmp_path / "rows"
    out.mkdir()
    model = Recorder(str(out))
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster=CLUSTER_21, plan=tmp_path / "plan.json", start_method="fork",
                              verbose=False, timeout=__import__("datetime").timedelta(seconds=120))
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
               max_epochs=1, default_root_dir=str(tmp_path)).fit(
        model, DataLoader(data, batch_size=4), DataLoader(IndexedData(6, seed=5), batch_size=3))  # sanity check first
    rows = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["counted"] for r in rows[0]] == [8, 8, 8]
    assert [r["counted"] for r in rows[1]] == [0, 0, 0]
    assert sorted(i for r in rows[0] for i in r["indices"]) == list(range(24))
    ref, _ = _reference(data, [[r["indices"]] for r in rows[0]], accumulate=1)
    for p, q in zip(model.net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12)


def test_auto_cluster_probes_caches_profiles_and_trains(tmp_path: Path) -> None:
    """cluster="auto": every rank measures its device and the links (cached per host and device), times the
    model per block on its device, and the plan — made with those times — splits the batch (two equal CPU
    processes here: about evenly)."""
    cache = tmp_path / "cache"
    out = tmp_path / "rows"
    out.mkdir()
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster="auto", global_batch_size=8, probe_cache_dir=cache, start_method="fork",
                              profile_input=lambda batch: batch[0].float(), verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, max_steps=2,
               default_root_dir=str(tmp_path)).fit(Recorder(str(out), dtype=torch.float32),
                                                   DataLoader(IndexedData(16), batch_size=4),
                                                   DataLoader(IndexedData(8, seed=5), batch_size=2))  # sanity check first
    assert len(list(cache.glob("device-*.json"))) == 2 and len(list(cache.glob("links-*.json"))) == 1
    info = json.loads((out / "strategy0.json").read_text())
    assert info["profiled_types"] == ["CPU"]
    assert info["workload_layers"] == ["block0", "block1", "block2"]  # the Sequential's three modules
    assert info["plan"]["cluster"] == "auto" and info["plan"]["predicted"]["step_time_s"] > 0
    rows = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    counted = [[row["counted"] for row in rank_rows] for rank_rows in rows]
    assert [a + b for a, b in zip(*counted)] == [8, 8]
    assert all(c >= 1 for c in counted[0] + counted[1])


def test_a_cluster_of_another_size_than_the_world_is_refused_before_training(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    strategy = HeteroStrategy(cluster=CLUSTER_521, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, max_steps=1,
                         default_root_dir=str(tmp_path))
    out = tmp_path / "rows"
    out.mkdir()
    with pytest.raises(Exception, match="as many devices as the launched world has ranks"):
        trainer.fit(Recorder(str(out)), DataLoader(IndexedData(8), batch_size=2))
    assert not list(out.iterdir())  # no training step ran


def _slowdown_cluster(start: int) -> dict:
    # ~8 ms of emulated compute per sample for the 49-parameter test net (3 x 98 FLOPs / 3.7e-8 TFLOPS)
    dev = {"tflops": {"fp32": 3.7e-8}, "efficiency": 1.0, "emulated_speed": 1.0}
    return _local_cluster("three_equal", {f"r{i}": dev for i in range(3)},
                          slowdowns=[{"device": "r1", "factor": 3.0, "start_step": start}])


def test_scheduled_slowdown_triggers_an_exact_rebalance_that_survives_resume(tmp_path: Path) -> None:
    """Rank 1 becomes 3x slower at step 6: the straggler callback moves work off it at a step boundary on every
    rank; the parameters still equal a single process's on the same global batches, every sample is used once
    per epoch, and a run resumed from a checkpoint after the rebalance keeps its shares, detector state and
    batches."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from het_strategy.callbacks.straggler import StragglerMitigation

    data = IndexedData(60)  # global batch 12: 5 steps per epoch, 4 epochs
    runs = {name: tmp_path / name for name in ("full", "resumed")}
    for d in runs.values():
        d.mkdir()

    def trainer(root: Path, **kwargs) -> pl.Trainer:  # type: ignore[no-untyped-def]
        torch.set_num_threads(1)
        strategy = HeteroStrategy(cluster=_slowdown_cluster(6), global_batch_size=12, start_method="fork",
                                  verbose=False, timeout=__import__("datetime").timedelta(seconds=120))
        straggler = StragglerMitigation(every_n_steps=2, consecutive=3, warmup=4, verbose=False, log=False)
        return pl.Trainer(accelerator="cpu", devices=3, strategy=strategy, precision="64-true", logger=False,
                          enable_progress_bar=False, enable_model_summary=False, max_epochs=4,
                          default_root_dir=str(root), callbacks=[straggler, *kwargs.pop("callbacks", [])], **kwargs)

    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=16, save_top_k=-1)
    model = Recorder(str(runs["full"]))
    trainer(tmp_path / "a", callbacks=[ckpt]).fit(model, DataLoader(data, batch_size=4, shuffle=True))
    rows = [json.loads((runs["full"] / f"rank{r}.json").read_text()) for r in range(3)]
    counted = [[rows[r][i]["counted"] for r in range(3)] for i in range(20)]
    assert counted[0] == [4, 4, 4]
    assert counted[-1][1] < 4 and sum(counted[-1]) == 12  # work moved off the slow rank
    switch = next(i for i, c in enumerate(counted) if c != [4, 4, 4])
    assert 6 < switch <= 6 + 10, f"shares changed at step {switch}, the slowdown began at 6"
    assert all(c[1] < 4 for c in counted[switch:]), "the slow rank keeps a smaller share once rebalanced"

    steps = []
    for epoch in range(4):
        used = []
        for b in range(5):
            step = [i for r in range(3) for i in rows[r][5 * epoch + b]["indices"][: rows[r][5 * epoch + b]["counted"]]]
            steps.append(step)
            used += step
        assert sorted(used) == list(range(60))
    ref, ref_losses = _reference(data, [[s] for s in steps], accumulate=1)
    for p, q in zip(model.net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12)

    # the strategy runs the Plan the shares came from: the straggler callback's re-plan, priced from measurements
    final_plan = json.loads((runs["full"] / "strategy0.json").read_text())["plan"]
    assert [final_plan["rank_shares"][d] for d in ("r0", "r1", "r2")] == counted[-1]
    assert final_plan["predicted"]["source"] == "measured"

    path = tmp_path / "ckpt" / "epoch=3-step=16.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["het_strategy"]["shares"] == counted[switch]
    assert [saved["het_strategy"]["plan"]["rank_shares"][d] for d in ("r0", "r1", "r2")] == counted[switch]
    (cb_state,) = [v for k, v in saved["callbacks"].items() if "StragglerMitigation" in k]
    assert cb_state["decisions"] and len(cb_state["detectors"]) == 3

    trainer(tmp_path / "c").fit(Recorder(str(runs["resumed"])), DataLoader(data, batch_size=4, shuffle=True),
                                ckpt_path=str(path))
    resumed = [json.loads((runs["resumed"] / f"rank{r}.json").read_text()) for r in range(3)]
    assert [[resumed[r][i]["counted"] for r in range(3)] for i in range(4)] == counted[16:]
    assert [row["synced_loss"] for row in resumed[0]] == pytest.approx(
        [row["synced_loss"] for row in rows[0][16:]], abs=1e-12)
    # ... and the resumed run holds the checkpoint's (rebalanced) plan
    assert json.loads((runs["resumed"] / "strategy0.json").read_text())["plan"] == saved["het_strategy"]["plan"]


def test_a_checkpoint_written_by_0_1_0_is_refused_naming_it(tmp_path: Path) -> None:
    """tests/data/checkpoint_v0.1.0.ckpt (written by tests/data/make_checkpoint_v0.1.0.py) has no checkpoint
    format: resuming from it stops with one ConfigError that names the file and says what to do."""
    legacy = Path(__file__).parent / "data" / "checkpoint_v0.1.0.ckpt"
    cluster = {"name": "two_emulated", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
        {"name": "fast", "type": "CPU", "tflops": {"fp32": 2.0}, "emulated_speed": 1.0},
        {"name": "slow", "type": "CPU", "tflops": {"fp32": 2.0}, "emulated_speed": 0.5}]}]}
    out = tmp_path / "rows"
    out.mkdir()
    strategy = HeteroStrategy(cluster=cluster, global_batch_size=12, start_method="fork", verbose=False,
                              timeout=__import__("datetime").timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, max_steps=5, default_root_dir=str(tmp_path))
    # the error is raised on every rank; the launcher reports the first rank's
    with pytest.raises(Exception, match=f"checkpoint '{legacy}'.*has no checkpoint format.*start the run afresh"):
        trainer.fit(Recorder(str(out)), DataLoader(IndexedData(30), batch_size=6, shuffle=True),
                    ckpt_path=str(legacy))


def test_a_three_rank_checkpoint_resumes_on_two_ranks_with_every_sample_once(tmp_path: Path) -> None:
    """A device is gone: the 3-rank run's mid-epoch checkpoint resumes on a cluster of the two devices left.  The
    strategy re-plans for them (shares 10/4/2 -> 12/4 of 16), the epoch goes on at the next global batch, and
    over both runs every sample of each epoch is trained exactly once; the parameters equal one process's on the
    same global batches (float64)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = IndexedData(48)  # 3 global batches of 16 per epoch
    first_out, resumed_out = tmp_path / "first", tmp_path / "resumed"
    for d in (first_out, resumed_out):
        d.mkdir()
    ckpt = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path / "a", max_steps=2, callbacks=[ckpt], enable_checkpointing=True).fit(
        Recorder(str(first_out)), DataLoader(data, batch_size=5, shuffle=True))
    path = tmp_path / "ckpt" / "epoch=0-step=2.ckpt"
    survivors = _local_cluster("two_left", {"fast": {"tflops": {"fp32": 5.0}}, "mid": {"tflops": {"fp32": 2.0}}})
    model = Recorder(str(resumed_out))
    _two_rank_trainer(tmp_path / "b", survivors, 16, max_epochs=2, enable_checkpointing=False).fit(
        model, DataLoader(data, batch_size=8, shuffle=True), ckpt_path=str(path))

    first, resumed = rank_rows(first_out, 3), rank_rows(resumed_out, 2)
    assert [rows[0]["counted"] for rows in first] == [10, 4, 2]
    assert [rows[0]["counted"] for rows in resumed] == [12, 4]  # re-planned for the two devices left
    steps: list[tuple[int, list[int]]] = []  # (epoch, the global batch's sample ids) in training order
    for run in (first, resumed):
        for i in range(len(run[0])):
            steps.append((run[0][i]["epoch"], [k for rows in run for k in rows[i]["indices"][: rows[i]["counted"]]]))
    assert [e for e, _ in steps] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        seen = [k for e, ids in steps if e == epoch for k in ids]
        assert sorted(seen) == list(range(48)), epoch  # none lost, none twice
    ref, _ = _reference(data, [[ids] for _, ids in steps], accumulate=1)
    for (name, p), q in zip(model.net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-12, msg=name)
