"""A Hugging Face model's own tensor-parallel plan as ``het_strategy.tensor_parallel`` plans, per pipeline unit.

The config class's ``base_model_tp_plan`` names each decoder layer's linears by pattern
(``layers.*.self_attn.q_proj: colwise``, ``layers.*.self_attn.o_proj: rowwise``, ``layers.*.mlp.down_proj:
rowwise``, ...); the causal-LM class's ``_tp_plan`` names the LM head (``colwise_gather_output``).  They map:

- ``colwise`` -> ``Colwise()`` (each rank computes its heads, or its part of the MLP's width);
- ``rowwise`` -> ``Rowwise()`` (partial outputs all-reduced);
- ``colwise_gather_output`` / ``colwise_rep`` on the head -> ``Colwise(gather_output=True)`` (whole logits);
- ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms) -> replicated, its gradient summed over the
  group (``TensorParallelPlan.summed``): each rank's gradient covers its own heads only;
- anything else (the embedding's ``embedding_rowwise``, expert-parallel styles) runs replicated: whole on each rank
  of the group, which is exact (its input is whole there).

A pattern naming a submodule a layer lacks (a dense MLP's names on an MoE layer) is skipped for that layer.  Each
rank keeps ``num_attention_heads / tp`` query and ``num_key_value_heads / tp`` kv heads (``divide``): a tp that
does not divide the kv heads of a GQA model is refused by ``tensor_parallel.tp_plan.check_layers``, naming both.
"""

from __future__ import annotations

from typing import Any

from het_strategy.tensor_parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan, _resolve

__all__ = ["decoder_layer_plan", "head_plan"]

_GATHERED = ("colwise_gather_output", "colwise_rep")
"""The LM head's styles whose output is gathered whole (logits for the loss)."""

_SUMMED = "replicated_with_grad_allreduce"


def decoder_layer_plan(config: Any, layer: Any, layers_name: str, attr: str) -> TensorParallelPlan | None:
    """The plan of one decoder layer held as ``attr`` in its unit (``layers_name``: the base model's layer list)."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    prefix = f"{layers_name}.*."
    linears: dict[str, Colwise | Rowwise] = {}
    summed: list[str] = []
    for pattern, style in plan.items():
        if not pattern.startswith(prefix):
            continue
        path = pattern[len(prefix):]
        try:
            target = _resolve(layer, path)
        except (AttributeError, IndexError, KeyError):
            continue
        if style == "colwise":
            linears[f"{attr}.{path}"] = Colwise()
        elif style == "rowwise":
            linears[f"{attr}.{path}"] = Rowwise()
        elif style == _SUMMED:
            summed += [f"{attr}.{path}.{n}" for n, _ in target.named_parameters()]
    if not linears:
        return None
    return TensorParallelPlan(linears=linears, divide=("num_key_value_heads", "num_attention_heads"),
                              summed=tuple(summed))


def head_plan(model: Any) -> TensorParallelPlan | None:
    """The LM head's plan from the model's ``_tp_plan`` (``lm_head: colwise_gather_output``), or None."""
    plan = getattr(model, "_tp_plan", None) or {}
    if plan.get("lm_head") in _GATHERED:
        return TensorParallelPlan(linears={"lm_head": Colwise(gather_output=True)})
    return None
