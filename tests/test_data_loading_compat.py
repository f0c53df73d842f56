"""Lightning's data-loading contracts under ``hetero``: each case runs under ``ddp`` and under ``hetero`` on two
equal CPU devices and must train on the same data with the same result.

On equal devices the hetero split gives each rank half of every global batch, as DDP's sampler does, but a
contiguous half rather than every other sample: the ranks' own indices differ, so the tests compare what
decides the update — the samples of every step over all ranks, each rank's batch shapes, the final
parameters — and, where the user shards the data (``use_distributed_sampler=False``), each rank's own samples.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from tests._data_compat_cases import EVAL_CASES, N, run_case  # noqa: E402

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("fresh_master_port"),
              pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")]


def _steps(ranks: list[dict]) -> list[tuple[int, int, list[int]]]:
    """(epoch, step, sorted indices over all ranks) of every training step."""
    merged: dict[tuple[int, int], list[int]] = {}
    for record in ranks:
        for row in record["rows"]:
            merged.setdefault((row["epoch"], row["step"]), []).extend(row["indices"])
    return [(e, s, sorted(ix)) for (e, s), ix in sorted(merged.items())]


def _shapes(ranks: list[dict]) -> list[list[list[int]]]:
    return [[row["shape"] for row in record["rows"]] for record in ranks]


def _same_training(ddp: list[dict], hetero: list[dict]) -> None:
    assert _steps(hetero) == _steps(ddp)
    assert _shapes(hetero) == _shapes(ddp)
    for mine, theirs in zip(hetero, ddp):
        for a, b in zip(mine["params"], theirs["params"]):
            assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


def _both(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[dict], list[dict]]:
    from het_strategy.emulation.local_ranks import free_port

    ddp = run_case(case, "ddp", tmp_path / "ddp")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    return ddp, run_case(case, "hetero", tmp_path / "hetero")


def test_own_shards_with_use_distributed_sampler_false_are_trained_as_given(tmp_path, monkeypatch) -> None:
    ddp, hetero = _both("own_shards", tmp_path, monkeypatch)
    for rank, record in enumerate(hetero):
        seen = sorted(i for row in record["rows"] if row["epoch"] == 0 for i in row["indices"])
        assert seen == list(range(rank * N // 2, (rank + 1) * N // 2))  # its whole shard, nothing else
    _same_training(ddp, hetero)


def test_a_dataloader_subclass_keeps_its_class_and_methods(tmp_path, monkeypatch) -> None:
    ddp, hetero = _both("subclass", tmp_path, monkeypatch)
    for record in hetero:
        assert record["info"] == {"loader_class": "TaggedLoader", "describe": "tagged:mine"}
    _same_training(ddp, hetero)


def test_a_bucketing_batch_sampler_is_kept_and_uses_every_sample_once(tmp_path, monkeypatch) -> None:
    ddp, hetero = _both("bucketing", tmp_path, monkeypatch)
    for epoch in (0, 1):
        seen = sorted(i for r in hetero for row in r["rows"] if row["epoch"] == epoch for i in row["indices"])
        assert seen == list(range(N))
    for record in hetero:  # the user's sampler ordered each batch (longest first)
        assert all(row["indices"] == sorted(row["indices"], key=lambda i: (-(i % 5), i)) for row in record["rows"])
    _same_training(ddp, hetero)


def test_one_cycle_lr_sized_from_estimated_stepping_batches(tmp_path, monkeypatch) -> None:
    ddp, hetero = _both("one_cycle", tmp_path, monkeypatch)
    assert [r["info"]["estimated_in_configure_optimizers"] for r in hetero] == [8, 8]  # 2 epochs x 32 / 8
    assert [r["info"]["estimated_in_configure_optimizers"] for r in ddp] == [8, 8]
    _same_training(ddp, hetero)


@pytest.mark.parametrize("case", ["fixed_size", "datamodule", "combined_max_size_cycle", "combined_max_size", "overfit_batches",
                                  "limit_train_batches"])
def test_lightning_data_loading_examples_train_as_under_ddp(case, tmp_path, monkeypatch) -> None:
    """(``fixed_size``: a batch sampler that fixes its batch size runs in whole batches, here one per rank.)"""
    ddp, hetero = _both(case, tmp_path, monkeypatch)
    _same_training(ddp, hetero)


def _same_evaluation(ddp: list[dict], hetero: list[dict]) -> None:
    """Each rank's evaluation as under DDP: its loaders' samplers (class, shuffle, seed, replicas, rank,
    drop_last), the samples it evaluated in each step, and the synced metrics of every validation and test."""
    for mine, theirs in zip(hetero, ddp):
        for record_mine, record_theirs in ((mine, theirs), (mine["test"], theirs["test"])):
            assert record_mine["val_rows"] == record_theirs["val_rows"]
            for stage in ("val", "test"):
                assert record_mine["info"].get(f"{stage}_samplers") == record_theirs["info"].get(f"{stage}_samplers")
                got, want = record_mine["info"].get(f"{stage}_metrics"), record_theirs["info"].get(f"{stage}_metrics")
                assert (got is None) == (want is None)
                for a, b in zip(got or [], want or []):
                    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-12) for k in a)
        assert mine["test"]["info"]["test_samplers"]  # trainer.test ran and recorded its loaders


def _evaluated(ranks: list[dict], stage: str = "val") -> dict[tuple[int, int], list[int]]:
    """(epoch, loader) -> the sorted samples every rank evaluated in it."""
    out: dict[tuple[int, int], list[int]] = {}
    for record in ranks:
        for row in (record if stage == "val" else record["test"])["val_rows"]:
            if row["stage"] == stage:
                out.setdefault((row["epoch"], row["loader"]), []).extend(row["indices"])
    return {k: sorted(v) for k, v in out.items()}


def test_a_validation_loader_keeps_its_shuffle_as_under_ddp(tmp_path, monkeypatch) -> None:
    """``val_dataloader(shuffle=True)``: DDP's ``DistributedSampler`` with ``shuffle=True`` on every rank, the same
    samples per rank and the same ``sync_dist`` loss."""
    ddp, hetero = _both("val_shuffle", tmp_path, monkeypatch)
    _same_evaluation(ddp, hetero)
    assert [r["info"]["val_samplers"][0]["shuffle"] for r in hetero] == [True, True]
    assert [r["info"]["val_samplers"][0]["rank"] for r in hetero] == [0, 1]
    _same_training(ddp, hetero)


def test_overfit_batches_evaluate_on_ddp_samplers_without_shuffling(tmp_path, monkeypatch) -> None:
    """``overfit_batches=2`` with a shuffled validation loader: Lightning turns the shuffle off and gives it a
    distributed sampler, under ``hetero`` as under ``ddp``."""
    ddp, hetero = _both("val_overfit", tmp_path, monkeypatch)
    _same_evaluation(ddp, hetero)
    assert {(s["class"], s["shuffle"]) for r in hetero for s in r["info"]["val_samplers"]} == {
        ("DistributedSampler", False)}
    _same_training(ddp, hetero)


@pytest.mark.parametrize("mode", ["max_size_cycle", "max_size", "min_size"])
def test_a_combined_loader_evaluates_with_a_distributed_sampler_per_loader(mode, tmp_path, monkeypatch) -> None:
    """``CombinedLoader`` in validation and test: each of its loaders gets DDP's distributed sampler (rank r of
    2), so the ranks evaluate disjoint halves, and the synced losses are DDP's."""
    ddp, hetero = _both(f"combined_eval_{mode}", tmp_path, monkeypatch)
    _same_evaluation(ddp, hetero)
    for rank, record in enumerate(hetero):
        assert [(s["class"], s["rank"], s["num_replicas"]) for s in record["info"]["val_samplers"]] == [
            ("DistributedSampler", rank, 2)] * 2


