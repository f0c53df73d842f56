"""A Hugging Face causal LM's planner workload from its ``config.json`` (plain JSON: no transformers, no torch).

``hf_workload(config, seq_len, dtype)`` prices a config (a ``config.json`` path, a model directory holding one,
the mapping of ``model.config.to_dict()``, or an ``HFModelConfig``) as L + 2 layers: ``embedding``, one
``block<i>`` per decoder layer, ``head`` (final norm + lm_head).  Its fields are read by ``core/hf_fields.py``;
the costs are ``core/workload.transformer_workload``'s with ``implementation: transformers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from het_strategy.core.dtypes import Dtype
from het_strategy.core.hf_fields import HFModelConfig, read_hf_config
from het_strategy.core.workload import WorkloadSpec, transformer_config, transformer_workload

__all__ = ["hf_workload"]


def hf_workload(config: str | Path | Mapping[str, Any] | HFModelConfig, seq_len: int,
                dtype: Dtype | str = Dtype.bf16) -> WorkloadSpec:
    """The planner's workload of a Hugging Face causal LM at ``seq_len`` tokens per sample (the sequence length
    trained, at most ``max_position_embeddings``); ``dtype``: the training dtype its activation figures are in."""
    model = config if isinstance(config, HFModelConfig) else read_hf_config(config)
    return transformer_workload(transformer_config(model.model_mapping(seq_len)), dtype=dtype)
