"""Workloads: what each layer of a model costs, independent of any device.

Two sources fill the same ``WorkloadSpec``:

* ``transformer_workload`` — an analytic decoder-only transformer (GPT blocks, or modern ones: grouped-query
  attention, gated MLPs, RMSNorm, tied heads, MoE with shared experts; ``core/block_costs.py``), giving
  per-layer forward FLOPs, parameter and activation bytes, from a model YAML or a Hugging Face config.json
  (``load_workload``; ``core/hf_fields.py`` reads the config);
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

from het_strategy.core.block_costs import (ACTIVATION_SAVES, BlockCode, NormKind, attention_flops, attention_params,
                                          block_activation_bytes, block_replicated_params, embedding_activation_bytes,
                                          mlp_flops, mlp_params, norm_activation_bytes, norm_params)
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
    "HF_SOURCE_KEYS",
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
    tp_replicated_params: int = 0
    """Of ``params``, those every tensor-parallel rank of a stage holds whole (the norms, a row-parallel linear's
    bias, the router, an embedding table: what ``tensor_parallel`` does not split); the rest is split over tp.  The
    gradient sync reduces them over every rank holding the layer (``core.holder_sync``)."""
    tied_params: int = 0
    """Of ``params``, those tied to the first layer's (the head's copy of tied input embeddings): a stage holding
    this layer and not the first keeps and syncs them, one holding both keeps them once, and the model's total
    counts them once (``WorkloadSpec.tied_within``)."""

    @property
    def total_params(self) -> int:
        return self.params + (self.moe.num_experts * self.moe.params_per_expert if self.moe else 0)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: the dense part and its ``top_k`` experts."""
        return self.params + (self.moe.top_k * self.moe.params_per_expert if self.moe else 0)


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
        """The model's parameters, tied ones counted once (``sum(p.numel() for p in model.parameters())``)."""
        return sum(layer.total_params - layer.tied_params for layer in self.layers)

    @property
    def active_params_per_token(self) -> int:
        """Parameters one token runs through: every dense parameter and the ``top_k`` experts of each MoE layer
        (tied ones counted once); ``total_params`` for a dense model."""
        return sum(layer.active_params - layer.tied_params for layer in self.layers)

    @property
    def tied_prefix(self) -> list[int]:
        """``tied_prefix[j]``: the tied copies among layers [0, j), which a stage holding [0, j) keeps once (their
        source, the embedding, is layer 0); a range not starting at 0 holds its copies."""
        out = [0]
        for layer in self.layers:
            out.append(out[-1] + layer.tied_params)
        return out

    def tied_within(self, start: int, stop: int) -> int:
        """Parameters of layers [start, stop) a stage holding them keeps only once (``tied_prefix``)."""
        return self.tied_prefix[stop] if start == 0 else 0

    @property
    def is_moe(self) -> bool:
        return any(layer.moe for layer in self.layers)

    def fingerprint(self) -> dict[str, Any]:
        """What a Plan records to check it is applied to the model it was made for (``active_params_per_token``
        for an MoE model only)."""
        out: dict[str, Any] = {"name": self.name, "num_layers": self.num_layers, "total_params": self.total_params,
                               "seq_len": self.seq_len}
        if self.is_moe:
            out["active_params_per_token"] = self.active_params_per_token
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "seq_len": self.seq_len, "dtype": self.dtype.value,
                "layers": [{k: v for k, v in layer.__dict__.items()
                            if k not in ("moe", "shape") and not (k == "tied_params" and not v)}
                           | ({"moe": dict(layer.moe.__dict__)} if layer.moe else {}) for layer in self.layers]}


