"""HeteroMoE: routing, bad input, and multi-rank runs equal to a single-process reference holding every expert."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from het_strategy.core.errors import ConfigError
from het_strategy.emulation.local_ranks import run_local_ranks
from het_strategy.moe import HeteroMoE, check_placement, placements_from_plan, prepare_for_ddp
from het_strategy.moe.gating import expert_capacity, route_tokens

HIDDEN, EXPERTS_SEED = 6, 1234


def _expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 10), nn.GELU(), nn.Linear(10, HIDDEN))


def _layer(num_experts: int, placement=None, **kw) -> HeteroMoE:
    torch.manual_seed(7)  # the gate's weights
    return HeteroMoE(HIDDEN, _expert, num_experts=num_experts, placement=placement, expert_seed=EXPERTS_SEED,
                     **kw).double()


def _tokens(rank: int, n: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 3, HIDDEN, generator=g, dtype=torch.float64)


def _naive(layer: HeteroMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, every expert local: sum_j weight_j x expert_j(x_t)."""
    flat = x.reshape(-1, HIDDEN)
    cap = expert_capacity(flat.shape[0], layer.num_experts, layer.k, layer.capacity_factor, layer.min_capacity) \
        if layer.drop_tokens else None
    routing = route_tokens(layer.gate(flat), layer.k, cap)
    rows = []
    for t in range(flat.shape[0]):
        row = torch.zeros(HIDDEN, dtype=flat.dtype)
        for j in range(layer.k):
            if routing.kept[t, j]:
                row = row + routing.weight[t, j] * layer.experts[str(int(routing.expert[t, j]))](flat[t])
        rows.append(row)
    return torch.stack(rows).reshape(x.shape), routing.aux_loss


# -- single process --------------------------------------------------------------------------------
@pytest.mark.parametrize("drop, dispatch", [(False, "exact"), (True, "exact"), (True, "capacity")])
def test_one_process_layer_equals_token_by_token_reference(drop: bool, dispatch: str) -> None:
    layer = _layer(5, k=2, capacity_factor=0.5, min_capacity=0, drop_tokens=drop, dispatch=dispatch)
    x = _tokens(0)
    out, aux, counts = layer(x)
    ref, ref_aux = _naive(layer, x)
    assert torch.allclose(out, ref, rtol=0, atol=1e-12) and torch.allclose(aux, ref_aux, rtol=0, atol=1e-14)
    kept = int(counts.sum())
    assert (kept < 2 * x.shape[0] * x.shape[1]) == drop  # capacity 0.5 drops choices only when asked


def test_capacity_drops_later_tokens_first_choices_before_second() -> None:
    # 4 tokens all preferring expert 0 then expert 1; capacity 2 per expert
    logits = torch.tensor([[3.0, 2.0, 0.0]] * 4)
    r = route_tokens(logits, 2, capacity=2)
    assert r.kept[:, 0].tolist() == [True, True, False, False]  # expert 0 takes the first two tokens
    # expert 1's slots: first choices (none) then second choices in token order: tokens 0, 1 fit
    assert r.kept[:, 1].tolist() == [True, True, False, False]
    assert torch.allclose(r.weight[2], torch.zeros(2))
    assert math.isclose(float(r.weight[0].sum()), 1.0, rel_tol=1e-6)
    # GShard's loss: E x sum(mean gate x fraction routed first) = 3 x p0 x 1 for identical tokens
    p0 = torch.softmax(logits[0], 0)[0]
    assert math.isclose(float(r.aux_loss), 3 * float(p0), rel_tol=1e-6)


def test_expert_weights_depend_on_its_id_not_on_where_it_lives() -> None:
    a = _layer(4, placement=[[0, 1, 2, 3]])
    b = _layer(4, placement=[[3, 1, 0, 2]])
    for e in range(4):
        for pa, pb in zip(a.experts[str(e)].parameters(), b.experts[str(e)].parameters()):
            assert torch.equal(pa, pb)
    assert all(getattr(p, "het_expert", False) and p.allreduce is False for p in a.expert_parameters())


@pytest.mark.parametrize("placement, world, message", [
    ([[0, 1], [2]], 2, "missing [3]"),
    ([[0, 1], [1, 2, 3]], 2, "expert 1 is also on rank 0"),
    ([[0, 1, 2, 3], []], 2, "hold at least one expert"),
    ([[0, 1, 2, 9]], 1, "expert ids in 0..3"),
    ([[0, 1, 2, 3]], 2, "one expert-id list per rank"),
])
def test_bad_placements_name_the_field_value_and_rule(placement, world, message) -> None:
    with pytest.raises(ConfigError, match="moe.placement") as err:
        check_placement(placement, 4, world, "moe.placement")
    assert message in str(err.value)


def test_bad_layer_arguments_fail_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"`moe.k` is 5; it must be <= moe.num_experts \(4\)"):
        HeteroMoE(HIDDEN, _expert, num_experts=4, k=5)
    with pytest.raises(ConfigError, match="moe.placement"):
        HeteroMoE(HIDDEN, _expert, num_experts=4, placement=[[0, 1, 1, 2]])
    with pytest.raises(ConfigError, match="moe.noisy_gate_policy"):
        HeteroMoE(HIDDEN, _expert, num_experts=4, noisy_gate_policy="gumbel")
    with pytest.raises(ConfigError, match="moe.dispatch"):
        HeteroMoE(HIDDEN, _expert, num_experts=4, drop_tokens=False, dispatch="capacity")
    with pytest.raises(ConfigError, match="plan.experts"):
        placements_from_plan({3: {"a": [0, 1], "b": [2]}}, ["a", "b"], [4])


