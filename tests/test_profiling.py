"""profile_module: per-block FLOPs, parameters, bytes and measured times of a real nn.Module."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from het_strategy.core.catalog import catalog_device_name
from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.profiling.module_profile import profile_module

V, T, D, HEADS, B = 64, 16, 32, 4, 4


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(D), _Attention(), nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape: embeddings, a ModuleList of blocks, final LayerNorm, LM head."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.h = nn.ModuleList(_Block() for _ in range(3))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _tokens() -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# Hand-checked forward FLOPs of one block for one sample (multiply-add = 2):
# qkv 2·T·D·3D, proj 2·T·D·D, MLP 2·2·T·D·4D, scores and scores·V 2·2·T·T·D.
_BLOCK_FLOPS = 2 * T * D * 3 * D + 2 * T * D * D + 2 * 2 * T * D * 4 * D + 2 * 2 * T * T * D


def test_gpt_layers_flops_params_and_bytes() -> None:
    torch.manual_seed(0)
    model = TinyGPT().eval()
    idx = _tokens()
    before = [p.detach().clone() for p in model.parameters()]
    result = profile_module(model, idx, repeats=1, warmup=0)
    wl = result.workload

    assert [layer.name for layer in wl.layers] == ["embedding", "block0", "block1", "block2", "head"]
    assert result.block_modules == ("h.0", "h.1", "h.2")
    assert wl.seq_len == T and wl.name == "TinyGPT" and wl.dtype == "fp32"

    with FlopCounterMode(display=False) as counter:
        model(idx)
    whole = counter.get_total_flops()
    assert sum(layer.flops_per_sample for layer in wl.layers) * B == pytest.approx(whole, rel=1e-12)
    assert [layer.flops_per_sample for layer in wl.layers[1:4]] == [_BLOCK_FLOPS] * 3
    assert wl.layers[0].flops_per_sample == 0  # an embedding lookup is not a FLOP
    assert wl.layers[4].flops_per_sample == 2 * T * D * V

    assert wl.total_params == _num_params(model)
    assert wl.layers[0].params == V * D + T * D
    assert wl.layers[4].params == 2 * D + D * V
    assert len({layer.params for layer in wl.layers[1:4]}) == 1
    assert result.layer_params[0] == ("wte.weight", "wpe.weight")
    assert result.layer_params[4] == ("ln_f.weight", "ln_f.bias", "lm_head.weight")

    acts = [layer.activation_bytes_per_sample for layer in wl.layers[1:4]]
    assert acts[0] > 0 and acts == [acts[0]] * 3
    assert [layer.output_bytes_per_sample for layer in wl.layers] == [T * D * 4] * 4 + [T * V * 4]

    # the model comes back as it was: eval mode, no gradients, same weights
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_memory_models_block_activations_hold_what_autograd_saves(dtype: str) -> None:
    """The analytic block activations (``transformer_workload``: 34 bytes per token and width in 16 bits, plus the
    fused attention's fp32 log-sum-exp) against the bytes autograd saves in the demo CharGPT's blocks (torch's
    fused attention, no dropout: its two dropout masks, 2 of the 34, are not saved; the s x s scores, which
    ``attention: materialized`` adds, would be 2.3x the saved bytes here)."""
    from het_strategy.core.workload import transformer_workload
    from het_strategy.demo.char_gpt import CharGPT

    torch.manual_seed(0)
    model = CharGPT(num_layers=2, hidden_size=64, num_heads=4, seq_len=128, vocab_size=64)
    model = model.to(torch.float32 if dtype == "fp32" else torch.bfloat16)
    saved = profile_module(model, torch.randint(0, 64, (2, 128)), dtype=dtype, repeats=1, warmup=0).workload
    analytic = transformer_workload(model.workload_config(), dtype=dtype)
    for got, want in zip(saved.layers[1:3], analytic.layers[1:3]):
        assert got.name == want.name
        # never below what is saved, and above it by at most the two dropout masks (2 s·h bytes of 34)
        assert got.activation_bytes_per_sample <= want.activation_bytes_per_sample <= \
            got.activation_bytes_per_sample * 34 / 32 * 1.01


def test_tied_head_weight_belongs_to_the_embedding() -> None:
    model = TinyGPT(tied=True)
    wl = profile_module(model, _tokens(), repeats=1, warmup=0).workload
    assert wl.total_params == _num_params(model)
    assert wl.layers[0].params == V * D + T * D
    assert wl.layers[-1].params == 2 * D  # only ln_f: the head's weight is the embedding's


def test_linear_stack_matches_hand_counts() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(32, 4))
    result = profile_module(model, torch.randn(5, 8), repeats=1, warmup=0)
    wl = result.workload
    assert [layer.name for layer in wl.layers] == ["block0", "block1", "block2"]
    assert [layer.flops_per_sample for layer in wl.layers] == [2 * 8 * 16, 2 * 16 * 32, 2 * 32 * 4]
    assert [layer.params for layer in wl.layers] == [8 * 16 + 16, 16 * 32 + 32, 32 * 4 + 4]
    # each Linear keeps its fp32 input for the weight gradient; weights are not activations
    assert [layer.activation_bytes_per_sample for layer in wl.layers] == [8 * 4, 16 * 4, 32 * 4]
    assert [layer.output_bytes_per_sample for layer in wl.layers] == [16 * 4, 32 * 4, 4 * 4]
    assert wl.seq_len == 8 and result.micro_batch == 5


def test_dict_batch_and_dict_output_with_explicit_blocks() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(6, 12)
            self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 12)
            self.out = nn.Linear(12, 1)

        def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
            y = self.out(self.b(self.a(self.inp(x)))) * scale
            return {"logits": y, "loss": y.pow(2).mean()}

    model = Model()
    result = profile_module(model, {"x": torch.randn(3, 6), "scale": 2.0}, blocks=["a", "b"], name="dictmodel")
    wl = result.workload
    assert [layer.name for layer in wl.layers] == ["embedding", "block0", "block1", "head"]
    assert [layer.params for layer in wl.layers] == [6 * 12 + 12, 12 * 12 + 12, 12 * 12 + 12, 12 + 1]
    assert [layer.flops_per_sample for layer in wl.layers] == [2 * 6 * 12, 2 * 12 * 12, 2 * 12 * 12, 2 * 12]
    assert wl.name == "dictmodel" and result.profile.model == "dictmodel"
    assert wl.seq_len == 6


class _Mlp(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _TwoWidths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Mlp(256, 512), _Mlp(256, 2048)])  # the second: 4x the FLOPs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_measured_times_are_positive_and_grow_with_width() -> None:
    torch.manual_seed(0)
    model, x = _TwoWidths(), torch.randn(64, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a busy machine multi-threaded kernels stall at random
    try:
        # A pre-empted run can flip one comparison; a time charged to the wrong block flips every run.
        for _ in range(3):
            result = profile_module(model, x, repeats=5, warmup=1)
            rows = result.profile.layer_times("CPU", 1, 64)
            (f0, b0, u0), (f1, b1, u1) = rows
            if f1 > f0 and b1 > b0 and u1 > u0:
                break
    finally:
        torch.set_num_threads(threads)
    assert result.device_type == "CPU" and result.micro_batch == 64
    assert len(rows) == result.workload.num_layers == 2
    assert all(f > 0 and b > 0 and u > 0 for f, b, u in rows)
    assert f1 > f0 and b1 > b0 and u1 > u0
    assert result.workload.layers[1].flops_per_sample == 4 * result.workload.layers[0].flops_per_sample


def test_profile_plugs_into_cost_model() -> None:
    result = profile_module(TinyGPT(), _tokens(), repeats=1, warmup=0)
    wl, profile = result.workload, result.profile
    cluster = cluster_from_dict({"name": "two-cpus", "nodes": [{"name": "n0", "devices": [{"type": "CPU", "count": 2}]}]})
    names = [d.name for d in cluster.devices]
    plan = Plan(cluster=cluster.name, cluster_devices=tuple(names), model=wl.fingerprint(), global_batch_size=2 * B,
                pipelines=tuple(Pipeline(stages=(Stage((d,), (0, wl.num_layers)),), micro_batch_size=B, samples=B)
                                for d in names), dtype="fp32", mode="manual")
    cost_model = CostModel(cluster, wl, TrainSettings(global_batch_size=2 * B, dtype="fp32"), profile)
    assert all(cost_model.uses_profile(d, 1) for d in cluster.devices)
    score = cost_model.score(plan)
    assert math.isfinite(score.step_time_s) and score.step_time_s > 0
    rows = profile.layer_times("CPU", 1, B)
    # one micro-batch per pipeline: its time is the measured forward + backward of every layer
    assert score.pipeline_times_s[0] == pytest.approx(sum(f + b for f, b, _ in rows))
    assert score.update_time_s == pytest.approx(sum(u for _, _, u in rows))


def test_bad_inputs_raise_config_error() -> None:
    model = TinyGPT()
    with pytest.raises(ConfigError, match=r"`blocks\[1\]` is 'h.7'; it must name a submodule"):
        profile_module(model, _tokens(), blocks=["h.0", "h.7"])
    with pytest.raises(ConfigError, match=r"`module` is 'Module'; it must be an nn.Module with parameters"):
        profile_module(nn.Module(), _tokens())
    with pytest.raises(ConfigError, match=r"`sample_batch` is 'dict'; it must hold at least one tensor"):
        profile_module(model, {"idx": [1, 2, 3]})
    with pytest.raises(ConfigError, match=r"`blocks\[1\]` is 'h.0.attn'; it must not lie inside another block"):
        profile_module(model, _tokens(), blocks=["h.0", "h.0.attn"])
    with pytest.raises(ConfigError, match=r"be listed in the order the forward runs them"):
        profile_module(model, _tokens(), blocks=["h.1", "h.0"], repeats=1, warmup=0)
    with pytest.raises(ConfigError, match=r"`dtype` is 'bf16'; it must match the module's parameter dtype \(fp32\)"):
        profile_module(model, _tokens(), dtype="bf16")
    with pytest.raises(ConfigError, match=r"`blocks` is \[\]"):
        profile_module(model, _tokens(), blocks=[])
    with pytest.raises(ConfigError, match=r"`repeats` is 0; it must be >= 1"):
        profile_module(model, _tokens(), repeats=0)
    with pytest.raises(ConfigError, match=r"`blocks` is null; it must be given"):
        profile_module(nn.Linear(4, 4), torch.randn(2, 4))


def test_cuda_names_map_to_catalog_types() -> None:
    assert catalog_device_name("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert catalog_device_name("NVIDIA A100-PCIE-40GB") == "A100-40GB"
    assert catalog_device_name("NVIDIA A100-SXM4", memory_gb=79.2) == "A100-80GB"
    assert catalog_device_name("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert catalog_device_name("NVIDIA H200") == "H200"
    assert catalog_device_name("NVIDIA GH200 480GB") == "GH200-96GB"
    assert catalog_device_name("Tesla V100-SXM2-32GB") == "V100-32GB"
    assert catalog_device_name("Tesla T4") == "T4"
    assert catalog_device_name("NVIDIA GeForce RTX 4090") == "RTX-4090"
    assert catalog_device_name("AMD Instinct MI250X") == "MI250X"
    assert catalog_device_name("NVIDIA B200") == "NVIDIA B200"  # unknown: kept as reported
