"""The codec registry: every codec round-trips within its stated bound, the torch encoders cover exactly the
core's codecs and send what the core says, and the hook puts on the wire exactly the core's wire bytes."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from het_strategy.compression import CompressionConfig, CompressionState, WireBytes, compression_hook, \
    counted_comm_hook
from het_strategy.compression.torch_codecs import TORCH_CODECS, bound_ratio, round_trip
from het_strategy.core.codecs import CODECS, ELEMENTWISE_CODECS, Bound, Codec, Exchange, codec, low_rank
from het_strategy.core.compressed_sync import INTER_NODE_TOKENS, wire_fraction
from het_strategy.core.errors import ConfigError
from het_strategy.emulation.local_ranks import run_local_ranks
from het_strategy.profiling.torch_device import TORCH_DTYPES

SHAPE = (48, 256)


def _gradient(seed: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """Rows of very different scales with a few large outliers, one constant row and one zero row (flat)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[0]).unsqueeze(1)
    x.view(-1)[torch.randint(0, x.numel(), (8,), generator=g)] *= 100.0
    x[1] = 0.75
    x[2] = 0.0
    return x.reshape(-1)


CONFIGS = [CompressionConfig(), CompressionConfig(scaling="maxnorm", bucket_size=64, stochastic_rounding=True)]


@pytest.mark.parametrize("config", CONFIGS, ids=["maxmin", "maxnorm-stochastic"])
@pytest.mark.parametrize("token", list(Codec))
def test_every_codec_round_trips_within_its_stated_bound(token: Codec, config: CompressionConfig) -> None:
    x = _gradient(7)
    got = round_trip(token, x, SHAPE, config, torch.Generator().manual_seed(3))
    assert got.shape == x.shape and got.dtype == torch.float32
    ratio = bound_ratio(token, x, got, SHAPE, config)
    assert ratio <= 1.0, (token, ratio)
    if CODECS[token].bound is Bound.EXACT:
        assert torch.equal(got, x)
    else:  # the bound is not vacuous: the error uses a fair part of it
        assert ratio > 0.2, (token, ratio)


def test_a_broken_bound_is_seen() -> None:
    """bound_ratio can fail: a coarser codec's result breaks a finer codec's bound, and a changed element breaks
    exactness, top-k's keep-or-drop rule and PowerSGD's projection bound."""
    config, x = CompressionConfig(), _gradient(8)
    assert bound_ratio(Codec.Q8, x, round_trip(Codec.Q2, x, SHAPE, config), SHAPE, config) > 1
    assert bound_ratio(Codec.BF16, x, round_trip(Codec.Q8, x, SHAPE, config), SHAPE, config) > 1
    nudged = x.clone()
    nudged[int(x.abs().argmax())] *= 1.01
    for token in (Codec.NONE, Codec.TOPK):
        assert bound_ratio(token, x, nudged, SHAPE, config) > 1, token
    assert bound_ratio(Codec.POWERSGD, x, -x, SHAPE, config) > 1


def test_powersgd_is_exact_on_a_low_rank_matrix_and_sends_a_thin_one_whole() -> None:
    config = CompressionConfig(rank=4)
    g = torch.Generator().manual_seed(1)
    low = (torch.randn(64, 3, generator=g) @ torch.randn(3, 128, generator=g)).reshape(-1)
    got = round_trip(Codec.POWERSGD, low, (64, 128), config, torch.Generator().manual_seed(2))
    torch.testing.assert_close(got, low, atol=1e-4, rtol=1e-4)
    thin = torch.randn(4096, 1, generator=g).reshape(-1)  # (4096 + 1) x 1 factors are no smaller
    assert low_rank(4096, 1, 4) == 0
    assert torch.equal(round_trip(Codec.POWERSGD, thin, (4096, 1), config), thin)


def test_the_torch_codecs_cover_exactly_the_core_codecs_and_agree_on_the_facts() -> None:
    assert list(CODECS) == list(Codec) and set(TORCH_CODECS) == set(CODECS)
    for token, spec in CODECS.items():
        assert spec.token is token
        if spec.bound is Bound.ROUNDING:
            assert spec.unit_roundoff == torch.finfo(TORCH_DTYPES[spec.wire_dtype]).eps / 2, token
        if spec.exchange is Exchange.QUANTIZED:
            assert spec.bits == int(token.value[1:]), token
    assert ELEMENTWISE_CODECS == tuple(t for t in Codec if CODECS[t].exchange in
                                       (Exchange.ALLREDUCE, Exchange.QUANTIZED))
    assert INTER_NODE_TOKENS == ELEMENTWISE_CODECS