@dataclass(frozen=True)
class TransformerConfig:
    """An analytic decoder-only transformer (GPT/OPT shape by default; Llama, Qwen, Mistral, Mixtral shapes through
    the fields below), optionally with MoE blocks."""

    name: str
    """Model name."""
    num_layers: int
    """Transformer blocks (the embedding and head are added as layers of their own)."""
    hidden_size: int
    """Model width h."""
    num_heads: int
    """Attention (query) heads."""
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
    """Every n-th block is MoE (1 = all blocks, 2 = every other block: block i when (i + 1) % n == 0)."""
    expert_ffn_hidden_size: int | None = None
    """Width of one expert's MLP; the MLP width (``ffn_hidden_size`` or 4h) when not given."""
    attention: AttentionKernel = AttentionKernel.fused
    """How attention runs, for the roofline: ``fused`` (torch's ``scaled_dot_product_attention``) or
    ``materialized`` (the scores written to memory: Megatron without flash attention)."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention; they divide ``num_heads``); ``num_heads`` when not given."""
    head_dim: int | None = None
    """Width of one attention head; hidden_size / num_heads when not given."""
    gated_mlp: bool = False
    """Three MLP matrices (gate, up, down: SwiGLU) instead of two (fc1, fc2); experts too."""
    activation: str = "gelu"
    """The MLP's activation, one of ``ACTIVATION_SAVES`` (what it keeps for backward)."""
    norm: NormKind = NormKind.layernorm
    """``layernorm`` (weight and bias) or ``rmsnorm`` (weight only): two per block, one before the head."""
    qkv_bias: bool = True
    """The q, k and v projections have biases."""
    out_bias: bool = True
    """The attention's output projection has a bias."""
    mlp_bias: bool = True
    """The MLP's (and experts') matrices have biases."""
    qk_norm: bool = False
    """An RMSNorm over each head's queries and keys (Qwen3)."""
    rotary: bool = False
    """Rotary position embeddings applied to queries and keys."""
    num_positions: int | None = None
    """Rows of the embedding's learned position table; ``seq_len`` when not given, 0 for none (rotary models)."""
    tie_embeddings: bool = False
    """The head's matrix is the input embedding's (held by both stages, counted once in the model's total)."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the MoE blocks' shared expert (every token, scaled by a sigmoid gate: Qwen2-MoE); 0: none."""
    dense_blocks: tuple[int, ...] = ()
    """Blocks that stay dense MLP blocks whatever ``moe_every`` says (transformers' ``mlp_only_layers``)."""
    dropout: bool = False
    """Residual and embedding dropout run in training (``implementation: transformers``; Megatron's count always
    holds its dropout masks)."""
    implementation: BlockCode = BlockCode.megatron
    """Whose code the saved activations are counted for (``BlockCode``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "attention", require_option(AttentionKernel, self.attention, "model.attention"))
        object.__setattr__(self, "norm", require_option(NormKind, self.norm, "model.norm"))
        object.__setattr__(self, "implementation",
                           require_option(BlockCode, self.implementation, "model.implementation"))
        for f in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size"):
            require_int(getattr(self, f), f"model.{f}", minimum=1)
        for f in ("ffn_hidden_size", "num_kv_heads", "head_dim", "expert_ffn_hidden_size"):
            if getattr(self, f) is not None:
                require_int(getattr(self, f), f"model.{f}", minimum=1)
        for f in ("num_experts", "shared_expert_ffn_hidden_size"):
            require_int(getattr(self, f), f"model.{f}", minimum=0)
        if self.num_positions is not None:
            require_int(self.num_positions, "model.num_positions", minimum=0)
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise field_error("model.hidden_size", self.hidden_size,
                              f"be divisible by model.num_heads ({self.num_heads})", "or set model.head_dim")
        if self.num_kv_heads is not None and self.num_heads % self.num_kv_heads:
            raise field_error("model.num_kv_heads", self.num_kv_heads,
                              f"divide model.num_heads ({self.num_heads}): each key/value head serves a group")
        if self.activation not in ACTIVATION_SAVES:
            raise field_error("model.activation", self.activation, f"be one of {', '.join(ACTIVATION_SAVES)}")
        if self.num_experts:
            require_int(self.top_k, "model.top_k", minimum=1)
            require_int(self.moe_every, "model.moe_every", minimum=1)
            if self.top_k > self.num_experts:
                raise field_error("model.top_k", self.top_k, f"be <= model.num_experts ({self.num_experts})")
        object.__setattr__(self, "dense_blocks", tuple(self.dense_blocks))
        for i, block in enumerate(self.dense_blocks):
            require_int(block, f"model.dense_blocks[{i}]")
            if block >= self.num_layers:
                raise field_error(f"model.dense_blocks[{i}]", block, f"be < model.num_layers ({self.num_layers})")

    @property
    def q_width(self) -> int:
        """Width of the queries, num_heads x head_dim."""
        return self.num_heads * self.head_dim if self.head_dim is not None else self.hidden_size

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values), num_kv_heads x head_dim."""
        return self.q_width // self.num_heads * (self.num_kv_heads or self.num_heads)

    def is_moe_block(self, i: int) -> bool:
        """Whether block ``i`` is an MoE block."""
        return self.num_experts > 0 and (i + 1) % self.moe_every == 0 and i not in self.dense_blocks


