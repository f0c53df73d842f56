"""The compressed hooks' two paths: chained on futures (NCCL) and run to completion (gloo and the rest).

This machine has no NCCL, so the chained path runs on gloo with ``exchange.overlaps`` patched to say yes, in
2-rank (flat) and 4-rank (2 emulated nodes x 2, hierarchical) runs whose model has a single DDP bucket: only one
bucket is ever in flight, so a collective launched from a gloo callback thread cannot interleave with another
bucket's (the hazard ``exchange.overlaps`` describes).  Both paths issue the same collectives and run the same
arithmetic in the same order, so their gradients, residuals and byte counts are compared bitwise.
"""

# no ``from __future__ import annotations``: DDP checks a hook's annotations as objects, not strings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from het_strategy.compression import CompressionState, compression_hook
from het_strategy.compression import exchange
from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups
from het_strategy.core.codecs import CODECS, Codec
from het_strategy.emulation.local_ranks import run_local_ranks
from tests._compression_worker import MixedNet
from tests.test_compression_hooks import _batches

PATHS = ("synchronous", "chained")
STEPS = 3  # error feedback, PowerSGD's warm start and the quantizer's chunk residuals carry across steps

# every codec family (the 1-D and small layers of each go through the ``none`` codec, chained like the rest),
# and one bucket whose layers go through six codecs (six groups chained one after another)
FLAT = {"fp16": {"method": "fp16"}, "bf16": {"method": "bf16"}, "q8": {"method": "q8"},
        "q4-stochastic": {"method": "q4", "stochastic_rounding": True}, "topk": {"method": "topk"},
        "powersgd": {"method": "powersgd"}, "mixed": {"method": "q4"}}
MIXED = {"module.fc1.weight": Codec.Q8, "module.fc2.weight": Codec.TOPK, "module.head.weight": Codec.POWERSGD,
         "module.fc1.bias": Codec.FP16, "module.fc2.bias": Codec.BF16, "module.norm.weight": Codec.Q4}
HIERARCHICAL = {"none": {"method": "none"}, "q4": {"method": "q4"}, "topk": {"method": "topk"},
                "powersgd": {"method": "powersgd"}}


def _train(rank: int, label: str, config: dict, chained: bool, hierarchical: bool) -> dict:
    """``STEPS`` backward passes of a single-bucket ``MixedNet``; the chained path forced by patching
    ``exchange.overlaps`` (this process only: ranks are forked)."""
    overlaps, chain, token_for = exchange.overlaps, exchange.chain, CompressionState.token_for
    chains = []

    def counted_chain(steps: Any, device: torch.device) -> torch.futures.Future:
        chains.append(device)
        return chain(steps, device)

    exchange.overlaps = lambda group: chained  # type: ignore[assignment]
    exchange.chain = counted_chain  # type: ignore[assignment]
    if label == "mixed":
        CompressionState.token_for = lambda self, name, grad: MIXED.get(name, Codec.NONE)  # type: ignore
    try:
        torch.manual_seed(0)
        model = DDP(MixedNet())  # ~13k parameters: one bucket, below DDP's first-bucket cap
        full = {"warmup_steps": 0, "verbose": False, **config}
        if hierarchical:
            state: Any = HierarchicalState(model, full, node_groups(2))
            base = hierarchical_hook
        else:
            state = CompressionState(model, full)
            base = compression_hook
        calls: list[dict] = []
        model.register_comm_hook(state, _recorded(base, calls))
        grads = []
        for x in _batches(rank, STEPS):
            model.zero_grad()
            model(x).square().mean().backward()
            grads.append({n: p.grad.clone() for n, p in model.module.named_parameters()})
        inter = state.inter if hierarchical else state
        return {"grads": grads, "calls": calls, "chains": len(chains), "bytes": state.bytes_sent,
                "residuals": {k: v.clone() for k, v in inter.residuals.items()},
                "chunk_residuals": {k: v.clone() for k, v in inter.chunk_residuals.items()}, "step": inter.step}
    finally:
        exchange.overlaps, exchange.chain, CompressionState.token_for = overlaps, chain, token_for


