"""``shard_model`` on 3 gloo ranks, float64: shards by memory (4/7, 2/7, 1/7, or one rank holding nothing),
shares by speed (4, 4, 2 of a batch of 10), 5 steps equal one process's to 1e-10, with prefetch on and off,
activation checkpointing, micro-batches and Adam; the full state dict is the reference's ``state_dict()``."""

from __future__ import annotations

import _fsdp_worker as worker
import pytest
import torch
from torch import nn

from het_strategy.core.errors import ConfigError
from het_strategy.core.shard_sizes import shard_sizes
from het_strategy.emulation.local_ranks import run_local_ranks
from het_strategy.fsdp import FLAT_SHARD, ROOT_UNIT, shard_model

WORLD = 3


CLIP = 0.05
"""A gradient norm the steps exceed (so clipping changes them)."""


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, float | None, bool], dict[str, torch.Tensor]]:
    # computed before the ranks fork: they inherit the optimizers' lazily imported modules
    return {(opt, clip, frozen): worker.reference(opt, clip=clip, frozen=frozen)
            for opt in ("sgd", "adam") for clip in (None, CLIP) for frozen in (False, True)}


def _max_diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - ref[k]).abs().max()) for k in ref)


@pytest.mark.multiprocess
@pytest.mark.parametrize("opt, fractions, prefetch, checkpoint, micro_batches, clip, frozen, pattern, sync", [
    ("sgd", worker.FRACTIONS, True, False, 1, None, False, "fb", False),
    ("sgd", worker.FRACTIONS, False, False, 1, None, False, "fb", True),
    ("adam", worker.FRACTIONS, True, True, 2, None, False, "fb", False),
    ("sgd", [0.5, 0.5, 0.0], True, True, 1, CLIP, False, "fb", False),
    ("adam", worker.FRACTIONS, True, False, 2, None, True, "ffbb", False),
], ids=["sgd-prefetch", "sgd-no-prefetch-rank0-values", "adam-checkpoint-micro2", "sgd-empty-rank-clipped",
        "adam-frozen-block-forwards-then-backwards"])
def test_sharded_training_equals_one_process(references, opt, fractions, prefetch, checkpoint, micro_batches,
                                             clip, frozen, pattern, sync) -> None:
    ref = references[opt, clip, frozen]
    got = run_local_ranks(worker.train, WORLD, opt, fractions, prefetch, checkpoint, micro_batches, torch.float64,
                          None, clip, frozen, pattern, sync, timeout_s=60)
    for rank, r in enumerate(got):
        full = r["full_everywhere"]
        assert list(full) == list(ref)  # the original names, in state_dict order
        assert all(full[k].shape == ref[k].shape and full[k].dtype == ref[k].dtype for k in ref)
        assert _max_diff(full, ref) < 1e-10, rank
        # only the shards are parameters, cut by the planner's rule
        assert r["names"] == [FLAT_SHARD] + [f"blocks.{i}.{FLAT_SHARD}" for i in range(3)]
        assert r["shard_numels"] == [r["sizes"][u][rank] for u in [ROOT_UNIT, "blocks.0", "blocks.1", "blocks.2"]]
        assert r["sizes"]["blocks.0"] == shard_sizes(2 * 8 * 16 + 16 + 8, fractions)
        assert r["sizes"][ROOT_UNIT] == shard_sizes(5 * 8 + 8 + 8 * 2 + 2, fractions)
        # between forward and backward: the root and (prefetch) the backward's first block are gathered
        held = r["held_after_forward"]
        assert held[ROOT_UNIT] > 0 and held["blocks.0"] == held["blocks.1"] == 0
        assert (held["blocks.2"] > 0) == prefetch
        # after the backward and after an evaluation forward nothing is (a frozen block included)
        assert all(v == 0 for v in r["held_after_step"].values())
        assert all(v == 0 for v in r["held_after_eval"].values())
        assert all(state == "free" for state in r["states"].values())
        passes = worker.STEPS * micro_batches
        if pattern == "fb":
            # per pass 7 gathers (root, 3 blocks forward, 3 backward), the 6 of blocks prefetched; eval 4 (3)
            assert r["num_gathers"] == 7 * passes + 4
            assert r["num_prefetched"] == (6 * passes + 3 if prefetch else 0)
        assert r["comm_wait_s"] > 0
        # 3 block forwards per pass, recomputed in the backward when checkpointed; 3 more for the eval pass
        assert r["block_forward_calls"] == 3 * passes * (2 if checkpoint else 1) + 3
        if clip is not None:  # the whole model's norm, the same on every rank, above the bound at every step
            assert r["norms"] == got[0]["norms"] and min(r["norms"]) > clip
    assert got[0]["full_rank0"].keys() == ref.keys() and _max_diff(got[0]["full_rank0"], ref) < 1e-10
    assert got[1]["full_rank0"] == {} and got[2]["full_rank0"] == {}


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.b.weight = self.a.weight