def transformer_workload(cfg: TransformerConfig, dtype: Dtype | str = Dtype.bf16) -> WorkloadSpec:
    """Per-layer costs of an analytic transformer.

    FLOPs count multiply-adds as 2: q, k and v (GQA: k and v at ``num_kv_heads`` width), scores, scores x V,
    output projection, the MLP's 2 or 3 matrices (gated), the router and the experts a token is routed to; LM
    head 2·s·h·V.  Parameters: the matrices, their biases where the model has them, the norms (``norm``), q/k
    norms, the router, the shared expert and its gate, the position table; a tied head counts its matrix in
    ``LayerCost.tied_params``.  Activation bytes per block: ``block_activation_bytes`` (Megatron's count, or what
    transformers' code keeps); the head keeps its fp32 logits (``_head_cost``).
    """
    dtype = as_dtype(dtype, "model.dtype")
    b = DTYPE_BYTES[dtype]
    s, h = cfg.seq_len, cfg.hidden_size
    boundary = s * h * b
    attn_shape = dict(hidden=h, heads=cfg.num_heads, vocab=cfg.vocab_size, attention=cfg.attention,
                      kv_heads=cfg.num_kv_heads or 0, head_dim=cfg.head_dim or 0, gated=cfg.gated_mlp)
    positions = s if cfg.num_positions is None else cfg.num_positions
    embedding_params = cfg.vocab_size * h + positions * h
    layers = [LayerCost("embedding", 2 * s * h, embedding_params, embedding_activation_bytes(cfg, b),
                        boundary, shape=LayerShape("embedding", **attn_shape), tp_replicated_params=embedding_params)]
    f = cfg.ffn_hidden_size or 4 * h
    for i in range(cfg.num_layers):
        if cfg.is_moe_block(i):
            fe, fs = cfg.expert_ffn_hidden_size or f, cfg.shared_expert_ffn_hidden_size
            moe = MoESpec(num_experts=cfg.num_experts, top_k=cfg.top_k, params_per_expert=mlp_params(cfg, fe),
                          flops_per_token_per_expert=mlp_flops(cfg, 1, fe))
            flops = attention_flops(cfg) + 2 * s * h * cfg.num_experts  # + the router
            params = attention_params(cfg) + h * cfg.num_experts
            if fs:  # the shared expert and its gate (a sigmoid of one h x 1 projection)
                flops, params = flops + mlp_flops(cfg, s, fs) + 2 * s * h, params + mlp_params(cfg, fs) + h
            act, whole = block_activation_bytes(cfg, b, moe=True)
            layers.append(LayerCost(f"block{i}", flops, params, act, boundary, moe, whole,  # experts: priced apart
                                    shape=LayerShape("block", ffn=fs, **attn_shape),
                                    tp_replicated_params=block_replicated_params(cfg, fs) + h * cfg.num_experts))
        else:
            act, whole = block_activation_bytes(cfg, b, moe=False)
            layers.append(LayerCost(f"block{i}", attention_flops(cfg) + mlp_flops(cfg, s, f),
                                    attention_params(cfg) + mlp_params(cfg, f), act, boundary,
                                    tp_replicated_activation_bytes=whole, shape=LayerShape("block", ffn=f, **attn_shape),
                                    tp_replicated_params=block_replicated_params(cfg, f)))
    layers.append(_head_cost(cfg, b, LayerShape("head", **attn_shape)))
    return WorkloadSpec(name=cfg.name, layers=tuple(layers), seq_len=s, dtype=dtype)