def _recorded(hook: Any, calls: list[dict]) -> Any:
    """``hook``, noting each bucket's index, whether it is the step's last and whether the returned future was
    already completed."""
    def recording(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(state, bucket)
        calls.append({"index": bucket.index(), "last": bucket.is_last(), "done": fut.done()})
        return fut

    return recording


def _both_paths(rank: int, world: int, runs: dict, hierarchical: bool) -> dict:
    return {label: {path: _train(rank, label, config, path == "chained", hierarchical) for path in PATHS}
            for label, config in runs.items()}


def _direct(rank: int, world: int) -> dict:
    """A one-layer model's first gradient through the hook on gloo, and the same gradient through the public
    synchronous exchanges (``allreduce_mean``, ``quantized_mean``, ``topk_mean``)."""
    out = {}
    for method in ("fp16", "q4", "topk"):
        torch.manual_seed(0)
        layer = torch.nn.Linear(64, 256, bias=False)
        own = torch.nn.Linear(64, 256, bias=False)
        own.load_state_dict(layer.state_dict())
        model = DDP(layer)
        state = CompressionState(model, {"method": method, "warmup_steps": 0, "verbose": False})
        calls: list[dict] = []
        model.register_comm_hook(state, _recorded(compression_hook, calls))
        x = _batches(rank, 1)[0].repeat(1, 2)
        model(x).square().mean().backward()
        own(x).square().mean().backward()
        flat, spec, cfg = own.weight.grad.reshape(-1), CODECS[Codec(method)], state.config
        if method == "topk":
            direct = exchange.topk_mean([flat], spec, cfg, dist.group.WORLD)[0][0]
        elif method == "q4":
            direct = exchange.quantized_mean(flat, spec, cfg, dist.group.WORLD).mean
        else:
            direct = exchange.allreduce_mean(flat, spec, cfg, dist.group.WORLD).mean
        out[method] = {"done": [c["done"] for c in calls], "hook": layer.weight.grad.reshape(-1).clone(),
                       "direct": direct}
    return out


@pytest.fixture(scope="module")
def flat_runs() -> list[dict]:
    return run_local_ranks(_both_paths, 2, FLAT, False)


@pytest.fixture(scope="module")
def hierarchical_runs() -> list[dict]:
    return run_local_ranks(_both_paths, 4, HIERARCHICAL, True)


def _assert_paths_equal(runs: list[dict], label: str) -> None:
    for rank, result in enumerate(runs):
        sync, chained = result[label]["synchronous"], result[label]["chained"]
        # one bucket per step, and its hook chained it (not on the synchronous path)
        assert [c["index"] for c in chained["calls"]] == [0] * STEPS and all(c["last"] for c in chained["calls"])
        assert sync["chains"] == 0 and chained["chains"] >= STEPS, (label, rank, chained["chains"])
        assert all(c["done"] for c in sync["calls"]), "off NCCL the hook's future is completed when it returns"
        for step, (a, b) in enumerate(zip(sync["grads"], chained["grads"])):
            for name in a:
                assert torch.equal(a[name], b[name]), (label, rank, step, name)
        for key in ("residuals", "chunk_residuals"):
            assert sync[key].keys() == chained[key].keys(), (label, key)
            assert all(torch.equal(sync[key][k], chained[key][k]) for k in sync[key]), (label, key)
        # (hierarchical: only leaders' inter-node states count steps)
        assert sync["bytes"] == chained["bytes"] and sync["step"] == chained["step"]
    for path in PATHS:  # and every replica holds the same gradients
        for step in range(STEPS):
            for name, grad in runs[0][label][path]["grads"][step].items():
                assert all(torch.equal(r[label][path]["grads"][step][name], grad) for r in runs[1:]), (label, name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(FLAT))
def test_chained_hook_equals_synchronous(flat_runs: list[dict], label: str) -> None:
    """compression_hook's chained path gives bitwise the synchronous path's gradients, error-feedback residuals
    and byte counts, for every codec family and for six codec groups chained in one bucket."""
    _assert_paths_equal(flat_runs, label)
    if label != "mixed":
        grads = flat_runs[0][label]["synchronous"]["grads"]
        assert any(float(g.norm()) > 0 for g in grads[-1].values())
    else:  # the error-feedback codecs' groups (q8, topk, q4) ran and kept their layers' residuals
        residuals = flat_runs[0][label]["chained"]["residuals"]
        assert {"module.fc1.weight", "module.fc2.weight", "module.norm.weight"} <= set(residuals)


@pytest.mark.multiprocess
@pytest.mark.parametrize("label", list(HIERARCHICAL))
def test_chained_hierarchical_hook_equals_synchronous(hierarchical_runs: list[dict], label: str) -> None:
    """hierarchical_hook on 2 nodes x 2 ranks: reduce -> leaders' exchange -> broadcast chained gives bitwise
    the synchronous path's gradients."""
    _assert_paths_equal(hierarchical_runs, label)


@pytest.mark.multiprocess
def test_gloo_future_is_completed_with_the_synchronous_exchanges_result() -> None:
    """On gloo the hook's future is completed when it returns, holding what the public synchronous exchange
    gives for the same gradient (bitwise)."""
    for rank in run_local_ranks(_direct, 2):
        for method, got in rank.items():
            assert got["done"] == [True], method
            assert torch.equal(got["hook"], got["direct"]), method


def _steps(log: list, futures: list[torch.futures.Future]):  # type: ignore[no-untyped-def]
    for i, fut in enumerate(futures):
        log.append(f"launch {i}")
        log.append(f"finish {i}: {(yield fut)}")
    return "result"


def test_chain_launches_each_step_from_the_previous_future() -> None:
    """``chain``: the first step runs at once, each later one only when the future before it completes (from its
    ``then``), and the result future completes after the last; ``settle`` runs the same steps in the same
    order, waiting."""
    futures = [torch.futures.Future() for _ in range(2)]
    log: list = []
    result = exchange.chain(_steps(log, futures), torch.device("cpu"))
    assert log == ["launch 0"] and not result.done()
    futures[0].set_result(10)
    assert log == ["launch 0", "finish 0: 10", "launch 1"] and not result.done()
    futures[1].set_result(11)
    assert result.done() and result.wait() == "result"
    settled: list = []
    done = [torch.futures.Future() for _ in range(2)]
    for value, fut in zip((10, 11), done):
        fut.set_result(value)
    assert exchange.settle(_steps(settled, done)) == "result" and settled == log


def test_chain_passes_a_failed_collective_to_its_result() -> None:
    futures = [torch.futures.Future() for _ in range(2)]
    log: list = []
    result = exchange.chain(_steps(log, futures), torch.device("cpu"))
    futures[0].set_exception(RuntimeError("connection reset"))
    assert log == ["launch 0"]  # the later step never launched
    with pytest.raises(RuntimeError, match="connection reset"):
        result.wait()


@pytest.mark.parametrize("backend,chains", [("nccl", True), ("gloo", False), ("mpi", False)])
def test_only_nccl_chains(monkeypatch: pytest.MonkeyPatch, backend: str, chains: bool) -> None:
    """``overlaps`` decides by the group's backend; ``run_steps`` returns an already completed future off NCCL."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert exchange.overlaps(None) is chains  # type: ignore[arg-type]
    futures = [torch.futures.Future() for _ in range(2)]
    if not chains:
        for fut in futures:
            fut.set_result(0)
    result = exchange.run_steps(_steps([], futures), None, torch.device("cpu"))  # type: ignore[arg-type]
    assert result.done() is not chains
