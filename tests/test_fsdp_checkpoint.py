"""Sharded ``hetero_fsdp`` checkpoints (``het_strategy.fsdp.checkpoint``) load into another shard layout and
another world size: every unit's flat parameter and the optimizer's state come back exactly, and the next step
is the one the saving run took."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.fsdp.checkpoint import load_sharded, save_sharded  # noqa: E402
from tests import _fsdp_checkpoint_worker as worker  # noqa: E402
from tests._spawned_ranks import run_spawned_ranks  # noqa: E402

SAVE_FRACTIONS = [4 / 7, 2 / 7, 1 / 7]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def optimizer_imported() -> None:
    """One Adam step here: its first step imports torch._dynamo (a second or more), which the forked ranks then
    inherit instead of each importing it."""
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.ones(1)
    torch.optim.Adam([param]).step()


def _full(ranks: list[dict[str, Any]], phase: str) -> dict[str, dict[str, Any]]:
    """Per unit: the flat parameter and each optimizer state tensor put together from the ranks' pieces (by
    offset), and the scalar states (which every rank must hold alike)."""
    out: dict[str, dict[str, Any]] = {}
    for name in worker.UNITS:
        pieces = sorted((r[phase][name] for r in ranks), key=lambda p: p["offset"])
        full: dict[str, Any] = {"shard": [x for p in pieces for x in p["shard"]]}
        held = [p for p in pieces if p["state"]]
        for key in held[0]["state"] if held else []:
            if isinstance(held[0]["state"][key], list):
                full[key] = [x for p in pieces for x in p["state"].get(key, [])]
            else:
                assert len({p["state"][key] for p in held}) == 1, (name, key)
                full[key] = held[0]["state"][key]
        out[name] = full
    return out


def _sizes(fractions: list[float]) -> dict[str, list[int]]:
    from het_strategy.core.shard_sizes import shard_sizes

    return {name: shard_sizes(n, fractions) for name, n in worker.UNITS.items()}


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the ranks are forked (no torch import each)")
@pytest.mark.usefixtures("optimizer_imported")
@pytest.mark.parametrize("load_fractions, optimizer, async_save", [([1 / 2, 1 / 2], "adam", False),
                                                                    ([0.0, 1 / 3, 2 / 3], "adam", True),
                                                                    ([1 / 2, 1 / 2], "sgd", False)],
                         ids=["3-to-2-ranks", "3-to-3-ranks-async", "3-to-2-ranks-sgd"])
def test_a_checkpoint_of_three_uneven_ranks_loads_into_another_layout_and_takes_the_same_next_step(
        tmp_path: Path, load_fractions: list[float], optimizer: str, async_save: bool) -> None:
    """Saved by 3 ranks holding 4:2:1 of every unit (rank 2 none of the 2-element root unit), loaded into 2
    ranks at 1:1, or (saved asynchronously while the next step already changes the state) into 3 ranks at 0:1:2:
    the flat parameters, Adam's moments and step (SGD's momentum buffer), the learning rates and ``extra`` are
    the saved ones, exactly, and one more step on each side gives the same parameters."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "save").mkdir()
    (tmp_path / "load").mkdir()
    saved = run_spawned_ranks(functools.partial(worker.flat_save, SAVE_FRACTIONS, optimizer, ckpt, async_save), 3,
                              tmp_path / "save", TIMEOUT_S, start_method="fork")
    loaded = run_spawned_ranks(functools.partial(worker.flat_load, load_fractions, optimizer, ckpt), len(load_fractions),
                               tmp_path / "load", TIMEOUT_S, start_method="fork")
    assert all(r["future"] is async_save for r in saved)
    assert _sizes(SAVE_FRACTIONS) != _sizes(load_fractions) and _sizes(SAVE_FRACTIONS)["root"] == [1, 1, 0]
    before, after = _full(saved, "saved"), _full(loaded, "loaded")
    states = {"adam": {"step", "exp_avg", "exp_avg_sq"}, "sgd": {"momentum_buffer"}}[optimizer]
    assert set(before["blocks.0"]) == {"shard"} | states
    assert after == before  # every element of every unit and every state, bit for bit
    for r in loaded:
        assert r["extra"] == worker.EXTRA
        assert r["lrs"] == [worker.LRS["blocks"], worker.LRS["root"]]
    next_saved, next_loaded = _full(saved, "after"), _full(loaded, "after")
    for name in worker.UNITS:
        diff = max(abs(a - b) for a, b in zip(next_saved[name]["shard"], next_loaded[name]["shard"]))
        assert diff <= 1e-12, name
        assert next_saved[name]["shard"] != before[name]["shard"]  # the step moved the parameters


@pytest.fixture
def one_rank_group() -> None:
    """A process group of this one process (the autouse fixture in conftest.py destroys it)."""
    import torch.distributed as dist

    from het_strategy.emulation.local_ranks import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _one_rank_model() -> tuple[Any, Any]:
    """A one-rank FlatModel with two Adam steps taken."""
    model = worker.FlatModel([1.0], 0)
    opt = worker.optimizer_for("adam", model, worker.LRS)
    for step in range(2):
        worker._step(model, opt, step, 0)
    return model, opt


