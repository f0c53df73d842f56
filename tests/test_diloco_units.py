"""hetero_diloco without processes: the outer exchange's error feedback against its bound, the outer step's
arithmetic, and every option refused with its field named."""

from __future__ import annotations

import math

import pytest
import torch

from het_strategy.compression.torch_codecs import bound_ratio
from het_strategy.compression.config import CompressionConfig
from het_strategy.core.codecs import Codec
from het_strategy.core.errors import ConfigError
from het_strategy.core.outer_sync import OUTER_CODECS, OuterSync
from het_strategy.diloco.groups import DiLoCoGroups
from het_strategy.diloco.outer_exchange import Exchanged, OuterExchange
from het_strategy.diloco.outer_loop import OuterLoop

ALONE = DiLoCoGroups(0, ((0,),), None, None)


@pytest.mark.parametrize("token", ["q4", "q2", "fp16", "bf16"])
def test_error_feedback_within_its_bound_and_nothing_lost(token: str) -> None:
    """Each round's residual is what that round's encoding lost, within the codec's bound of the round's input
    (pseudo-gradient + previous residual); over rounds the decoded sum equals the sent sum minus the last
    residual: error feedback drops nothing."""
    exchange = OuterExchange(Codec(token), ALONE)
    g = torch.Generator().manual_seed(0)
    sent = torch.zeros(1000)
    delivered = torch.zeros(1000)
    for _ in range(20):
        x = torch.randn(1000, generator=g) * 1e-2
        with_residual = x + (exchange.residual if exchange.residual is not None else 0)
        got = exchange.decode(exchange.encode(x))
        assert bound_ratio(token, with_residual, got, (1000,), CompressionConfig()) <= 1.0
        torch.testing.assert_close(exchange.residual, with_residual - got, rtol=0, atol=1e-9)
        sent += x
        delivered += got
    torch.testing.assert_close(delivered, sent - exchange.residual, rtol=0, atol=1e-6)
    # without feedback the error would grow with the rounds; with it, it stays one round's
    assert float((delivered - sent).abs().max()) <= float(exchange.residual.abs().max()) + 1e-6


def test_uncompressed_exchange_keeps_float64_exactly() -> None:
    exchange = OuterExchange(Codec.NONE, ALONE)
    x = torch.randn(50, dtype=torch.float64)
    assert exchange.decode(exchange.encode(x)).dtype == torch.float64
    assert torch.equal(exchange.decode(exchange.encode(x)), x) and exchange.residual is None


class _Averaging:
    """An exchange stand-in: two groups, the other group's weighted pseudo-gradient given."""

    def __init__(self, other: torch.Tensor, other_samples: int) -> None:
        self.other, self.other_samples = other, other_samples
        self.spec = OuterExchange(Codec.NONE, ALONE).spec

    def average(self, weighted: torch.Tensor, samples: int) -> Exchanged:
        total = samples + self.other_samples
        return Exchanged((weighted + self.other) / total, total, 0)