def test_a_dataloader_subclass_with_an_unstored_argument_is_rebuilt_from_its_call(tmp_path, monkeypatch) -> None:
    """``FeatureLoader(data, 4, batch_size=4)`` only checks ``num_features`` and keeps no attribute of it: its
    training loader is built again from the call Lightning made (the same class), and it trains and evaluates as
    under DDP."""
    ddp, hetero = _both("subclass_unstored", tmp_path, monkeypatch)
    _same_training(ddp, hetero)
    _same_evaluation(ddp, hetero)


def test_evaluation_under_uneven_training_shares_is_ddp_s(tmp_path, monkeypatch) -> None:
    """Training shares 6 : 2 (speeds 3 : 1): validation still splits evenly as DDP does, each validation sample is
    evaluated exactly once across the ranks, and the synced validation loss equals DDP's (the update is exact)."""
    from het_strategy.emulation.local_ranks import free_port
    from tests._data_compat_cases import FAST_SLOW_CLUSTER

    ddp = run_case("uneven_val", "ddp", tmp_path / "ddp")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    hetero = run_case("uneven_val", "hetero", tmp_path / "hetero", cluster=FAST_SLOW_CLUSTER)
    assert {tuple(row["shape"]) for row in hetero[0]["rows"]} == {(6, 4)}  # the uneven training split
    _same_evaluation(ddp, hetero)
    assert _evaluated(hetero) == {(e, 0): list(range(N)) for e in (0, 1)}
    assert _evaluated(hetero, "test") == {(0, 0): list(range(N))}