def _payload_bytes(payload: object) -> int:
    tensors = [payload] if isinstance(payload, torch.Tensor) else [p for p in payload if isinstance(p, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("config", CONFIGS, ids=["maxmin", "maxnorm-stochastic"])
@pytest.mark.parametrize("token", list(Codec))
def test_an_encoders_payload_is_the_cores_wire_size(token: Codec, config: CompressionConfig) -> None:
    """What the encoder puts out is what the core prices: per element for the elementwise codecs, and per layer
    over 2 ranks for every codec."""
    spec, x = CODECS[token], _gradient(9)
    payload = TORCH_CODECS[token].encode(spec, x, SHAPE, config, torch.Generator().manual_seed(0))
    sent = _payload_bytes(payload)
    per_element = spec.bytes_per_element("fp32", config.codec_params)
    if per_element is not None:
        assert sent == per_element * x.numel(), (token, sent, per_element)
    # over 2 ranks each exchange sends the payload once: a ring allreduce 2 x 1/2 of it, the two quantized
    # phases half of it each, an allgather all of it to the one peer
    assert sent == spec.wire_bytes(SHAPE, 2, "fp32", config.codec_params), token


def test_the_cost_model_reads_the_registry_per_gradient_dtype() -> None:
    assert wire_fraction("q4") == pytest.approx(CODECS[Codec.Q4].bytes_per_element("fp32") / 4)
    assert wire_fraction("none", "bf16") == 1.0 and wire_fraction("bf16", "bf16") == 1.0
    assert wire_fraction("q4", "bf16") == pytest.approx(2 * wire_fraction("q4", "fp32"))
    with pytest.raises(ConfigError, match="topk"):  # priced per layer shape: not a plan's inter-node codec
        wire_fraction("topk")


def test_tokens_are_checked_with_their_field() -> None:
    assert codec("q4", "f") is Codec.Q4
    with pytest.raises(ConfigError) as info:
        codec("quantize4", "compression.candidates[2]")
    assert "`compression.candidates[2]` is 'quantize4'" in str(info.value) and "q2" in str(info.value)


def test_the_core_registry_imports_no_torch() -> None:
    code = ("import sys, het_strategy.core.codecs, het_strategy.core.compressed_sync; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _hook_bytes(rank: int, world: int) -> list[tuple[str, str, int, int]]:
    """Per codec (and fp32 and bf16 gradients for ``none``): (token, dtype, counted bytes, the core's bytes) of
    one step of a one-layer model (one bucket, one eligible layer: the group is the layer)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = []
    cases = [(token, torch.float32) for token in Codec] + [(Codec.NONE, torch.bfloat16), (Codec.Q4, torch.bfloat16)]
    for token, dtype in cases:
        torch.manual_seed(0)
        layer = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False).to(dtype)
        model = DDP(layer)
        config = CompressionConfig(method=token, warmup_steps=0, verbose=False)
        state = CompressionState(model, config)
        wire = WireBytes()
        model.register_comm_hook(state, counted_comm_hook(compression_hook, wire))
        x = torch.randn(16, SHAPE[1], generator=torch.Generator().manual_seed(rank)).to(dtype)
        model(x).square().mean().backward()
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        raw, sent = wire.reading()
        assert raw == CODECS[Codec.NONE].wire_bytes(SHAPE, world, name)
        out.append((str(token), name, sent, CODECS[token].wire_bytes(SHAPE, world, name, config.codec_params)))
    return out


@pytest.mark.multiprocess
def test_the_hook_sends_the_registrys_wire_bytes() -> None:
    world = 3  # 2 (W-1)/W is not a whole number: the rounding must agree too
    results = run_local_ranks(_hook_bytes, world)
    for token, dtype, sent, priced in results[0]:
        assert sent == priced, (token, dtype, sent, priced)
    assert {r[:2] for r in results[0]} >= {("none", "bf16"), ("q4", "bf16")}
    assert all(math.isfinite(r[2]) and r[2] > 0 for r in results[0])


def test_the_controller_prices_a_layer_in_its_gradients_dtype() -> None:
    """A bf16 model's uncompressed layer costs 2 bytes per element on the wire, as the hook sends it."""
    from het_strategy.compression import AdaptiveController, wire_bytes

    config = CompressionConfig(candidates=("none", "q4"))
    controller = AdaptiveController(config)
    grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    controller.measure(["w"], [grad], 0, {}, torch.Generator().manual_seed(1))
    measured = controller.stats["w"]
    assert measured["dtype"] == "bf16" and measured["tokens"] == [Codec.NONE, Codec.Q4]
    plain = wire_bytes(Codec.NONE, measured["shape"], 4, config, measured["dtype"])
    assert plain == CODECS[Codec.NONE].wire_bytes((64, 64), 4, "bf16") == 2 * (4 - 1) * 2 * 64 * 64 // 4