def test_outer_step_is_nesterov_on_the_sample_weighted_pseudo_gradient() -> None:
    """3 inner steps of 4 samples here, 12 samples' worth of another group: the outer SGD (lr 0.7, momentum 0.9,
    Nesterov) steps on (12 d_here + 12 d_other) / 24, and the model takes the new outer parameters."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    start = p.detach().clone()
    loop = OuterLoop([p], lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True))
    other_delta = torch.randn(5, dtype=torch.float64)
    loop.run(3, _Averaging(other_delta * 12, 12))  # type: ignore[arg-type]
    with torch.no_grad():
        p -= 0.1
    assert loop.inner_step_done(4) is None and loop.inner_step_done(4) is None
    record = loop.inner_step_done(4)
    assert record is not None and record.round == 1 and record.samples == 24 and record.inner_steps == 3
    avg = (12 * torch.full((5,), 0.1, dtype=torch.float64) + 12 * other_delta) / 24
    # Nesterov's first step: buf = g, update = g + 0.9 g
    torch.testing.assert_close(p.detach(), start - 0.7 * 1.9 * avg, rtol=0, atol=1e-12)
    torch.testing.assert_close(loop.outer[0].detach(), p.detach(), rtol=0, atol=0)
    assert loop.step_in_round == 0 and loop.round_samples == 0
    assert math.isclose(record.pseudo_gradient_norm, float(avg.norm()), rel_tol=1e-12)


def test_validation_sees_outer_parameters_then_the_group_its_own() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    loop = OuterLoop([p], lambda ps: torch.optim.SGD(ps, lr=1.0))
    with torch.no_grad():
        p += 1.0
    with loop.outer_in_model():
        assert torch.equal(p.detach(), torch.zeros(3))
        assert torch.equal(loop.local_flat(), torch.ones(3))
    assert torch.equal(p.detach(), torch.ones(3))


@pytest.mark.parametrize("kwargs, field", [
    ({"inner_steps": 0}, "inner_steps"),
    ({"inner_steps": 2.5}, "inner_steps"),
    ({"outer_lr": 0.0}, "outer_lr"),
    ({"outer_lr": -1}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"outer_codec": "topk"}, "outer_codec"),
    ({"outer_codec": "powersgd"}, "outer_codec"),
    ({"outer_codecs": ["q4", "topk"]}, "outer_codecs[1]"),
    ({"split": "fast"}, "split"),
    ({"groups": "site"}, "groups"),
    ({"groups": [["lab0", "lab1"], ["cloud0"]]}, "groups"),  # cloud1 in no group
    ({"groups": [["lab0", "lab1", "cloud0", "cloud1"]]}, "groups"),  # one group: nothing to exchange
    ({"max_inner_steps": 0}, "max_inner_steps"),
    ({"max_sync_overhead": 1.5}, "max_sync_overhead"),
    ({"outer_optimizer": lambda ps: torch.optim.SGD(ps, lr=0.0)}, "outer_optimizer.lr"),
    ({"compression": "q4"}, "compression"),
    ({"rebalance": object()}, "rebalance"),
])
def test_bad_options_name_their_field(kwargs: dict, field: str) -> None:
    from het_strategy import HeteroDiLoCoStrategy

    pytest.importorskip("lightning")
    with pytest.raises(ConfigError) as err:
        HeteroDiLoCoStrategy(cluster="examples/clusters/two_sites.yaml", **kwargs)
    assert f"`{field}`" in str(err.value), str(err.value)


def test_plan_fields_refused_with_their_dotted_names() -> None:
    with pytest.raises(ConfigError, match=r"`plan.outer_sync.inner_steps` is 0"):
        OuterSync(0, "q4", (("a",), ("b",)))
    with pytest.raises(ConfigError, match=r"`plan.outer_sync.codec` is 'topk'"):
        OuterSync(1, "topk", (("a",), ("b",)))
    with pytest.raises(ConfigError, match=r"`plan.outer_sync.groups\[1\]`"):
        OuterSync(1, "q4", (("a",), ("a", "b")))
    with pytest.raises(ConfigError, match=r"`plan.outer_sync.groups`.*lacks c"):
        OuterSync(1, "q4", (("a",), ("b",))).check_covers(["a", "b", "c"])
    assert set(OUTER_CODECS) == {Codec(t) for t in ("none", "fp16", "bf16", "q8", "q7", "q6", "q5", "q4", "q3",
                                                    "q2")}


def test_a_synchronous_plan_is_refused_and_a_pinned_option_conflicts_with_a_given_plan(tmp_path) -> None:
    pytest.importorskip("lightning")
    from het_strategy import HeteroDiLoCoStrategy, HeteroStrategy
    from het_strategy.core.plan import Pipeline, Plan, Stage

    devices = ("lab0", "lab1", "cloud0", "cloud1")
    pipes = tuple(Pipeline((Stage((d,), (0, 1)),), 2, 2) for d in devices)
    sync = Plan(cluster="two_sites", cluster_devices=devices, model={"num_layers": 1}, global_batch_size=8,
                pipelines=pipes, dtype="fp32")
    with pytest.raises(ConfigError, match=r"`plan.outer_sync` is null; it must be given"):
        HeteroDiLoCoStrategy(cluster="examples/clusters/two_sites.yaml", plan=sync)
    low = Plan(cluster="two_sites", cluster_devices=devices, model={"num_layers": 1}, global_batch_size=8,
               pipelines=pipes, dtype="fp32", outer_sync=OuterSync(4, "q4", (devices[:2], devices[2:])))
    with pytest.raises(ConfigError, match=r"`inner_steps` is 8"):
        HeteroDiLoCoStrategy(cluster="examples/clusters/two_sites.yaml", plan=low, inner_steps=8)
    with pytest.raises(ConfigError, match=r"`plan.outer_sync`.*hetero_diloco"):
        HeteroStrategy(cluster="examples/clusters/two_sites.yaml", plan=low)
    assert Plan.from_dict(low.to_dict()).outer_sync == low.outer_sync
