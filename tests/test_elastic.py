"""Elastic restart under torchrun: a device that dies is dropped, the survivors re-plan and go on from the newest
checkpoint; the named-device cluster (``strategy/elastic.py``) and its bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.strategy.elastic import DEVICE_ENV, SHARE_STORE_ENV, latest_checkpoint, present_cluster

TWO_NODES = {"name": "two", "nodes": [
    {"name": "a", "devices": [{"name": "a0", "type": "CPU"}, {"name": "a1", "type": "CPU"}]},
    {"name": "b", "devices": [{"name": "b0", "type": "CPU"}, {"name": "b1", "type": "CPU"}]}]}


def test_the_present_devices_make_the_cluster_in_rank_order() -> None:
    cluster = load_cluster(TWO_NODES)
    got = present_cluster(cluster, ["b1", "b0", "a1"])
    assert [d.name for d in got.devices] == ["b1", "b0", "a1"] and [n.name for n in got.nodes] == ["b", "a"]
    for names, message in ((["a0", "x9"], "name a device of cluster `two`"), (["a0", "a0"], "two ranks name it"),
                           (["a0", "b0", "a1"], "keep node `a`'s ranks consecutive")):
        with pytest.raises(ConfigError) as err:
            present_cluster(cluster, names)
        assert str(err.value).startswith(f"`{DEVICE_ENV}` is ") and message in str(err.value)


def test_the_newest_whole_checkpoint_is_the_highest_step(tmp_path: Path) -> None:
    import torch

    assert latest_checkpoint(tmp_path / "none") is None
    for name in ("step_2.ckpt", "step_10.ckpt", "epoch=0-step=7.ckpt", ".step_11.ckpt.part", "notes.txt"):
        torch.save({"step": name}, tmp_path / name)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10.ckpt"
    whole = (tmp_path / "step_10.ckpt").read_bytes()
    (tmp_path / "step_12.ckpt").write_bytes(whole[: len(whole) // 2])  # its writer died mid-write
    assert latest_checkpoint(tmp_path) == tmp_path / "step_10.ckpt"


def test_ranks_that_name_their_devices_need_an_agent_that_keeps_its_store(monkeypatch: pytest.MonkeyPatch) -> None:
    from het_strategy import HeteroStrategy
    from het_strategy.strategy.elastic import check_agent_store

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    check_agent_store()  # no device named: a plain torchrun run, as before
    monkeypatch.setenv(DEVICE_ENV, "a0")
    with pytest.raises(ConfigError) as err:
        HeteroStrategy(cluster=TWO_NODES, global_batch_size=8)
    assert str(err.value).startswith(f"`{SHARE_STORE_ENV}` is null; it must be 1 in torchrun's environment")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_agent_store()


def test_a_restart_whose_devices_hold_no_plan_names_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A (re)start on devices that cannot hold the model: one ConfigError naming the devices present."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from het_strategy import HeteroStrategy
    from tests._strategy_worker import IndexedData, Recorder

    class Large(Recorder):  # 1M more parameters: about 16 MiB with gradients and momentum
        def __init__(self, out_dir: str) -> None:
            super().__init__(out_dir)
            self.extra = torch.nn.Parameter(torch.zeros(1024, 1024))

    cluster = {"name": "small", "nodes": [{"name": "n", "devices": [
        {"name": "big", "type": "CPU"}, {"name": "tiny", "type": "CPU", "memory_gb": 0.001}]}]}
    monkeypatch.setenv(DEVICE_ENV, "tiny")  # big is gone: tiny alone restarts
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path),
                         strategy=HeteroStrategy(cluster=cluster, global_batch_size=8, verbose=False,
                                                 heartbeat_timeout_s=None))
    with pytest.raises(ConfigError) as err:
        trainer.fit(Large(str(tmp_path)), DataLoader(IndexedData(16), batch_size=4))
    assert str(err.value).startswith(f"the devices present (tiny, named in {DEVICE_ENV}) hold no plan: no dp plan "
                                     "fits in memory"), str(err.value)


WORKER = Path(__file__).with_name("_elastic_worker.py")


#: torchrun's agents must not share their TCP store with the workers: with it a device that joins waits forever
#: for the round's MASTER_ADDR, and the agents' restart counts differ (pytorch/pytorch#135712).
AGENT_ENV = {SHARE_STORE_ENV: "1"}


def _agent(out: Path, device: str, port: int, kill_step: int) -> subprocess.Popen:
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, **AGENT_ENV, DEVICE_ENV: device, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2:3", "--nproc-per-node=1", "--max-restarts=3",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
           "--rdzv-conf=join_timeout=90,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,"
           "keep_alive_max_attempt=3", "--monitor-interval=0.5", str(WORKER), str(out), str(kill_step)]
    log = open(out / f"agent-{device}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _rows_once(path: Path, timeout_s: float) -> None:
    """Until ``path`` holds a line (a step trained), or a TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no step trained within {timeout_s} s")
        time.sleep(0.2)


