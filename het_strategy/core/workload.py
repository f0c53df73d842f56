"""Workloads: what each layer of a model costs, independent of any device.

Two sources fill the same ``WorkloadSpec``:

* ``transformer_workload`` — an analytic decoder-only transformer (optionally
  MoE), giving per-layer forward FLOPs, parameter and activation bytes;
* ``het_strategy.profiling.module_profile.profile_module`` — a real ``nn.Module`` and a sample
  batch, FLOPs counted by ``torch.utils.flop_counter``.

``MeasuredProfile`` carries per-layer times measured on real devices (Sailor's
published profiles, or our own profiler); the cost model prefers it to
datasheet throughput whenever it covers a device type.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from het_strategy.core.compute_model import AttentionKernel, LayerShape
from het_strategy.core.dtypes import DTYPE_BYTES, Dtype, as_dtype
from het_strategy.core.plain_data import plain
from het_strategy.core.errors import check_keys, field_error, require_int, require_option
from het_strategy.core.files import naming_file, read_yaml_file
from het_strategy.core.shipped import config_file

__all__ = [
    "LayerCost",
    "MoESpec",
    "WorkloadSpec",
    "TransformerConfig",
    "MeasuredProfile",
    "transformer_workload",
    "transformer_config",
    "load_workload",
    "MODEL_KEYS",
]

@dataclass(frozen=True)
class MoESpec:
    """The expert part of one MoE layer (its dense part is in the LayerCost)."""

    num_experts: int
    """Experts in the layer."""
    top_k: int
    """Experts each token is routed to."""
    params_per_expert: int
    """Parameters of one expert."""
    flops_per_token_per_expert: float
    """Forward FLOPs one expert spends on one routed token."""


@dataclass(frozen=True)
class LayerCost:
    """Device-independent cost of one layer for one sample (a full sequence)."""

    name: str
    """Layer name (``embedding``, ``block3``, ``head`` or the module path)."""
    flops_per_sample: float
    """Forward FLOPs for one sample, experts excluded (backward is counted as 2x)."""
    params: int
    """Parameter count of the dense part (experts are in ``moe``)."""
    activation_bytes_per_sample: float
    """Bytes kept for backward per sample in the training dtype."""
    output_bytes_per_sample: float
    """Bytes of the layer's output per sample: what crosses a pipeline boundary."""
    moe: MoESpec | None = None
    """Expert part, for MoE layers."""
    tp_replicated_activation_bytes: float = 0.0
    """Of ``activation_bytes_per_sample``, the bytes every tensor-parallel rank keeps whole (a block's layer-norm
    inputs and dropout masks without sequence parallelism); the rest is split over tp."""
    shape: LayerShape | None = None
    """The layer's kind and dimensions, for the roofline (``compute_model.py``); None (a profiled module's
    layer): priced by ``flops_per_sample`` at the device's sustained rate."""

    @property
    def total_params(self) -> int:
        return self.params + (self.moe.num_experts * self.moe.params_per_expert if self.moe else 0)


@dataclass(frozen=True)
class WorkloadSpec:
    """An ordered list of layers; a pipeline stage holds a contiguous range of them."""

    name: str
    """Model name, part of a Plan's identity."""
    layers: tuple[LayerCost, ...]
    """Layers in execution order."""
    seq_len: int
    """Tokens per sample."""
    dtype: Dtype = Dtype.bf16
    """Dtype the activation figures were computed for (a name is converted)."""

    def __post_init__(self) -> None:
        if not self.layers:
            raise field_error("model.layers", [], "list at least one layer")
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "model.dtype"))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        return sum(layer.total_params for layer in self.layers)

    def fingerprint(self) -> dict[str, Any]:
        """What a Plan records to check it is applied to the model it was made for."""
        return {"name": self.name, "num_layers": self.num_layers, "total_params": self.total_params,
                "seq_len": self.seq_len}

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seq_len": self.seq_len, "dtype": self.dtype.value,
                "layers": [{k: v for k, v in layer.__dict__.items() if k not in ("moe", "shape")}
                           | ({"moe": dict(layer.moe.__dict__)} if layer.moe else {}) for layer in self.layers]}


