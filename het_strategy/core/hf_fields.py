"""Reading a Hugging Face ``config.json`` as plain JSON (no transformers, no torch): the fields of each family.

``read_hf_config`` reads a config (a ``config.json`` path, a model directory holding one, or the mapping of
``model.config.to_dict()``) into an ``HFModelConfig``: the fields of its family (``HF_FAMILIES``: llama, mistral,
qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gpt2) under their transformers names.  A field transformers' config
class computes when it is absent gets that value (``head_dim`` = hidden_size // num_attention_heads,
``num_key_value_heads`` = num_attention_heads, the biases and ``tie_word_embeddings`` of the family's class);
a size (``hidden_size``, ``intermediate_size``, ``num_local_experts``, ...) must be given.  An unknown
``model_type`` or a missing or bad field is one ``ConfigError`` naming ``model.<field>``.

``HFModelConfig.model_mapping(seq_len)`` is the model in the model YAML schema (``core/workload.MODEL_KEYS``,
``implementation: transformers``), which ``workload.load_workload`` and ``hf_config.hf_workload`` price.  The
sequence length is the caller's: at most ``max_position_embeddings``, ``DEFAULT_SEQ_LEN`` (or
``max_position_embeddings`` where smaller) when not given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from het_strategy.core.errors import field_error, require_int
from het_strategy.core.files import naming_file, read_json_file
from het_strategy.core.block_costs import ACTIVATION_SAVES, BlockCode, NormKind

__all__ = ["CONFIG_FILE", "DEFAULT_SEQ_LEN", "HF_FAMILIES", "HFModelConfig", "hf_config_path", "read_hf_config"]

CONFIG_FILE = "config.json"
"""The file a model directory (``save_pretrained``'s) holds its config in."""
DEFAULT_SEQ_LEN = 2048
"""Tokens per sample ``het-plan model=<config.json>`` plans for when ``model.seq_len`` is not given (at most the
model's ``max_position_embeddings``)."""


@dataclass(frozen=True)
class HFModelConfig:
    """What the planner reads of a Hugging Face causal LM's config (transformers' field names in the comments)."""

    model_type: str
    """The family (``model_type``)."""
    name: str
    """Model name: the model directory's name, the file's stem, or ``_name_or_path``."""
    num_layers: int
    """Decoder layers (``num_hidden_layers``; GPT-2 ``n_layer``)."""
    hidden_size: int
    """Model width (``hidden_size``; GPT-2 ``n_embd``)."""
    num_heads: int
    """Query heads (``num_attention_heads``; GPT-2 ``n_head``)."""
    num_kv_heads: int
    """Key/value heads (``num_key_value_heads``)."""
    head_dim: int
    """Width of one head (``head_dim``)."""
    intermediate_size: int
    """Width of the dense MLP (``intermediate_size``; GPT-2 ``n_inner`` or 4 x n_embd)."""
    vocab_size: int
    """Vocabulary (``vocab_size``)."""
    max_position_embeddings: int
    """Longest sequence the model takes (``max_position_embeddings``; GPT-2 ``n_positions``)."""
    hidden_act: str
    """The MLP's activation (``hidden_act``; GPT-2 ``activation_function``)."""
    norm: NormKind
    """RMSNorm (the Llama-like families) or LayerNorm (GPT-2)."""
    gated_mlp: bool
    """Gate, up and down projections (every family but GPT-2)."""
    tie_word_embeddings: bool
    """The lm_head is the token embedding (``tie_word_embeddings``)."""
    qkv_bias: bool
    """Biases on q, k and v (llama/qwen3 ``attention_bias``, qwen2 always, qwen2_moe ``qkv_bias``, GPT-2)."""
    out_bias: bool
    """A bias on the attention's output projection (llama/qwen3 ``attention_bias``, GPT-2)."""
    mlp_bias: bool
    """Biases on the MLP's matrices (llama ``mlp_bias``, GPT-2)."""
    qk_norm: bool
    """RMSNorms over each head's queries and keys (qwen3, qwen3_moe)."""
    rotary: bool
    """Rotary position embeddings (every family but GPT-2)."""
    position_table: bool
    """A learned position table of ``max_position_embeddings`` rows (GPT-2's ``wpe``)."""
    dropout: bool
    """Residual or embedding dropout in training (GPT-2 ``resid_pdrop``/``embd_pdrop`` > 0)."""
    num_experts: int = 0
    """Routed experts per MoE layer (``num_local_experts``; qwen MoE ``num_experts``); 0: dense."""
    top_k: int = 0
    """Experts per token (``num_experts_per_tok``)."""
    expert_intermediate_size: int = 0
    """Width of one expert (mixtral ``intermediate_size``; qwen MoE ``moe_intermediate_size``)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert (qwen2_moe ``shared_expert_intermediate_size``); 0: none."""
    decoder_sparse_step: int = 1
    """Layer i is MoE when (i + 1) % decoder_sparse_step == 0 (``decoder_sparse_step``)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers kept dense (``mlp_only_layers``)."""

    @property
    def default_seq_len(self) -> int:
        """The tokens per sample planned when the caller gives none: ``DEFAULT_SEQ_LEN`` or, where smaller,
        ``max_position_embeddings``."""
        return min(DEFAULT_SEQ_LEN, self.max_position_embeddings)

    def model_mapping(self, seq_len: int | None = None) -> dict[str, Any]:
        """This model in the model YAML schema at ``seq_len`` tokens per sample (None: ``default_seq_len``); a
        ``seq_len`` over ``max_position_embeddings`` is refused."""
        if seq_len is None:
            seq_len = self.default_seq_len
        require_int(seq_len, "model.seq_len", minimum=1)
        if seq_len > self.max_position_embeddings:
            raise field_error("model.seq_len", seq_len, f"be <= max_position_embeddings "
                              f"({self.max_position_embeddings}) of `{self.name}`", "set a shorter model.seq_len")
        return dict(
            name=self.name, num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
            seq_len=seq_len, vocab_size=self.vocab_size, ffn_hidden_size=self.intermediate_size,
            num_experts=self.num_experts, top_k=self.top_k or 2, moe_every=self.decoder_sparse_step,
            expert_ffn_hidden_size=self.expert_intermediate_size or None, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, gated_mlp=self.gated_mlp, activation=self.hidden_act, norm=self.norm.value,
            qkv_bias=self.qkv_bias, out_bias=self.out_bias, mlp_bias=self.mlp_bias, qk_norm=self.qk_norm,
            rotary=self.rotary, num_positions=self.max_position_embeddings if self.position_table else 0,
            tie_embeddings=self.tie_word_embeddings, shared_expert_ffn_hidden_size=self.shared_expert_intermediate_size,
            dense_blocks=list(self.mlp_only_layers), dropout=self.dropout, implementation=BlockCode.transformers.value)


_REQUIRED = object()
_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts", "n_embd": "hidden_size",
            "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_positions": "max_position_embeddings"}