def _head_cost(cfg: TransformerConfig, b: int, shape: LayerShape) -> LayerCost:
    """The final norm and the LM head.  Megatron: the logits kept in fp32 twice (the upcast logits and the
    softmax the loss keeps) and the head's input; transformers: the norm's tensors (``norm_activation_bytes``), the
    head's input and the loss's fp32 log-softmax (the upcast is not kept)."""
    s, h, v = cfg.seq_len, cfg.hidden_size, cfg.vocab_size
    params = v * h + norm_params(cfg)
    if cfg.implementation == BlockCode.megatron:
        act = 2 * s * v * 4 + s * h * b
    else:
        act = s * (norm_activation_bytes(cfg, b) + h * b + v * 4)
    return LayerCost("head", 2 * s * h * v, params, act, s * 4, shape=shape, tp_replicated_params=norm_params(cfg),
                     tied_params=v * h if cfg.tie_embeddings else 0)


MODEL_KEYS = {"name", "num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "ffn_hidden_size",
              "num_experts", "top_k", "moe_every", "expert_ffn_hidden_size", "attention", "kind", "description",
              "num_kv_heads", "head_dim", "gated_mlp", "activation", "norm", "qkv_bias", "out_bias", "mlp_bias",
              "qk_norm", "rotary", "num_positions", "tie_embeddings", "shared_expert_ffn_hidden_size", "dense_blocks",
              "dropout", "implementation"}
"""The keys a model mapping (a model YAML file) may hold."""


HF_SOURCE_KEYS = {"name", "hf_config", "seq_len"}
"""The keys of a mapping naming a Hugging Face config (``{"hf_config": "path/config.json", "seq_len": 4096}``):
``het-plan model=<config.json> model.seq_len=4096`` composes one."""


def load_workload(source: str | Path | Mapping[str, Any] | WorkloadSpec,
                  dtype: Dtype | str = Dtype.bf16, seq_len: int | None = None) -> WorkloadSpec:
    """A workload from a shipped model name, a YAML path, a mapping, a Hugging Face config, or a WorkloadSpec.

    A Hugging Face config is a ``config.json`` path, a model directory holding one, a config mapping (with a
    ``model_type``: ``model.config.to_dict()``) or ``{"hf_config": <one of those>, "seq_len": N, "name": ...}``
    (``HF_SOURCE_KEYS``); it is planned at ``seq_len`` tokens per sample (the argument, else the mapping's,
    else ``hf_fields.DEFAULT_SEQ_LEN`` or ``max_position_embeddings`` where smaller).  A model file is read
    with ``files.read_yaml_file`` (one ConfigError naming ``model`` for a file that cannot be read or parsed),
    and an error in its content names the file.
    """
    if isinstance(source, WorkloadSpec):
        return source
    dtype = as_dtype(dtype, "model.dtype")  # before any file is read: a bad dtype is no error in the file
    hf = _hf_model_mapping(source, seq_len)
    if hf is not None:
        return transformer_workload(transformer_config(hf), dtype=dtype)
    if isinstance(source, Mapping):
        return transformer_workload(transformer_config(source), dtype=dtype)
    path, raw = read_yaml_file(config_file("model", source), "model", "model YAML file")
    with naming_file(path, "model file"):
        return transformer_workload(transformer_config({"name": path.stem, **raw}), dtype=dtype)


def _hf_model_mapping(source: str | Path | Mapping[str, Any], seq_len: int | None) -> dict[str, Any] | None:
    """The model mapping of a Hugging Face config ``source`` names (``load_workload``), or None for another."""
    from het_strategy.core.hf_fields import hf_config_path, read_hf_config

    name = None
    if isinstance(source, Mapping) and "hf_config" in source:
        check_keys(source, HF_SOURCE_KEYS, "model")
        name, config = source.get("name"), source["hf_config"]
        seq_len = seq_len if seq_len is not None else source.get("seq_len")
    elif isinstance(source, Mapping) and "model_type" in source:
        config = source
    elif not isinstance(source, Mapping) and (hf_config_path(source) is not None or Path(source).is_dir()):
        config = source
    else:
        return None
    mapping = read_hf_config(config if isinstance(config, Mapping) else str(config)).model_mapping(seq_len)
    return mapping | ({"name": str(name)} if name else {})


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