def test_a_sequential_combined_loader_validates_every_sample_once(tmp_path, monkeypatch) -> None:
    """``CombinedLoader(mode="sequential")`` (evaluation only in Lightning): each loader's samples over all ranks
    once per validation, as DDP's are (its sizes are multiples of the world, so DDP repeats none)."""
    ddp, hetero = _both("combined_sequential", tmp_path, monkeypatch)
    _same_evaluation(ddp, hetero)
    assert _evaluated(hetero) == {(e, 0): list(range(N)) for e in (0, 1)} | {
        (e, 1): list(range(N // 2)) for e in (0, 1)}


@pytest.mark.parametrize("case", ["own_shards", "subclass", "bucketing", "subclass_unstored", "val_shuffle"])
def test_the_same_holds_on_pytorch_lightning(case, tmp_path, monkeypatch) -> None:
    pytest.importorskip("pytorch_lightning")
    from het_strategy.emulation.local_ranks import free_port

    ddp = run_case(case, "ddp", tmp_path / "ddp", package="pytorch_lightning")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    hetero = run_case(case, "hetero", tmp_path / "hetero", package="pytorch_lightning")
    _same_training(ddp, hetero)
    if case in EVAL_CASES:
        _same_evaluation(ddp, hetero)
    if case == "subclass":
        assert all(r["info"]["describe"] == "tagged:mine" for r in hetero)


def test_shards_built_from_planned_batch_size_train_the_exact_update(tmp_path) -> None:
    """With ``use_distributed_sampler=False`` on unequal devices (3 : 1), ranks that size their own shards with
    ``planned_batch_size()`` train 6 and 2 samples a step, and the weighted update is the single-process one."""
    import torch

    from tests._data_compat_cases import FAST_SLOW_CLUSTER
    from tests._strategy_worker import IndexedData, make_net

    hetero = run_case("planned_shards", "hetero", tmp_path / "hetero", cluster=FAST_SLOW_CLUSTER)
    assert [r["info"]["planned_batch_size"] for r in hetero] == [6, 2]
    assert {tuple(row["shape"]) for row in hetero[0]["rows"]} == {(6, 4)}
    assert {tuple(row["shape"]) for row in hetero[1]["rows"]} == {(2, 4)}
    data, net = IndexedData(N), make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _, _, indices in _steps(hetero):
        opt.zero_grad()
        (net(data.x[indices]).squeeze(-1) - data.y[indices]).pow(2).mean().backward()
        opt.step()
    for mine, ref in zip(hetero[0]["params"], [p.detach().flatten().tolist() for p in net.parameters()]):
        assert mine == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_own_shards_of_different_lengths_are_refused_instead_of_hanging(tmp_path) -> None:
    with pytest.raises(Exception, match=r"`train_dataloader` is 'batches per rank \[4, 2\]'.*same steps"):
        run_case("uneven_shards", "hetero", tmp_path / "hetero")
