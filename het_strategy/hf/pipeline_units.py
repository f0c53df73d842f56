"""A Hugging Face causal LM as pipeline units cut along its own ``base_model_pp_plan``: ``hf_pipeline_units``.

The units (``L + 2`` for ``L`` decoder layers, the workload's layers in order): ``HFEmbedding`` (the plan's
embedding entries), one ``HFDecoderLayer`` per entry of its layer list, ``HFHead`` (its final norm and the
model's output embedding, ``lm_head``).  Each wraps the model's own modules (the same parameters), so a unit's
state is the model's under other names: ``hf_names()`` maps one to the other.

What crosses a stage boundary is a tuple of tensors, as DeepSpeed's pipeline sends them:
``(hidden_states, attention_mask, position_ids)``: the float hidden states (the only tensor with a gradient), the
2-D padding mask and the position ids, both integer, carried unchanged.  Each decoder layer recomputes what the
model's forward computes once: the causal (or sliding-window) mask with padding, from the model's own
``masking_utils`` functions, and the rotary position embeddings, from the model's own rotary module (no
parameters).  Position ids are ``0 .. T-1`` on every row, as the model's forward makes them.

Models whose config class declares no ``base_model_pp_plan`` (GPT-2) are cut by the documented fallback
``transformer.h``: ``wte`` + ``wpe`` (+ dropout), each block of ``h``, ``ln_f`` + ``lm_head``; any other is refused in
one line.  No per-family code otherwise: the layout is read from the plan and the modules found by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from het_strategy.core.errors import field_error

__all__ = ["BaseLayout", "base_layout", "HFEmbedding", "HFDecoderLayer", "HFHead", "hf_pipeline_units"]


@dataclass(frozen=True)
class BaseLayout:
    """Where a causal LM's parts are in its base model, by submodule name."""

    embeddings: tuple[str, ...]
    """The token embedding, then (GPT-2) a learned position embedding, added to it."""
    layers: str
    """The ``nn.ModuleList`` of decoder layers."""
    norm: str
    """The final norm before the LM head."""
    dropout: str | None = None
    """A dropout after the embeddings (GPT-2's ``drop``), or None."""


_FALLBACK = BaseLayout(embeddings=("wte", "wpe"), layers="h", norm="ln_f", dropout="drop")
"""The layout of a base model without a pp plan in GPT-2's form (``transformer.h``)."""


def base_layout(model: Any) -> BaseLayout:
    """The layout of ``model``'s base model from its config's ``base_model_pp_plan`` (or the GPT-2 fallback)."""
    base, config = model.base_model, model.config
    plan = getattr(config, "base_model_pp_plan", None)
    kind = f"{type(model).__name__}.config"
    if not plan:
        if all(isinstance(getattr(base, n, None), nn.Module) for n in ("wte", "h", "ln_f")):
            return BaseLayout(embeddings=tuple(n for n in _FALLBACK.embeddings if hasattr(base, n)), layers="h",
                              norm="ln_f", dropout="drop" if isinstance(getattr(base, "drop", None), nn.Module)
                              else None)
        raise field_error(f"{kind}.base_model_pp_plan", None, "be declared by the model's config class "
                          "(Llama, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE do), or the base model be GPT-2's "
                          "wte/h/ln_f (the fallback)", "use hetero (data parallel) for this model")
    names = list(plan)
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1 or names.index(lists[0]) in (0, len(names) - 1) or len(names) - names.index(lists[0]) != 2:
        raise field_error(f"{kind}.base_model_pp_plan", names, "be embedding(s), one layer list, one final "
                          "norm (the causal-LM form)")
    i = names.index(lists[0])
    return BaseLayout(embeddings=tuple(names[:i]), layers=lists[0], norm=names[-1])


class _Named(nn.Module):
    """A unit whose state keys map to the Hugging Face model's (``hf_names``)."""

    def __init__(self, paths: dict[str, str]) -> None:
        super().__init__()
        self._hf_paths = dict(paths)

    def hf_names(self) -> dict[str, str]:
        """This unit's ``state_dict()`` key -> the key of the same tensor in the Hugging Face model's ``state_dict()``
        (e.g. ``layer.self_attn.q_proj.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)."""
        out = {}
        for key in self.state_dict():
            head, _, rest = key.partition(".")
            out[key] = f"{self._hf_paths[head]}.{rest}" if head in self._hf_paths else key
        return out


