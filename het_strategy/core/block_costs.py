"""What the parts of an analytic transformer cost: parameters, forward FLOPs and bytes kept for backward.

``core/workload.transformer_workload`` assembles a ``TransformerConfig``'s layers from these: the attention
(q, k, v at their GQA widths, the output projection, biases, q/k norms, the block's two norms), MLPs of two or
three matrices, the norms' and blocks' saved activations as Megatron's blocks keep them (Korthikanti et al.
2022) or as transformers' modeling code does (``BlockCode``).  Pure Python: no torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from het_strategy.core.compute_model import AttentionKernel

_Config = Any
"""What the functions read: a ``core.workload.TransformerConfig`` (not imported here: it imports this module)."""

__all__ = ["BlockCode", "NormKind", "ACTIVATION_SAVES", "norm_params", "attention_params", "attention_flops",
           "block_replicated_params", "mlp_params", "mlp_flops", "embedding_activation_bytes", "norm_activation_bytes",
           "block_activation_bytes"]


class BlockCode(StrEnum):
    """Whose block code a transformer's saved activations are counted for (a model YAML's ``implementation``)."""

    megatron = "megatron"
    """Megatron-style GPT blocks (Korthikanti et al. 2022: dropout after attention and MLP, 16-bit layer norms)."""
    transformers = "transformers"
    """Hugging Face transformers' modeling code (``LlamaDecoderLayer``, ``GPT2Block``, ...): its RMSNorm upcasts
    to fp32, rotary embeddings, sdpa attention, gated MLP and MoE experts as they run in training."""


class NormKind(StrEnum):
    """A block's normalisation layers."""

    layernorm = "layernorm"
    """LayerNorm: a weight and a bias of width h."""
    rmsnorm = "rmsnorm"
    """RMSNorm: a weight of width h (transformers computes it in fp32)."""


ACTIVATION_SAVES = {"gelu": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1, "silu": 1, "swish": 1, "relu": 1,
                    "gelu_new": 4}
"""MLP activations a model may name, and how many tensors of the MLP's width each keeps for backward in
transformers' code (``gelu_new`` is written as Python ops: its input, tanh, 0.5·x and 1 + tanh)."""


def norm_params(cfg: _Config) -> int:
    """One norm's parameters."""
    return cfg.hidden_size * (2 if cfg.norm == NormKind.layernorm else 1)


def attention_params(cfg: _Config) -> int:
    """q, k, v and the output projection with their biases, the q/k norms, and the block's two norms."""
    h, q, kv = cfg.hidden_size, cfg.q_width, cfg.kv_width
    head_dim = q // cfg.num_heads
    return (h * (q + 2 * kv) + cfg.qkv_bias * (q + 2 * kv) + q * h + cfg.out_bias * h
            + cfg.qk_norm * 2 * head_dim + 2 * norm_params(cfg))


def block_replicated_params(cfg: _Config, f: int) -> int:
    """Of a block with an MLP of width ``f`` (0: none), the parameters tensor parallelism keeps whole on every rank:
    the two norms, the q/k norms and the biases of the row-parallel linears (the attention's output projection, the
    MLP's last matrix); the column-parallel linears and their biases are split."""
    head_dim = cfg.q_width // cfg.num_heads
    return (2 * norm_params(cfg) + cfg.qk_norm * 2 * head_dim + cfg.out_bias * cfg.hidden_size
            + (cfg.mlp_bias * cfg.hidden_size if f else 0))


def attention_flops(cfg: _Config) -> int:
    """Forward FLOPs of a block's attention for one sample: projections, scores and scores x V."""
    s, h, q, kv = cfg.seq_len, cfg.hidden_size, cfg.q_width, cfg.kv_width
    return 2 * s * h * (q + 2 * kv) + 2 * s * q * h + 4 * s * s * q


def mlp_params(cfg: _Config, f: int) -> int:
    """An MLP of width ``f`` (2 or 3 matrices, with or without biases)."""
    h = cfg.hidden_size
    if cfg.gated_mlp:
        return 3 * h * f + cfg.mlp_bias * (2 * f + h)
    return 2 * h * f + cfg.mlp_bias * (f + h)


def mlp_flops(cfg: _Config, tokens: int, f: int) -> int:
    """Forward FLOPs of an MLP of width ``f`` over ``tokens`` tokens."""
    return 2 * tokens * cfg.hidden_size * f * (3 if cfg.gated_mlp else 2)


def embedding_activation_bytes(cfg: _Config, b: int) -> float:
    """Bytes the embedding keeps per sample: Megatron's count (one s x h tensor), or transformers' (the int64
    token ids, and the dropout mask where dropout runs)."""
    s, h = cfg.seq_len, cfg.hidden_size
    if cfg.implementation == BlockCode.megatron:
        return s * h * b
    return 8 * s + (s * h if cfg.dropout else 0)