"""The other name a config class's ``attribute_map`` gives a field (Qwen3-MoE's ``to_dict()`` writes
``num_local_experts``, its published config.json ``num_experts``): read where the first name is absent."""


class _Fields:
    """Typed reads of a config mapping; an error names ``model.<key>``."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.raw = raw

    def get(self, key: str, default: Any = None) -> Any:
        if self.raw.get(key) is None and key in _ALIASES and self.raw.get(_ALIASES[key]) is not None:
            return self.raw[_ALIASES[key]]
        return self.raw.get(key, default)

    def int(self, key: str, default: Any = _REQUIRED, minimum: int = 1) -> int:
        value = self.get(key)
        if value is None:
            if default is _REQUIRED:
                raise field_error(f"model.{key}", None, "be given (an integer; the config's model_type "
                                  f"`{self.raw.get('model_type')}` has no default for it)")
            return default
        return require_int(value, f"model.{key}", minimum=minimum)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise field_error(f"model.{key}", value, "be true or false")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise field_error(f"model.{key}", value, "be a number >= 0")
        return float(value)

    def activation(self, key: str, default: str) -> str:
        value = self.raw.get(key, default)
        if value not in ACTIVATION_SAVES:
            raise field_error(f"model.{key}", value, f"be one of {', '.join(ACTIVATION_SAVES)}")
        return str(value)

    def layers(self, key: str, num_layers: int) -> tuple[int, ...]:
        value = self.raw.get(key) or []
        if not isinstance(value, (list, tuple)):
            raise field_error(f"model.{key}", value, "be a list of layer indices")
        for i, layer in enumerate(value):
            require_int(layer, f"model.{key}[{i}]")
            if layer >= num_layers:
                raise field_error(f"model.{key}[{i}]", layer, f"be < num_hidden_layers ({num_layers})")
        return tuple(value)


def _attention(f: _Fields, hidden: int, heads: int, head_dim: Any = None) -> dict[str, int]:
    """Heads, key/value heads and head width, with the config classes' rules for the missing ones."""
    if head_dim is None and hidden % heads:
        raise field_error("model.hidden_size", hidden, f"be divisible by num_attention_heads ({heads})",
                          "or give head_dim")
    kv = f.int("num_key_value_heads", heads)
    if heads % kv:
        raise field_error("model.num_key_value_heads", kv, f"divide num_attention_heads ({heads})")
    return {"num_heads": heads, "num_kv_heads": kv, "head_dim": f.int("head_dim", head_dim or hidden // heads)}


def _llama_like(f: _Fields, *, tie: bool = False, max_positions: int, qkv_bias: bool = False,
                out_bias: bool = False, mlp_bias: bool = False, qk_norm: bool = False,
                head_dim: int | None = None) -> dict[str, Any]:
    """The fields the Llama-like families share (RMSNorm, rotary, gated MLP, untied head by default)."""
    hidden = f.int("hidden_size")
    num_layers = f.int("num_hidden_layers")
    return dict(num_layers=num_layers, hidden_size=hidden, **_attention(f, hidden, f.int("num_attention_heads"),
                                                                         head_dim),
                intermediate_size=f.int("intermediate_size"), vocab_size=f.int("vocab_size"),
                max_position_embeddings=f.int("max_position_embeddings", max_positions),
                hidden_act=f.activation("hidden_act", "silu"), norm=NormKind.rmsnorm, gated_mlp=True,
                tie_word_embeddings=f.flag("tie_word_embeddings", tie), qkv_bias=qkv_bias, out_bias=out_bias,
                mlp_bias=mlp_bias, qk_norm=qk_norm, rotary=True, position_table=False, dropout=False)


def _llama(f: _Fields) -> dict[str, Any]:
    bias = f.flag("attention_bias", False)
    return _llama_like(f, max_positions=2048, qkv_bias=bias, out_bias=bias, mlp_bias=f.flag("mlp_bias", False))


def _mistral(f: _Fields) -> dict[str, Any]:
    return _llama_like(f, max_positions=131072)


def _qwen2(f: _Fields) -> dict[str, Any]:
    return _llama_like(f, max_positions=32768, qkv_bias=True)


def _qwen3(f: _Fields) -> dict[str, Any]:
    bias = f.flag("attention_bias", False)
    return _llama_like(f, max_positions=32768, qkv_bias=bias, out_bias=bias, qk_norm=True, head_dim=128)


def _mixtral(f: _Fields) -> dict[str, Any]:
    out = _llama_like(f, max_positions=131072)
    experts = f.int("num_local_experts")
    return out | dict(num_experts=experts, top_k=_top_k(f, experts, "num_local_experts"),
                      expert_intermediate_size=out["intermediate_size"])


def _qwen_moe(f: _Fields, dense: dict[str, Any]) -> dict[str, Any]:
    experts = f.int("num_experts", minimum=0)
    return dense | dict(num_experts=experts, top_k=_top_k(f, experts, "num_experts") if experts else 0,
                        expert_intermediate_size=f.int("moe_intermediate_size"),
                        decoder_sparse_step=f.int("decoder_sparse_step", 1),
                        mlp_only_layers=f.layers("mlp_only_layers", dense["num_layers"]))


def _qwen2_moe(f: _Fields) -> dict[str, Any]:
    out = _qwen_moe(f, _llama_like(f, max_positions=32768, qkv_bias=f.flag("qkv_bias", True)))
    return out | dict(shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", minimum=0))


def _qwen3_moe(f: _Fields) -> dict[str, Any]:
    bias = f.flag("attention_bias", False)
    return _qwen_moe(f, _llama_like(f, max_positions=32768, qkv_bias=bias, out_bias=bias, qk_norm=True))


def _top_k(f: _Fields, experts: int, experts_key: str) -> int:
    k = f.int("num_experts_per_tok")
    if k > experts:
        raise field_error("model.num_experts_per_tok", k, f"be <= {experts_key} ({experts})")
    return k


def _gpt2(f: _Fields) -> dict[str, Any]:
    hidden, heads = f.int("n_embd"), f.int("n_head")
    if hidden % heads:
        raise field_error("model.n_embd", hidden, f"be divisible by n_head ({heads})")
    dropout = f.number("resid_pdrop", 0.1) > 0 or f.number("embd_pdrop", 0.1) > 0
    return dict(num_layers=f.int("n_layer"), hidden_size=hidden, num_heads=heads, num_kv_heads=heads,
                head_dim=hidden // heads, intermediate_size=f.int("n_inner", 4 * hidden),
                vocab_size=f.int("vocab_size"), max_position_embeddings=f.int("n_positions"),
                hidden_act=f.activation("activation_function", "gelu_new"), norm=NormKind.layernorm,
                gated_mlp=False, tie_word_embeddings=f.flag("tie_word_embeddings", True), qkv_bias=True,
                out_bias=True, mlp_bias=True, qk_norm=False, rotary=False, position_table=True, dropout=dropout)


HF_FAMILIES: dict[str, Callable[[_Fields], dict[str, Any]]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "gpt2": _gpt2}
"""The ``model_type`` values read, and the reader of each family's fields."""


def hf_config_path(source: str | Path) -> Path | None:
    """The ``config.json`` that ``source`` names: a model directory holding one, or a ``.json`` file that is not a
    saved profile (``.model.json``); None when ``source`` names neither."""
    path = Path(source).expanduser()
    if os.path.isdir(path) and os.path.isfile(path / CONFIG_FILE):
        return path / CONFIG_FILE
    if path.suffix.lower() == ".json" and not path.name.endswith(".model.json"):
        return path
    return None


def read_hf_config(source: str | Path | Mapping[str, Any]) -> HFModelConfig:
    """The ``HFModelConfig`` of a config.json path, a directory holding one, or a config mapping."""
    if isinstance(source, Mapping):
        return _from_mapping(source, str(source.get("_name_or_path") or source.get("model_type") or "model"))
    path = hf_config_path(source)
    if path is None:
        raise field_error("model", str(source), f"be a Hugging Face config.json or a model directory holding "
                          f"{CONFIG_FILE}")
    path, raw = read_json_file(path, "model", "Hugging Face config.json")
    if not isinstance(raw, Mapping):
        raise field_error("model", str(path), "hold a JSON object (a Hugging Face model config)")
    name = path.parent.name if path.name == CONFIG_FILE and path.parent.name else path.stem
    with naming_file(path, "model config"):
        return _from_mapping(raw, name)


def _from_mapping(raw: Mapping[str, Any], name: str) -> HFModelConfig:
    model_type = raw.get("model_type")
    family = HF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise field_error("model.model_type", model_type, f"be one of {', '.join(HF_FAMILIES)}",
                          "the families whose config.json het-plan reads")
    return HFModelConfig(model_type=model_type, name=name, **family(_Fields(raw)))