def _split_inputs(inputs: tuple[Any, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(input_ids, attention_mask or None)`` from what the first stage is called with (a tensor, or a tuple)."""
    if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
        inputs = tuple(inputs[0])
    if not 1 <= len(inputs) <= 2:
        raise field_error("batch inputs", f"{len(inputs)} tensors", "be input_ids or (input_ids, attention_mask)")
    return inputs[0], inputs[1] if len(inputs) == 2 else None


class HFEmbedding(_Named):
    """Pipeline unit 0: the token embedding (plus GPT-2's position embedding and dropout); emits the stage tuple."""

    def __init__(self, token: nn.Module, position: nn.Module | None, dropout: nn.Module | None,
                 paths: dict[str, str]) -> None:
        super().__init__(paths)
        self.token = token
        self.position = position
        self.dropout = dropout

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids, mask = _split_inputs(inputs)
        batch, seq = ids.shape
        positions = torch.arange(seq, device=ids.device).unsqueeze(0).expand(batch, seq).contiguous()
        hidden = self.token(ids)
        if self.position is not None:
            hidden = hidden + self.position(positions)
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        if mask is None:
            mask = torch.ones_like(ids)
        return hidden, mask.to(torch.int64), positions


def _mask_function(config: Any, index: int) -> Callable[..., Any]:
    """The model's mask builder for layer ``index``: sliding-window where the config says the layer slides
    (``layer_types``, else a ``sliding_window`` set), causal otherwise."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        sliding = kinds[index] == "sliding_attention"
    else:
        sliding = getattr(config, "sliding_window", None) is not None
    return create_sliding_window_causal_mask if sliding else create_causal_mask


class HFDecoderLayer(_Named):
    """One decoder layer: rebuilds the attention mask and rotary embeddings as the model's forward does, then runs
    the layer on the hidden states; passes the mask and position ids on."""

    def __init__(self, layer: nn.Module, rotary: nn.Module | None, config: Any, index: int,
                 paths: dict[str, str], tp_plan: Any = None) -> None:
        super().__init__(paths)
        self.layer = layer
        self.rotary_emb = rotary
        self.config = config
        self.index = index
        self.num_attention_heads = int(config.num_attention_heads)
        """The layer's query heads (divided by tp on a tensor-parallel stage)."""
        kv = getattr(config, "num_key_value_heads", None)
        self.num_key_value_heads = int(kv if kv is not None else config.num_attention_heads)
        """The layer's key/value heads (divided by tp on a tensor-parallel stage: GQA needs whole kv heads)."""
        self._mask = _mask_function(config, index)
        self._tp_plan = tp_plan

    def forward(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden, mask, positions = inputs
        causal = self._mask(config=self.config, inputs_embeds=hidden, attention_mask=mask, cache=None,
                            position_ids=positions)
        extra = {}
        if self.rotary_emb is not None:
            extra["position_embeddings"] = self.rotary_emb(hidden, position_ids=positions)
        out = self.layer(hidden, attention_mask=causal, position_ids=positions, **extra)
        if isinstance(out, tuple):
            out = out[0]
        return out, mask, positions

    def tensor_parallel_plan(self) -> Any:
        """The layer's split from the config's ``base_model_tp_plan`` (``tp_mapping``), or None."""
        return self._tp_plan


class HFHead(_Named):
    """The last unit: the final norm and the output embedding (``lm_head``); returns the logits."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, paths: dict[str, str], tp_plan: Any = None) -> None:
        super().__init__(paths)
        self.norm = norm
        self.lm_head = lm_head
        self._tp_plan = tp_plan

    def forward(self, inputs: Any) -> torch.Tensor:
        hidden = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
        return self.lm_head(self.norm(hidden))

    def tensor_parallel_plan(self) -> Any:
        """The LM head split by vocabulary columns, its logits gathered (the model's ``_tp_plan``), or None."""
        return self._tp_plan


def hf_pipeline_units(model: Any) -> list[nn.Module]:
    """``model`` (a ``PreTrainedModel`` causal LM) as ``[embedding, layer 0, ..., layer L-1, head]``: its own
    modules, cut along its ``base_model_pp_plan``; decoder layers and head carry the tp plan of ``tp_mapping``."""
    from het_strategy.hf.tp_mapping import decoder_layer_plan, head_plan

    layout = base_layout(model)
    base, config = model.base_model, model.config
    where = {id(m): name for name, m in model.named_modules()}
    lm_head = model.get_output_embeddings()
    if lm_head is None:
        raise field_error(f"{type(model).__name__}.get_output_embeddings()", None, "be the LM head (a causal LM)")
    emb = [getattr(base, n) for n in layout.embeddings]
    dropout = getattr(base, layout.dropout) if layout.dropout else None
    names = ["token", "position"][:len(emb)]
    embedding = HFEmbedding(emb[0], emb[1] if len(emb) > 1 else None, dropout,
                            {n: where[id(m)] for n, m in zip(names, emb)})
    rotary = getattr(base, "rotary_emb", None)
    blocks = [HFDecoderLayer(layer, rotary, config, i, {"layer": where[id(layer)]},
                             decoder_layer_plan(config, layer, layout.layers, "layer"))
              for i, layer in enumerate(getattr(base, layout.layers))]
    norm = getattr(base, layout.norm)
    head = HFHead(norm, lm_head, {"norm": where[id(norm)], "lm_head": where[id(lm_head)]}, head_plan(model))
    return [embedding, *blocks, head]
