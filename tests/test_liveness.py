"""``strategy/liveness.py``: a rank that stops beating is named, in one line, and every survivor ends in bound."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.strategy.liveness import EXIT_PEER_GONE, Liveness  # noqa: E402

NAMES = ["device `cpu0` on node `a`", "device `cpu1` on node `a`", "device `cpu2` on node `b`"]


class _Exits:
    """Records the exit code instead of ending the test process."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.done.set()


class _Client:
    """One rank's client of the shared store; ``dead``: the process is gone, nothing it sends arrives."""

    def __init__(self, store) -> None:
        self.store, self.dead = store, False

    def __getattr__(self, name):
        if self.dead:
            raise ConnectionError("the process is gone")
        return getattr(self.store, name)


def _ranks(store, timeout_s: float = 1.0) -> tuple[list[Liveness], list[_Exits]]:
    exits = [_Exits() for _ in NAMES]
    clients = [_Client(store) for _ in NAMES]
    ranks = [Liveness(r, NAMES, timeout_s, store_factory=lambda c=clients[r]: c, exit=exits[r])
             for r in range(len(NAMES))]
    for live, client in zip(ranks, clients):
        live.client = client
        live.start()
    return ranks, exits


def _kill(live: Liveness) -> None:
    """The rank's process is gone: its heartbeat stops, and no finished mark is written."""
    live.client.dead = True
    live.stop()


def test_a_rank_that_stops_beating_is_named_once_and_every_survivor_ends(caplog) -> None:
    ranks, exits = _ranks(dist.HashStore())
    time.sleep(1.0)  # everyone beats: nobody is gone
    assert not any(e.codes for e in exits)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="het_strategy"):
        _kill(ranks[2])
        assert exits[0].done.wait(5) and exits[1].done.wait(5)
    took = time.monotonic() - started
    assert exits[0].codes == exits[1].codes == [EXIT_PEER_GONE] and not exits[2].codes
    beat = ranks[0].interval_s  # rank 2's last beat may come up to a beat before stop() returns
    assert 1.0 - 2 * beat <= took <= 1.0 + 2 * beat + 0.5  # the bound: timeout_s plus a beat
    assert ranks[0].gone == ranks[1].gone == [2]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines  # the lowest survivor speaks for all
    assert lines[0].startswith("rank 2 (device `cpu2` on node `b`) is gone: no heartbeat for ")
    assert f"exit with code {EXIT_PEER_GONE}" in lines[0]


def test_a_survivor_yet_to_see_the_silence_takes_the_lowest_survivors_verdict_before_the_store_goes() -> None:
    """Rank 1 watches with a longer bound (3 s) than rank 0 (1 s): when rank 2 goes, rank 0 names it first and
    announces it; rank 0 hosts the store, which goes with its process.  Rank 1 takes the verdict at its next beat,
    before rank 0 exits, and ends naming rank 2, not rank 0, long before its own bound."""
    store = dist.HashStore()
    clients = [_Client(store) for _ in NAMES]
    exits = [_Exits() for _ in NAMES]

    def host_goes(code: int) -> None:
        exits[0](code)
        for client in clients:
            client.dead = True

    ranks = [Liveness(0, NAMES, 1.0, store_factory=lambda: clients[0], exit=host_goes),
             Liveness(1, NAMES, 3.0, store_factory=lambda: clients[1], exit=exits[1]),
             Liveness(2, NAMES, 1.0, store_factory=lambda: clients[2], exit=exits[2])]
    for live in ranks:
        live.start()
    time.sleep(0.8)
    clients[2].dead = True  # rank 2's process is gone
    ranks[2].stop()
    started = time.monotonic()
    assert exits[1].done.wait(8) and exits[0].done.wait(8)
    assert time.monotonic() - started < 2.5
    assert exits[0].codes == exits[1].codes == [EXIT_PEER_GONE] and not exits[2].codes
    assert ranks[0].gone == ranks[1].gone == [2]


def test_a_verdict_of_an_earlier_run_on_the_same_store_is_not_taken() -> None:
    """A store that outlives a run (torchrun's agent store) keeps its announced verdict: ranks that beat again
    have moved their counters past it, and nobody ends."""
    store = dist.HashStore()
    store.set("het_liveness/2", "5")
    store.set("het_strategy/liveness/logged", "2:5")  # rank 2 was gone at counter 5, in the earlier run
    ranks, exits = _ranks(store)
    time.sleep(0.6)
    for live in ranks:
        live.stop()
    assert not any(e.codes for e in exits)


def test_a_rank_that_stopped_normally_is_finished_not_gone() -> None:
    """Ranks end their runs one after another: a rank whose teardown stopped its heartbeat is not reported."""
    ranks, exits = _ranks(dist.HashStore())
    time.sleep(0.5)
    ranks[2].stop()  # a normal stop marks it finished
    time.sleep(2.0)  # twice the timeout
    assert not any(e.codes for e in exits) and ranks[0].gone == []
    for live in ranks[:2]:
        live.stop()


def test_a_slow_rank_keeps_beating() -> None:
    """The heartbeat is a thread: a rank whose main thread is busy (here: holding the GIL in pure Python for
    twice the timeout) still beats."""
    ranks, exits = _ranks(dist.HashStore(), timeout_s=1.0)
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        sum(range(1000))
    for live in ranks:
        live.stop()
    assert not any(e.codes for e in exits)


def test_a_store_that_stops_answering_means_rank_zero_is_gone(caplog) -> None:
    class Gone:
        def add(self, key, value):
            raise ConnectionError("connection refused")

    exit = _Exits()
    live = Liveness(1, NAMES, 1.0, store_factory=Gone, exit=exit)
    with caplog.at_level(logging.ERROR, logger="het_strategy"):
        live.start()
        assert exit.done.wait(5)
    assert exit.codes == [EXIT_PEER_GONE] and live.gone == [0]
    assert "rank 0 (device `cpu0` on node `a`) is gone: the rendezvous store it hosts stopped answering" \
        in caplog.records[0].getMessage()