@pytest.mark.multiprocess
def test_a_device_that_joins_is_used_and_one_that_dies_is_dropped_exactly(tmp_path: Path) -> None:
    """Devices fast and mid (speeds 5 and 2) start; once they train, slow (speed 1) joins: torchrun's agents restart
    the group as a world of three (shares 10/4/2 of 16) from the newest checkpoint.  As step 3 begins slow's agent
    and worker are killed: the other two detect it, torchrun restarts them as a world of two, the strategy re-plans
    for fast and mid and resumes from the step-3 checkpoint.  Nothing is lost: every sample of both epochs is
    trained exactly once, and the parameters equal one process's on the same global batches (float64)."""
    import torch

    from het_strategy.emulation.local_ranks import free_port
    from tests._strategy_worker import IndexedData, make_net

    port, steps = free_port(), tmp_path / "steps.jsonl"
    agents = {}
    try:
        for device in ("fast", "mid"):  # fast first: its agent hosts the rendezvous store
            agents[device] = _agent(tmp_path, device, port, kill_step=3)
            time.sleep(1.0)
        _rows_once(steps, timeout_s=120)
        agents["slow"] = _agent(tmp_path, "slow", port, kill_step=3)
        for device in ("fast", "mid"):
            assert agents[device].wait(timeout=240) == 0, (tmp_path / f"agent-{device}.log").read_text()[-4000:]
    finally:
        for proc in agents.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    rows = [json.loads(line) for line in steps.read_text().splitlines()]
    groups = list(dict.fromkeys(r["group"] for r in rows))  # in the order they trained
    devices = {g: {r["device"] for r in rows if r["group"] == g} for g in groups}
    assert [devices[g] for g in groups] == [{"fast", "mid"}, {"fast", "mid", "slow"}, {"fast", "mid"}], devices
    steps_of = {g: sorted({r["step"] for r in rows if r["group"] == g}) for g in groups}
    assert steps_of[groups[0]] == [0] and steps_of[groups[1]] == [1, 2] and steps_of[groups[2]] == [3, 4, 5]
    trajectory: dict[int, tuple[int, list[int]]] = {}
    for r in rows:  # every step was trained by one group: its ranks' samples make the global batch
        epoch, ids = trajectory.setdefault(r["step"], (r["epoch"], []))
        ids.extend(r["ids"])
    for epoch in (0, 1):
        seen = [i for e, ids in trajectory.values() if e == epoch for i in ids]
        assert sorted(seen) == list(range(48)), epoch
    data, net = IndexedData(48), make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for step in range(6):
        ids = trajectory[step][1]
        opt.zero_grad()
        (net(data.x[ids]).squeeze(-1) - data.y[ids]).pow(2).mean().backward()
        opt.step()
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["world"] == 2
    for (name, p), got in zip(net.named_parameters(), final["params"].values()):
        assert got == pytest.approx(p.detach().flatten().tolist(), abs=1e-12), name