def norm_activation_bytes(cfg: _Config, b: int) -> float:
    """Bytes per token one norm keeps in transformers' code (its output, the next matmul's input, not counted):
    LayerNorm its input and fp32 mean and rstd; RMSNorm its input in fp32 (an upcast copy in 16 bits), its
    fp32 rstd and the normalised tensor before the weight."""
    h = cfg.hidden_size
    if cfg.norm == NormKind.layernorm:
        return h * b + 8
    return 4 * h + 4 + h * b


def block_activation_bytes(cfg: _Config, b: int, moe: bool) -> tuple[float, float]:
    """(bytes kept for backward, of which whole on every tp rank) per sample of one block.

    Megatron (Korthikanti et al. 2022): s·h·(34 + 5·a·s/h) bytes in a 16-bit dtype without recomputation, of
    which 10·s·h stay whole on every tensor-parallel rank (their eq. 2).  The 5·a·s² bytes are the attention
    scores' softmax output, dropout mask and dropout output, which only ``attention: materialized`` writes;
    ``fused`` attention (torch's ``scaled_dot_product_attention``) keeps the s·h-sized tensors and its fp32
    log-sum-exp, 4·a·s bytes, instead.  An MoE block adds the ``top_k`` routed copies of its input.

    transformers: ``_transformers_block_bytes``.
    """
    s, h, a = cfg.seq_len, cfg.hidden_size, cfg.num_heads
    if cfg.implementation == BlockCode.transformers:
        return _transformers_block_bytes(cfg, b, moe)
    scale = b / 2
    if cfg.attention == AttentionKernel.materialized:
        act = (s * h * 34 + 5 * a * s * s) * scale
    else:  # the scores stay on chip; the kernel saves its fp32 log-sum-exp per head and token
        act = s * h * 34 * scale + 4 * a * s
    if moe:
        act = act + s * h * cfg.top_k * b
    return act, s * h * 10 * scale  # layer-norm inputs and dropout masks: whole on every tp rank


def _transformers_block_bytes(cfg: _Config, b: int, moe: bool) -> tuple[float, float]:
    """What transformers' decoder layer keeps per sample in training (each storage once), ``fused`` attention:

    1. each norm: ``norm_activation_bytes``, and its output (the input of q/k/v, of the MLP and the router);
    2. q and k as the attention gets them (GPT-2: views of one qkv output), v (rotary embeddings keep nothing
       per token: their cos and sin need no gradient, so the products keep only those, shared by all layers);
       q/k norms their fp32 inputs, rstd and normalised tensors; sdpa its output (the output projection's
       input) and its fp32 log-sum-exp per head;
    3. the MLP: its down projection's input and what the activation keeps (``ACTIVATION_SAVES``; gated: also
       the up projection and the activation's output), per expert per routed token plus the routed input and
       the expert's output; the router's fp32 probabilities; a shared expert's MLP and its gated output;
    4. dropout masks (1 byte per element) after attention and the MLP where dropout runs.
    Whole on every tp rank: the norms' tensors and outputs and the dropout masks.
    """
    s, h, q, kv = cfg.seq_len, cfg.hidden_size, cfg.q_width, cfg.kv_width
    norms = 2 * (norm_activation_bytes(cfg, b) + h * b)
    attn = (q + 2 * kv) * b + q * b + 4 * cfg.num_heads
    if cfg.qk_norm:  # each norm's fp32 input, its rstd per head and its normalised tensor
        attn += (4 + b) * (q + kv) + 4 * (cfg.num_heads + (cfg.num_kv_heads or cfg.num_heads))
    masks = 2 * h if cfg.dropout else 0
    if not moe:
        mlp = _mlp_activation_bytes(cfg, cfg.ffn_hidden_size or 4 * h, b)
    else:
        fe = cfg.expert_ffn_hidden_size or cfg.ffn_hidden_size or 4 * h
        mlp = cfg.top_k * (_mlp_activation_bytes(cfg, fe, b) + 2 * h * b + 16) + 4 * cfg.num_experts
        if cfg.shared_expert_ffn_hidden_size:
            mlp += _mlp_activation_bytes(cfg, cfg.shared_expert_ffn_hidden_size, b) + h * b + 2 * b
    return s * (norms + attn + mlp + masks), s * (norms + masks)


def _mlp_activation_bytes(cfg: _Config, f: int, b: int) -> float:
    """Bytes per token an MLP of width ``f`` keeps in transformers' code."""
    kept = 1 + ACTIVATION_SAVES[cfg.activation] + (2 if cfg.gated_mlp else 0)
    return kept * f * b