@dataclass(frozen=True)
class TransformerConfig:
    """An analytic decoder-only transformer (GPT/OPT shape), optionally with MoE blocks."""

    name: str
    """Model name."""
    num_layers: int
    """Transformer blocks (the embedding and head are added as layers of their own)."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention heads."""
    seq_len: int
    """Tokens per sample."""
    vocab_size: int
    """Vocabulary size (embedding and output head)."""
    ffn_hidden_size: int | None = None
    """MLP width; 4h when not given."""
    num_experts: int = 0
    """Experts per MoE block; 0 for a dense model."""
    top_k: int = 2
    """Experts each token is routed to."""
    moe_every: int = 1
    """Every n-th block is MoE (1 = all blocks, 2 = every other block)."""
    expert_ffn_hidden_size: int | None = None
    """Width of one expert's MLP; the MLP width (``ffn_hidden_size`` or 4h) when not given."""
    attention: AttentionKernel = AttentionKernel.fused
    """How attention runs, for the roofline: ``fused`` (torch's ``scaled_dot_product_attention``) or
    ``materialized`` (the scores written to memory: Megatron without flash attention)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", require_option(AttentionKernel, self.attention, "model.attention"))
        for f in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            require_int(getattr(self, f), f"model.{f}", minimum=1)
        if self.ffn_hidden_size is not None:
            require_int(self.ffn_hidden_size, "model.ffn_hidden_size", minimum=1)
        if self.hidden_size % self.num_heads:
            raise field_error("model.hidden_size", self.hidden_size,
                              f"be divisible by model.num_heads ({self.num_heads})")
        require_int(self.num_experts, "model.num_experts", minimum=0)
        if self.num_experts:
            require_int(self.top_k, "model.top_k", minimum=1)
            require_int(self.moe_every, "model.moe_every", minimum=1)
            if self.top_k > self.num_experts:
                raise field_error("model.top_k", self.top_k, f"be <= model.num_experts ({self.num_experts})")
        if self.expert_ffn_hidden_size is not None:
            require_int(self.expert_ffn_hidden_size, "model.expert_ffn_hidden_size", minimum=1)


def transformer_workload(cfg: TransformerConfig, dtype: Dtype | str = Dtype.bf16) -> WorkloadSpec:
    """Per-layer costs of an analytic transformer.

    FLOPs count multiply-adds as 2 (QKV, scores, scores x V, output projection,
    MLP; LM head 2·s·h·V).  Activation bytes per block follow Korthikanti et al.
    (2022): s·h·(34 + 5·a·s/h) bytes in a 16-bit dtype without recomputation, of
    which 10·s·h stay whole on every tensor-parallel rank (their eq. 2).  The
    5·a·s² bytes are the attention scores' softmax output, dropout mask and
    dropout output, which only ``attention: materialized`` writes; ``fused``
    attention (torch's ``scaled_dot_product_attention``) keeps the s·h-sized
    tensors and its fp32 log-sum-exp, 4·a·s bytes, instead.  The head keeps its
    logits in fp32 twice: the upcast logits and the loss's softmax.
    """
    dtype = as_dtype(dtype, "model.dtype")
    s, h, a, v = cfg.seq_len, cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    f = cfg.ffn_hidden_size or 4 * h
    fe = cfg.expert_ffn_hidden_size or f
    scale = DTYPE_BYTES[dtype] / 2
    boundary = s * h * DTYPE_BYTES[dtype]
    attn_flops = 2 * s * 4 * h * h + 4 * s * s * h
    mlp_flops = 4 * s * h * f
    attn_params = 4 * h * h + 4 * h + 4 * h  # qkv + out (with bias) + two layernorms
    mlp_params = 2 * h * f + f + h
    if cfg.attention == AttentionKernel.materialized:
        block_act = (s * h * 34 + 5 * a * s * s) * scale
    else:  # the scores stay on chip; the kernel saves its fp32 log-sum-exp per head and token
        block_act = s * h * 34 * scale + 4 * a * s
    whole = s * h * 10 * scale  # layer-norm inputs and dropout masks: whole on every tp rank
    block_shape = LayerShape("block", h, a, f, v, cfg.attention)
    layers = [LayerCost("embedding", 2 * s * h, v * h + s * h, s * h * DTYPE_BYTES[dtype], boundary,
                        shape=LayerShape("embedding", h, a, 0, v, cfg.attention))]
    for i in range(cfg.num_layers):
        is_moe = cfg.num_experts > 0 and (i % cfg.moe_every == cfg.moe_every - 1)
        if is_moe:
            moe = MoESpec(num_experts=cfg.num_experts, top_k=cfg.top_k, params_per_expert=2 * h * fe + fe + h,
                          flops_per_token_per_expert=4 * h * fe)
            router_flops = 2 * s * h * cfg.num_experts
            layers.append(LayerCost(f"block{i}", attn_flops + router_flops, attn_params + h * cfg.num_experts,
                                    block_act + s * h * cfg.top_k * DTYPE_BYTES[dtype], boundary, moe, whole,
                                    shape=LayerShape("block", h, a, 0, v, cfg.attention)))  # experts: priced apart
        else:
            layers.append(LayerCost(f"block{i}", attn_flops + mlp_flops, attn_params + mlp_params, block_act,
                                    boundary, tp_replicated_activation_bytes=whole, shape=block_shape))
    # logits are kept in fp32 for the loss, twice (the upcast logits and the softmax the loss keeps)
    layers.append(LayerCost("head", 2 * s * h * v, v * h + 2 * h, 2 * s * v * 4 + s * h * DTYPE_BYTES[dtype], s * 4,
                            shape=LayerShape("head", h, a, 0, v, cfg.attention)))
    return WorkloadSpec(name=cfg.name, layers=tuple(layers), seq_len=s, dtype=dtype)


MODEL_KEYS = {"name", "num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "ffn_hidden_size",
              "num_experts", "top_k", "moe_every", "expert_ffn_hidden_size", "attention", "kind", "description"}
"""The keys a model mapping (a model YAML file) may hold."""


def load_workload(source: str | Path | Mapping[str, Any] | WorkloadSpec,
                  dtype: Dtype | str = Dtype.bf16) -> WorkloadSpec:
    """A workload from a shipped model name, a YAML path, a mapping, or a WorkloadSpec.

    A file is read with ``files.read_yaml_file`` (one ConfigError naming ``model`` for a file that cannot be
    read or parsed), and an error in its content names the file.
    """
    if isinstance(source, WorkloadSpec):
        return source
    dtype = as_dtype(dtype, "model.dtype")  # before any file is read: a bad dtype is no error in the file
    if isinstance(source, Mapping):
        return transformer_workload(transformer_config(source), dtype=dtype)
    path, raw = read_yaml_file(config_file("model", source), "model", "model YAML file")
    with naming_file(path, "model file"):
        return transformer_workload(transformer_config({"name": path.stem, **raw}), dtype=dtype)


def transformer_config(source: Mapping[str, Any]) -> TransformerConfig:
    """The TransformerConfig of a model mapping (the ``model`` YAML schema; ``description`` ignored)."""
    raw = dict(plain(source))
    check_keys(raw, MODEL_KEYS, "model")
    kind = raw.pop("kind", "transformer")
    raw.pop("description", None)
    if kind != "transformer":
        raise field_error("model.kind", kind, "be `transformer` (use profile_module for your own nn.Module)")
    for f in dataclasses.fields(TransformerConfig):
        if f.default is dataclasses.MISSING and f.name not in raw:
            raise field_error(f"model.{f.name}", None, "be given", f"a model mapping holds {', '.join(sorted(MODEL_KEYS))}")
    return TransformerConfig(**raw)


@dataclass
class MeasuredProfile:
    """Per-layer times measured on real devices, replacing datasheet throughput.

    ``times[(device_type, tp)][micro_batch] = [(forward_s, backward_s, update_s), ...]``
    one tuple per layer of the workload; ``update_s`` None: not measured (AMP's
    profiles time the forward pass only), the cost model prices the update from
    the device's memory bandwidth.  Micro-batch sizes between measured ones
    are interpolated linearly; beyond the largest, time grows proportionally.
    """

    model: str
    """Model the times belong to (checked against the workload's name)."""
    times: dict[tuple[str, int], dict[int, list[tuple[float, float, float | None]]]] = field(default_factory=dict)
    """Measured seconds per (device type, tp) and micro-batch size, per layer."""
    network: Any = None
    """Optional factory ``cluster -> network.Network`` for links measured with the same profile (Sailor's
    bandwidth fits); None: the cluster file's figures."""

    def covers(self, device_type: str, tp: int) -> bool:
        return (device_type, tp) in self.times

    def coverage(self, used: Iterable[tuple[str, int]]) -> str:
        """One line for the plan table: the (device type, tp) of ``used`` this profile prices, and those it has no
        times for, which the analytic model prices (``settings.compute_model``)."""
        pairs = sorted(set(used))
        have = [f"{t} tp {tp}" for t, tp in pairs if self.covers(t, tp)]
        lack = [f"{t} tp {tp}" for t, tp in pairs if not self.covers(t, tp)]
        line = f"measured per-layer times of {self.model} for {', '.join(have) if have else 'no stage of the plan'}"
        return line + (f"; the analytic model for {', '.join(lack)} (not in the profile)" if lack else "")

    def device_types(self) -> set[str]:
        return {dt for dt, _ in self.times}

    def layer_times(self, device_type: str, tp: int, micro_batch: int) -> list[tuple[float, float, float | None]]:
        """(forward, backward, update) seconds per layer at ``micro_batch``."""
        table = self.times[(device_type, tp)]
        sizes = sorted(table)
        if micro_batch in table:
            return table[micro_batch]
        if micro_batch > sizes[-1]:
            ratio = micro_batch / sizes[-1]
            return [(f * ratio, b * ratio, u) for f, b, u in table[sizes[-1]]]
        if micro_batch < sizes[0]:
            ratio = micro_batch / sizes[0]
            return [(f * ratio, b * ratio, u) for f, b, u in table[sizes[0]]]
        hi = bisect.bisect_left(sizes, micro_batch)
        m0, m1 = sizes[hi - 1], sizes[hi]
        w = (micro_batch - m0) / (m1 - m0)
        return [(f0 + w * (f1 - f0), b0 + w * (b1 - b0), u0)
                for (f0, b0, u0), (f1, b1, _) in zip(table[m0], table[m1])]

    def check_matches(self, workload: WorkloadSpec) -> None:
        for (dt, tp), table in self.times.items():
            for mb, rows in table.items():
                if len(rows) != workload.num_layers:
                    raise field_error(f"profile[{dt}][tp={tp}][mbs={mb}]", f"{len(rows)} layers",
                                      f"have one entry per layer of `{workload.name}` ({workload.num_layers})")