def _launch_and_wait(log_dir: Path, run_id: str, devices: list[str], target: list[str], *, max_restarts: int = 0,
                     env: dict[str, str] | None = None, timeout_s: float = 240) -> None:
    """One torchrun agent per device (``--nnodes=1:N``, one process each) running ``target``; every agent must
    exit 0 within ``timeout_s`` (its log, ``log_dir/<run_id>-<device>.log``, is shown when one does not)."""
    from het_strategy.emulation.local_ranks import free_port

    port, procs = free_port(), []
    try:
        for device in devices:
            agent_env = {**os.environ, **AGENT_ENV, **(env or {}), DEVICE_ENV: device, "OMP_NUM_THREADS": "1",
                         "PYTHONWARNINGS": "ignore"}
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{len(devices)}", "--nproc-per-node=1",
                   f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   f"--rdzv-id={run_id}", "--rdzv-conf=join_timeout=60,last_call_timeout=3,close_timeout=10", *target]
            log = open(log_dir / f"{run_id}-{device}.log", "w")  # noqa: SIM115 - closed with the process
            procs.append(subprocess.Popen(cmd, env=agent_env, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
            time.sleep(1.0)
        for device, proc in zip(devices, procs):
            assert proc.wait(timeout=timeout_s) == 0, (log_dir / f"{run_id}-{device}.log").read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)


HET_TRAIN_TINY = ["-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", "model=tiny_gpt", "model.num_layers=1",
                  "model.hidden_size=32", "model.seq_len=32", "train.global_batch_size=8", "train.val_every_n_steps=100",
                  "train.val_batches=1", "data.max_bytes=200000", "logger=none"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["hetero", "hetero_deepspeed"])
def test_het_train_elastic_goes_on_from_the_newest_checkpoint_on_the_devices_present(tmp_path: Path,
                                                                                     strategy: str) -> None:
    """het-train ``elastic.enabled=true`` under torchrun: two agents (devices rank0, rank1 of local_cpu2) train 4
    steps; a later launch with rank0's agent alone goes on from the step-4 checkpoint (mid-epoch) on that one
    device, to 6.  The final training loss equals an uninterrupted 6-step run's on both devices (the same global
    batches; hetero_deepspeed's checkpoint is loaded layer by layer into the one-device plan)."""
    out = tmp_path / "run"
    out.mkdir()
    run = [*HET_TRAIN_TINY, f"strategy={strategy}"]
    for run_id, devices, steps in (("first", ["rank0", "rank1"], 4), ("second", ["rank0"], 6)):
        _launch_and_wait(tmp_path, run_id, devices, [*run, f"train.max_steps={steps}", "elastic.enabled=true",
                                                     "checkpoint.every_n_steps=2", f"output.dir={out}"],
                         max_restarts=1, timeout_s=300)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["world_size"] == len(devices) and summary["max_steps"] == steps, summary
    assert latest_checkpoint(out / "checkpoints") == out / "checkpoints" / "step_6.ckpt"
    log = (tmp_path / "second-rank0.log").read_text()
    assert "Restoring states from the checkpoint" in log and "step_4.ckpt" in log
    assert ("re-planning" if strategy == "hetero" else "loaded layer by layer into this plan") in log
    whole = tmp_path / "whole"
    proc = subprocess.run([sys.executable, *run, "train.max_steps=6", f"output.dir={whole}"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = json.loads((whole / "summary.json").read_text())["final_train_loss"]
    assert summary["final_train_loss"] == pytest.approx(reference, rel=1e-5)


DS_WORKER = Path(__file__).with_name("_ds_elastic_worker.py")


@pytest.mark.multiprocess
def test_hetero_deepspeed_goes_on_from_the_newest_checkpoint_on_the_devices_present(tmp_path: Path) -> None:
    """hetero_deepspeed under torchrun's elastic agent: agents on devices a and b train 4 steps, the plan made for
    both, checkpointing every step; a later launch with a's agent alone re-plans for a, loads the step-4
    checkpoint through its per-layer files (another plan) and goes on to the end of epoch 2.  The parameters equal
    one process's over the same 6 global batches (fp32)."""
    from tests.test_ds_strategy import TOL, _reference

    out = tmp_path / "run"
    out.mkdir()
    for run_id, devices, steps in (("ds0", ["a", "b"], 4), ("ds1", ["a"], -1)):
        _launch_and_wait(tmp_path, run_id, devices, [str(DS_WORKER), str(out), str(steps)],
                         env={"DS_ACCELERATOR": "cpu"}, timeout_s=300)
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]
    assert [(s["world"], sorted(s["devices"]), s["step"]) for s in starts if s["rank"] == 0] == [
        (2, ["a", "b"], 0), (1, ["a"], 4)], starts
    assert latest_checkpoint(out / "ckpt") == out / "ckpt" / "step_6.ckpt"
    final = json.loads((out / "final.json").read_text())
    _, _, reference = _reference(epochs=2)
    assert final["step"] == 6
    for name, values in reference.items():
        assert final["params"][name] == pytest.approx(values, **TOL), name