def test_a_file_being_written_is_finished_before_the_rank_ends() -> None:
    ranks, exits = _ranks(dist.HashStore())
    with ranks[0].writing():
        _kill(ranks[2])
        time.sleep(2.0)  # rank 2 is found gone meanwhile
        assert not exits[0].codes  # rank 0 finishes its file first
    assert exits[0].done.wait(2) and exits[0].codes == [EXIT_PEER_GONE]
    for live in ranks:
        live.stop()


@pytest.mark.parametrize("kwargs, field", [
    (dict(heartbeat_timeout_s=0), "heartbeat_timeout_s"),
    (dict(heartbeat_timeout_s="30"), "heartbeat_timeout_s"),
    (dict(timeout=300), "timeout"),
])
@pytest.mark.parametrize("deepspeed", [False, True])
def test_bad_timeouts_name_the_field(kwargs, field, deepspeed) -> None:
    with pytest.raises(ConfigError) as err:
        _strategy(deepspeed, **kwargs)
    assert err.value.field == field


def _strategy(deepspeed: bool, **kwargs):
    pytest.importorskip("lightning")
    if deepspeed:
        pytest.importorskip("deepspeed")
        from het_strategy import HeteroDeepSpeedStrategy

        return HeteroDeepSpeedStrategy(cluster="local_cpu2", workload="tiny_gpt", global_batch_size=8, **kwargs)
    from het_strategy import HeteroStrategy

    return HeteroStrategy(cluster="local_cpu2", **kwargs)


@pytest.mark.parametrize("deepspeed", [False, True])
def test_the_collectives_timeout_defaults_to_the_stated_bound(deepspeed) -> None:
    from het_strategy.strategy.liveness import COLLECTIVE_TIMEOUT_S

    assert _strategy(deepspeed).run.lifecycle.timeout == timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    assert _strategy(deepspeed, timeout=timedelta(seconds=9)).run.lifecycle.timeout == timedelta(seconds=9)


_KILLED_RUN = textwrap.dedent('''
    import os, signal, sys
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    import het_strategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)
        def training_step(self, batch, batch_idx):
            if self.global_rank == 2 and batch_idx == 3:
                os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # the device is lost, or hangs, mid-run
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.set_num_threads(1)
    cluster = {"name": "three", "nodes": [{"name": "local", "devices": [
        {"name": f"cpu{i}", "type": "CPU"} for i in range(3)]}]}
    data = TensorDataset(torch.randn(600, 8), torch.randn(600, 1))
    trainer = pl.Trainer(strategy=het_strategy.HeteroStrategy(cluster=cluster, heartbeat_timeout_s=3, verbose=False,
                                                              telemetry=False),
                         accelerator="cpu", devices=3, max_steps=50, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(), DataLoader(data, batch_size=6))
''')


def _run_losing_rank_2(tmp_path: Path, how: str) -> tuple[int, str, float]:
    """The 3-rank run above with rank 2 sent ``how`` at its 4th step: (rank 0's exit code, output, seconds)."""
    from het_strategy.emulation.local_ranks import free_port

    script = tmp_path / "run.py"
    script.write_text(_KILLED_RUN)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]))
    log = tmp_path / "out.txt"
    started = time.monotonic()
    with open(log, "w") as fh:  # a file, not a pipe: a frozen rank 2 would keep a pipe open
        proc = subprocess.Popen([sys.executable, str(script), how], env=env, cwd=tmp_path, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=120)
    finally:
        try:  # a frozen rank 2 outlives the others: it is stopped, not gone, and only its host can end it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return code, log.read_text(), time.monotonic() - started


@pytest.mark.multiprocess
def test_a_frozen_rank_ends_the_run_in_bound_with_one_line_naming_it(tmp_path: Path) -> None:
    """SIGSTOP: the process stays, so neither gloo nor Lightning's launcher sees anything, and the others would
    wait out the collective timeout (300 s); its heartbeat stops, so they end 3 s later."""
    code, out, took = _run_losing_rank_2(tmp_path, "SIGSTOP")
    assert code == EXIT_PEER_GONE, out[-3000:]
    named = [line for line in out.splitlines() if "is gone" in line]
    assert len(named) == 1 and "rank 2 (device `cpu2` on node `local`) is gone: no heartbeat" in named[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert took < 60, took


@pytest.mark.multiprocess
def test_a_killed_rank_ends_the_run_in_bound_without_tracebacks(tmp_path: Path) -> None:
    """SIGKILL: gloo fails the survivors' collective at once; they wait for the watchdog instead of printing
    tracebacks, and the run ends with a line on rank 2: ours, Lightning's launcher's when its observer sees the
    killed child before the watchdog's verdict, or ours and then the launcher's when the observer polls between
    our line and rank 0's exit (``Liveness._end``: the launcher reports after the line, not instead of it)."""
    code, out, took = _run_losing_rank_2(tmp_path, "SIGKILL")
    assert code != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    ours = [line for line in out.splitlines() if "is gone" in line]
    launcher = [line for line in out.splitlines() if "terminated with code" in line]
    assert len(ours) <= 1 and len(launcher) <= 1 and ours + launcher, out[-3000:]
    assert all("rank 2 (device `cpu2`" in line for line in ours), out[-3000:]
    assert all("[rank: 2]" in line for line in launcher), out[-3000:]
    if ours and launcher:
        lines = out.splitlines()
        assert lines.index(ours[0]) < lines.index(launcher[0]), out[-3000:]
    assert took < 60, took