def _shard_one(model: nn.Module, units) -> None:
    shard_model(model, units, [1.0], 0, 1)


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch):
    """A one-rank gloo group in this process (the autouse fixture of conftest destroys it afterwards)."""
    from het_strategy.emulation.local_ranks import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield


def test_without_a_process_group_the_error_says_so() -> None:
    with pytest.raises(ConfigError, match="`shard_model.group` is null; it must belong to an initialized"):
        _shard_one(worker.build_model(), ["blocks.0"])


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("units, message", [
    (["nope"], "`shard_model.units[0]` is 'nope'; it must name a submodule"),
    (["blocks", "blocks.0"], "`shard_model.units[1]` is 'blocks.0'; it must be distinct from and not nested"),
    ([""], "`shard_model.units[0]` is ''; it must be a block below the top module"),
])
def test_bad_units_name_the_field_and_rule(units, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _shard_one(worker.build_model(), units)


@pytest.mark.usefixtures("one_rank")
def test_a_parameter_tied_across_units_is_refused() -> None:
    with pytest.raises(ConfigError, match="not share a parameter between two units"):
        _shard_one(_Tied(), ["a", "b"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("model_dtype, param_dtypes, wire, tolerance", [
    # per-device precision: rank 0 computes in float32, the others in float64: gathered in the master dtype
    (torch.float64, [torch.float32, torch.float64, torch.float64], ("torch.float64", "torch.float64"), 1e-6),
    # every rank in bf16: gathered in bf16, reduced in fp32, fp32 master shards
    (torch.float32, [torch.bfloat16] * 3, ("torch.bfloat16", "torch.float32"), 1e-2),
], ids=["per-device-fp32-fp64", "bf16-everywhere"])
def test_mixed_precision_computes_in_each_ranks_dtype_and_keeps_master_shards(model_dtype, param_dtypes, wire,
                                                                              tolerance) -> None:
    ref = worker.reference("sgd", model_dtype)
    got = run_local_ranks(worker.train, WORLD, "sgd", worker.FRACTIONS, True, False, 1, model_dtype, param_dtypes,
                          timeout_s=60)
    for rank, r in enumerate(got):
        assert r["compute_dtype"] == str(param_dtypes[rank])
        assert r["shard_dtypes"] == r["grad_dtypes"] == [str(model_dtype)]
        assert r["wire_dtypes"] == [wire]
    full = got[0]["full_rank0"]
    assert all(full[k].dtype == model_dtype for k in ref)
    assert 0 < _max_diff(full, ref) < tolerance  # the lower precision is visible, and only as rounding


class _TiedInRoot(nn.Module):
    """An embedding tied to the output layer (both in the root), around one block."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.block = nn.Linear(4, 4)
        self.out = nn.Linear(4, 7, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.block(self.embed(tokens))))


@pytest.mark.usefixtures("one_rank")
def test_weights_tied_within_a_unit_train_as_one_and_export_under_both_names() -> None:
    def build() -> _TiedInRoot:
        torch.manual_seed(3)
        return _TiedInRoot().double()

    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ref, model = build(), build()
    sharded = shard_model(model, ["block"], [1.0], 0, 1)
    assert sharded.root.param_names == ["embed.weight"] and sharded.root.aliases == {"out.weight": 0}
    for m in (ref, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(3):
            optimizer.zero_grad()
            m(tokens).logsumexp(-1).mean().backward()
            optimizer.step()
    full = sharded.full_state_dict()
    assert list(full) == list(ref.state_dict())
    assert all(torch.allclose(full[k], v, rtol=0, atol=1e-12) for k, v in ref.state_dict().items())
    assert not torch.equal(full["embed.weight"], build().embed.weight)  # it trained