def test_placement_change_after_training_is_refused() -> None:
    layer = _layer(2, k=1)
    layer.train()
    layer(_tokens(0))[0].sum().backward()
    with pytest.raises(ConfigError, match="cannot change after training steps"):
        layer.place([[1, 0]])


# -- several ranks ---------------------------------------------------------------------------------
def _ranks_fn(rank: int, world: int, placement, drop: bool, k: int, dispatch: str) -> dict:
    layer = _layer(sum(len(p) for p in placement), placement=placement, k=k, capacity_factor=0.6,
                   min_capacity=0, drop_tokens=drop, dispatch=dispatch)
    layer.train()
    x = _tokens(rank, n=6 + 3 * rank).requires_grad_()  # uneven token counts per rank too
    out, aux, counts = layer(x)
    loss = (out * torch.linspace(-1, 1, HIDDEN, dtype=out.dtype)).pow(2).sum() + 0.1 * aux
    loss.backward()
    return {"out": out.detach(), "aux": aux.detach(), "x_grad": x.grad, "gate_grad": layer.gate.weight.grad,
            "experts": {e: [p.grad for p in layer.experts[str(e)].parameters()] for e in layer.local_experts}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("placement, drop, k, dispatch", [
    ([[0, 1, 2], [3]], False, 2, "exact"),
    ([[0, 1], [2], [3]], True, 2, "exact"),
    ([[0, 1], [2], [3]], True, 2, "capacity"),
    ([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13], [14, 15]], True, 2, "capacity"),
    ([[3, 0, 5, 1, 4, 2], [11, 6, 7, 8, 9, 10], [12, 15], [14, 13]], False, 1, "exact"),
])
def test_ranks_equal_single_process_reference(placement, drop: bool, k: int, dispatch: str) -> None:
    """Outputs, aux loss and all gradients; with drops the reference drops the same choices (per-rank capacity)."""
    world = len(placement)
    got = run_local_ranks(_ranks_fn, world, placement, drop, k, dispatch, timeout_s=120)
    num_experts = sum(len(p) for p in placement)
    ref = _layer(num_experts, k=k, capacity_factor=0.6, min_capacity=0, drop_tokens=drop)
    ref.train()
    expert_grads = None
    for rank in range(world):
        ref.zero_grad()
        x = _tokens(rank, n=6 + 3 * rank).requires_grad_()
        out, aux, _ = ref(x)
        loss = (out * torch.linspace(-1, 1, HIDDEN, dtype=out.dtype)).pow(2).sum() + 0.1 * aux
        loss.backward()
        assert torch.allclose(got[rank]["out"], out, rtol=0, atol=1e-10)
        assert torch.allclose(got[rank]["aux"], aux, rtol=0, atol=1e-12)
        assert torch.allclose(got[rank]["x_grad"], x.grad, rtol=0, atol=1e-10)
        assert torch.allclose(got[rank]["gate_grad"], ref.gate.weight.grad, rtol=0, atol=1e-10)
        grads = {e: [p.grad.clone() for p in ref.experts[str(e)].parameters()] for e in range(num_experts)}
        expert_grads = grads if expert_grads is None else \
            {e: [a + b for a, b in zip(expert_grads[e], grads[e])] for e in grads}
    assert expert_grads is not None
    for rank in range(world):  # an expert's holder has the gradient of every rank's tokens
        for e, grads in got[rank]["experts"].items():
            for g, r in zip(grads, expert_grads[e]):
                assert torch.allclose(g, r, rtol=0, atol=1e-10)


class _Net(nn.Module):
    def __init__(self, placement) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(HIDDEN, HIDDEN).double()
        self.moe = _layer(sum(len(p) for p in placement), placement=placement, k=2, drop_tokens=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        out, aux, _ = self.moe(h)
        return (out + h).pow(2).mean() + 0.01 * aux


def _ddp_fn(rank: int, world: int, placement) -> dict:
    net = _Net(placement)
    ignored = prepare_for_ddp(net, world)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp(_tokens(rank, n=4 + 2 * rank)).backward()
    return {"ignored": ignored, "inp": net.inp.weight.grad,
            "experts": {e: [p.grad for p in net.moe.experts[str(e)].parameters()] for e in net.moe.local_experts}}


@pytest.mark.multiprocess
def test_ddp_reduces_dense_gradients_and_leaves_experts_to_their_holder() -> None:
    placement = [[0, 1, 2], [3]]
    got = run_local_ranks(_ddp_fn, 2, placement, timeout_s=120)
    ref = _Net([[0, 1, 2, 3]])
    for rank in range(2):
        (ref(_tokens(rank, n=4 + 2 * rank)) / 2).backward()  # DDP's mean of the two ranks' losses
    assert all(name.startswith("moe.experts.") for name in got[0]["ignored"]) and got[0]["ignored"]
    for rank in range(2):
        assert torch.allclose(got[rank]["inp"], ref.inp.weight.grad, rtol=0, atol=1e-10)
        for e, grads in got[rank]["experts"].items():
            for g, p in zip(grads, ref.moe.experts[str(e)].parameters()):
                assert torch.allclose(g, p.grad, rtol=0, atol=1e-10)
