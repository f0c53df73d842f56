"""The emulated memory meter: a tiny model's counted bytes against a count by hand, the peak, the cap's error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.emulation.memory_cap import EmulatedOutOfMemoryError, MemoryMeter
from het_strategy.fsdp import shard_model

F64 = 8  # bytes per float64 element
BATCH = 5


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def test_plain_model_counted_by_hand() -> None:
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(params=model.parameters(), optimizer=optimizer)
    params = (8 * 16 + 16 + 16 * 4 + 4) * F64
    # saved for backward: the input (first linear), tanh's output (tanh, and the second linear's input: one
    # storage), the output (pow); the linears' weights are parameters, counted there
    acts = (BATCH * 8 + BATCH * 16 + BATCH * 4) * F64
    adam = 2 * params + 4 * 4  # exp_avg and exp_avg_sq per parameter, a float32 step per tensor
    x = torch.randn(BATCH, 8, dtype=torch.float64)
    for step in range(2):
        with meter.track():
            loss = model(x).pow(2).sum()
        assert meter.parts() == {"parameters": params, "gradients": 0, "optimizer": adam if step else 0,
                                 "gathered": 0, "collectives": 0, "activations": acts}
        loss.backward()
        assert meter.activation_bytes == 0  # the backward released every saved tensor
        optimizer.step()
        optimizer.zero_grad()
    # the largest count: after a step, with gradients and Adam's state (the step's post-hook took it)
    assert meter.peak_bytes == 2 * params + adam
    assert meter.peak_parts["gradients"] == params
    meter.reset_peak()
    assert meter.peak_bytes == params + adam  # gradients dropped by zero_grad


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_model_gathered_units_and_activations_by_hand(one_rank_group) -> None:
    torch.manual_seed(0)
    model = _Net().double()
    sharded = shard_model(model, list(model.blocks), [1.0], rank=0, world=1)
    optimizer = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(sharded=sharded, optimizer=optimizer)
    root, block = (4 * 8 + 8 + 8 * 2 + 2) * F64, (8 * 8 + 8) * F64
    x = torch.randn(BATCH, 4, dtype=torch.float64)
    with meter.track():
        loss = sharded(x).pow(2).sum()
    # after the forward: the root stays gathered, the last block is gathered again for the backward (prefetch);
    # saved: the input, the root's first output, each block's tanh output (the next layer's input), the output
    parts = meter.parts()
    assert parts["parameters"] == root + 3 * block
    assert parts["gathered"] == root + block
    assert parts["collectives"] == 0  # the prefetch sends the shard itself (one rank: nothing padded)
    assert parts["activations"] == (BATCH * 4 + BATCH * 8 + 3 * BATCH * 8 + BATCH * 2) * F64
    loss.backward()
    # in the backward: the root, the block being differentiated, its whole gradient (before its reduce-scatter)
    # and the block prefetched before it; in flight, the next block's reduce-scatter: its gradient and its output
    assert meter.peak_parts["gathered"] == root + 3 * block
    assert meter.peak_parts["collectives"] == 2 * block
    assert meter.parts()["gathered"] == meter.parts()["collectives"] == 0 and meter.activation_bytes == 0
    assert meter.parts()["gradients"] == root + 3 * block


def _cluster(memory_gb: float):
    return cluster_from_dict({"name": "cap", "inter_node_bandwidth_gbs": 1, "nodes": [
        {"name": "n", "intra_bandwidth_gbs": 1, "devices": [
            {"name": name, "type": "CPU", "tflops": {"fp32": 0.01}, "memory_gb": mem, "efficiency": 1.0}
            for name, mem in (("big", 1.0), ("t4-emu", memory_gb))]}]})


def test_cap_error_names_rank_device_need_and_cap() -> None:
    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters())
    params = (8 * 16 + 16 + 16 * 4 + 4) * F64
    cap = 0.002 * 2**30  # 2.05 MiB: the parameters fit, the activations of 10000 samples (224 bytes each) do not
    meter = MemoryMeter.for_device(_cluster(cap / 2**30), "t4-emu", rank=2, params=model.parameters(),
                                   optimizer=optimizer)
    assert meter.cap_bytes == pytest.approx(cap)
    x = torch.randn(10000, 8, dtype=torch.float64)
    with pytest.raises(EmulatedOutOfMemoryError) as info, meter.track():
        model(x).pow(2).sum()
    err = info.value
    assert isinstance(err, torch.OutOfMemoryError)
    assert (err.rank, err.device, err.cap_bytes) == (2, "t4-emu", pytest.approx(cap))
    assert cap < err.need_bytes <= params + 10000 * (8 + 16 + 4) * F64
    assert str(err).startswith(f"emulated out of memory: rank 2 (t4-emu) needs {err.need_bytes / 2**20:.2f} MiB, "
                               "its emulated memory is 2.05 MiB (parameters ")
    # 1000 samples fit under the same cap
    fits = MemoryMeter.for_device(_cluster(cap / 2**30), "t4-emu", rank=2, params=model.parameters())
    with fits.track():
        model(x[:1000].clone()).pow(2).sum().backward()  # a view of x would keep all of x saved
    assert fits.peak_bytes == params + 1000 * (8 + 16 + 4) * F64 <= cap


def test_cap_must_be_positive() -> None:
    with pytest.raises(Exception, match="memory_cap.cap_bytes"):
        MemoryMeter(cap_bytes=0)


@pytest.mark.multiprocess
def test_uneven_shards_count_the_prefetched_gathers_padded_buffers() -> None:
    from het_strategy.emulation.local_ranks import run_local_ranks
    from tests._memory_cap_worker import counted_after_forward

    results = run_local_ranks(counted_after_forward, 2, [0.75, 0.25], timeout_s=60)
    root, block = 4 * 8 + 8 + 8 * 2 + 2, 8 * 8 + 8
    assert results[0]["sizes"]["root"] == [44, 14] and results[0]["sizes"]["blocks.0"] == [54, 18]
    for rank, res in enumerate(results):
        parts = res["after_forward"]
        assert parts["parameters"] == ([44, 14][rank] + 3 * [54, 18][rank]) * F64
        assert parts["gathered"] == (root + block) * F64  # the root, the last block (its gather in flight)
        # that gather's buffers on every rank: this rank's piece padded to the largest (54) and 2 x 54 received
        assert parts["collectives"] == (54 + 2 * 54) * F64
        assert res["after_backward"]["collectives"] == res["after_backward"]["gathered"] == 0
