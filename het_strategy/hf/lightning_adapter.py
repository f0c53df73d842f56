"""The pipeline a LightningModule gives ``hetero_deepspeed``: its own hooks, or its Hugging Face model's.

A LightningModule that defines ``pipeline_layers()`` and ``pipeline_loss`` gives them (``pipeline_of``).  One that
defines neither and holds one ``PreTrainedModel`` causal LM as a direct child (``self.model = LlamaForCausalLM(...)``)
gets them from the model: ``hf_pipeline_units(model)`` and ``CausalLMLoss(model)``, and its planner workload from the
model's config (``module_workload``: ``core.hf_config.hf_workload``).  Two such children are refused in one line.
An MoE model's experts stay whole in their stage (``expert_layout_note`` says so once).

With tied embeddings (``tie_word_embeddings``) the embedding and the head share one matrix.  A plan may put them on
different stages: each holds a copy, their gradients summed after each backward (``ds_runtime.tied_weights``), so
every copy takes the single process's update (``PlanRunner`` refuses only a tp > 1 stage holding either of them).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from het_strategy.core.errors import field_error

__all__ = ["hf_model_of", "pipeline_layers_of", "pipeline_of", "module_workload", "expert_layout_note"]


def hf_model_of(module: Any) -> Any:
    """The one ``PreTrainedModel`` direct child of ``module``, or None (also when transformers is not imported:
    then no module can hold one)."""
    if "transformers" not in sys.modules or not callable(getattr(module, "named_children", None)):
        return None
    from transformers import PreTrainedModel

    found = [(name, child) for name, child in module.named_children() if isinstance(child, PreTrainedModel)]
    if len(found) > 1:
        raise field_error(f"{type(module).__name__}", [n for n, _ in found], "hold one PreTrainedModel (the model "
                          "hetero_deepspeed cuts into a pipeline), or define pipeline_layers() and pipeline_loss")
    return found[0][1] if found else None


def pipeline_layers_of(module: Any) -> list[Any] | None:
    """``module.pipeline_layers()``, else the units of the Hugging Face causal LM it holds; None when neither."""
    if callable(getattr(module, "pipeline_layers", None)):
        return list(module.pipeline_layers())
    model = hf_model_of(module)
    if model is None:
        return None
    from het_strategy.hf.pipeline_units import hf_pipeline_units

    return hf_pipeline_units(model)


def pipeline_of(module: Any) -> tuple[list[Any], Callable[[Any, Any], Any]] | None:
    """``(layers, loss)`` of ``module``: its ``pipeline_layers()`` and ``pipeline_loss`` (both, or None), else
    those of the Hugging Face causal LM it holds (its units and ``CausalLMLoss``); None when it has neither."""
    own = [callable(getattr(module, hook, None)) for hook in ("pipeline_layers", "pipeline_loss")]
    if any(own):
        return (list(module.pipeline_layers()), module.pipeline_loss) if all(own) else None
    model = hf_model_of(module)
    if model is None:
        return None
    from het_strategy.hf.causal_lm_loss import CausalLMLoss

    layers = pipeline_layers_of(module)
    assert layers is not None  # the module holds a Hugging Face model
    return layers, CausalLMLoss(model)


def module_workload(module: Any, seq_len: int | None, dtype: str) -> Any:
    """The planner's workload of the Hugging Face model ``module`` holds, at ``seq_len`` tokens (None when it holds
    none); a missing ``seq_len`` is refused, naming it."""
    model = hf_model_of(module)
    if model is None or callable(getattr(module, "pipeline_layers", None)):
        return None
    if seq_len is None:
        raise field_error("seq_len", None, "be given to plan or emulate a Hugging Face model (the sequence length "
                          "trained, not max_position_embeddings)", "pass HeteroDeepSpeedStrategy(seq_len=...) or "
                          "workload=")
    from het_strategy.core.hf_config import hf_workload

    return hf_workload(model.config.to_dict(), seq_len, dtype=dtype)



def expert_layout_note(module: Any) -> str | None:
    """One line for an MoE Hugging Face model ``module`` holds: its experts stay whole in each pipeline stage
    (transformers keeps a layer's experts as fused ``[experts, ...]`` tensors, which the uneven expert placement of
    ``het_strategy.moe`` does not split); None for a dense model or a module of its own."""
    model = hf_model_of(module)
    if model is None or callable(getattr(module, "pipeline_layers", None)):
        return None
    experts = getattr(model.config, "num_local_experts", None) or getattr(model.config, "num_experts", None) or 0
    if not experts:
        return None
    return (f"the {experts} experts of each MoE layer of {type(model).__name__} stay whole in their stage: "
            "transformers keeps them as fused tensors, which uneven expert placement (het_strategy.moe) does not "
            "split, so the plan places layers, not experts")