@pytest.mark.usefixtures("one_rank_group")
def test_a_save_that_stops_half_way_leaves_nothing_that_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A finished checkpoint, then a second save into the same directory that dies after writing its data but
    before its ``.metadata``: the directory no longer loads (neither the old state nor a mix of old and new)."""
    import torch.distributed.checkpoint as dcp

    model, opt = _one_rank_model()
    save_sharded(model, opt, tmp_path / "ckpt", extra={"n": 1})
    fresh = worker.FlatModel([1.0], 0, fill=0.0)
    assert load_sharded(fresh, None, tmp_path / "ckpt") == {"n": 1}
    assert torch.equal(fresh.units[1].shard, model.units[1].shard)

    def crash(self, metadata, results) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(dcp.FileSystemWriter, "finish", crash)
    worker._step(model, opt, 2, 0)
    with pytest.raises(dcp.CheckpointException, match="disk gone"):
        save_sharded(model, opt, tmp_path / "ckpt", extra={"n": 2})
    assert any((tmp_path / "ckpt").glob("*.distcp"))  # the new data is there, without its metadata
    with pytest.raises(ConfigError, match=r"`checkpoint.path` .*ckpt'; it must hold a finished sharded checkpoint"):
        load_sharded(worker.FlatModel([1.0], 0), None, tmp_path / "ckpt")


@pytest.mark.usefixtures("one_rank_group")
def test_units_that_differ_from_the_checkpoints_are_refused(tmp_path: Path) -> None:
    model, opt = _one_rank_model()
    save_sharded(model, None, tmp_path / "ckpt")
    other = worker.FlatModel([1.0], 0)
    other.units[1] = worker.FlatUnit("blocks.1", torch.zeros(24, dtype=torch.float64), [1.0], 0)
    with pytest.raises(ConfigError, match=r"`units\[blocks.1\].numel` is 24; it must match a unit of the "
                                          r"checkpoint .*blocks.1=\(23,\)"):
        load_sharded(other, None, tmp_path / "ckpt")
    fewer = worker.FlatModel([1.0], 0)
    del fewer.units[0]
    with pytest.raises(ConfigError, match=r"`units` is \['blocks.1', 'root'\]; it must hold every unit of the "
                                          r"checkpoint .*; it lacks blocks.0"):
        load_sharded(fewer, None, tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="holds no optimizer state"):
        load_sharded(worker.FlatModel([1.0], 0), opt, tmp_path / "ckpt")
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ConfigError, match=r"`optimizer.param_groups\[0\].params\[0\]` is \(3,\); it must be one of"):
        save_sharded(model, stray, tmp_path / "other")


@pytest.mark.multiprocess
@pytest.mark.skipif(not hasattr(os, "fork"), reason="the ranks are forked (no torch import each)")
@pytest.mark.usefixtures("optimizer_imported")
def test_a_sharded_model_saved_by_three_ranks_takes_the_same_next_update_on_two(tmp_path: Path) -> None:
    """``shard_model``'s float64 model, 5 Adam steps on 3 ranks (shards 4:2:1, batch shares 5:5:2), saved; loaded
    into 2 ranks (shards and shares 1:1) over another initial model and learning rate: the full state dict is the
    saved one exactly, and one more step on each side gives the same parameters to 1e-12.  The full state dict
    rank 0 exported beside it loads into the plain model."""
    ckpt = str(tmp_path / "ckpt")
    (tmp_path / "save").mkdir()
    (tmp_path / "load").mkdir()
    saved = run_spawned_ranks(functools.partial(worker.model_save, SAVE_FRACTIONS, [5, 5, 2], 5, ckpt), 3,
                              tmp_path / "save", TIMEOUT_S, start_method="fork")
    loaded = run_spawned_ranks(functools.partial(worker.model_load, [1 / 2, 1 / 2], [6, 6], ckpt), 2,
                               tmp_path / "load", TIMEOUT_S, start_method="fork")
    assert loaded[0]["sizes"]["blocks.0"] == [81, 81]  # 6*12+12 + 12*6+6 elements, cut 1:1 (saved: 4:2:1)
    assert loaded[0]["extra"] == {"global_step": 5}
    for r in loaded:
        assert r["loaded"] == saved[0]["saved"]
    before, a, b = saved[0]["saved"], saved[0]["after"], loaded[0]["after"]
    assert set(a) == set(b) == set(before)
    exported = torch.load(ckpt + ".pt", weights_only=True)
    assert {k: v.flatten().tolist() for k, v in exported.items()} == before
    worker._Net().double().load_state_dict(exported)  # the original names and shapes (strict)
    diff = max(abs(x - y) for name in a for x, y in zip(a[name], b[name]))
    moved = max(abs(x - y) for name in a for x, y in zip(a[name], before[name]))
    assert diff <= 1e-12 < moved, (diff, moved)


@pytest.mark.usefixtures("one_rank_group")
def test_an_async_save_writes_the_state_of_its_call_not_what_training_does_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The files are held back until the shards and Adam's moments have been changed in place (as the next step
    would): what loads is the state at the ``save_sharded`` call."""
    import threading

    import torch.distributed.checkpoint as dcp

    model, opt = _one_rank_model()
    at_call = worker._record(model, opt, 0)
    changed = threading.Event()
    write_data = dcp.FileSystemWriter.write_data

    def held_back(self, plan, planner):
        assert changed.wait(TIMEOUT_S)
        return write_data(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", held_back)
    future = save_sharded(model, opt, tmp_path / "ckpt", async_save=True, extra={"n": 1})
    with torch.no_grad():
        for unit in model.units:
            unit.shard.add_(100.0)
            opt.state[unit.shard]["exp_avg"].add_(100.0)
    changed.set()
    future.result(timeout=TIMEOUT_S)
    fresh = worker.FlatModel([1.0], 0, fill=0.0)
    fresh_opt = worker.optimizer_for("adam", fresh, worker.LRS)
    assert load_sharded(fresh, fresh_opt, tmp_path / "ckpt") == {"n": 1}
    assert worker._record(fresh, fresh_opt, 0) == at_call != worker._record(model, opt, 0)
