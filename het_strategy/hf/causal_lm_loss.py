"""A Hugging Face causal LM's own loss as the pipeline loss: ``CausalLMLoss``.

The model's ``loss_function`` for ``loss_type == "ForCausalLM"`` (transformers' ``ForCausalLMLoss``): the labels
padded by one ``-100`` and shifted left (token ``t`` predicts label ``t + 1``), cross-entropy over the vocabulary
ignoring ``-100``, the mean over the non-ignored tokens, in fp32 at least (transformers upcasts the logits).  The
one difference: float64 logits stay float64 (transformers' ``.float()`` would round them to fp32), so a float64
run can be compared with a single process to 1e-10.

Per micro-batch it is the mean over that micro-batch's counted tokens (a micro-batch without one gives 0, not
nan); the runtime's loss weights make the step the global-batch mean (``ds_runtime.engine``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from het_strategy.core.errors import field_error

__all__ = ["IGNORE_INDEX", "CausalLMLoss"]

IGNORE_INDEX = -100
"""The label of a token the loss skips (padding, a prompt): transformers' and torch's ``ignore_index``."""


class CausalLMLoss:
    """``loss(logits, labels)`` of a causal LM over one micro-batch (see the module docstring).

    Args:
        model: the ``PreTrainedModel``; its ``loss_type`` must be ``ForCausalLM`` and its config give
            ``vocab_size``.
    """

    shifts_labels = True
    """The labels are shifted by one (the tokens counted are ``labels[..., 1:]``)."""
    ignore_index = IGNORE_INDEX

    def __init__(self, model: Any) -> None:
        kind = getattr(model, "loss_type", None) or "ForCausalLM"
        if kind != "ForCausalLM":
            raise field_error(f"{type(model).__name__}.loss_type", kind, "be ForCausalLM (a causal LM's loss)")
        self.vocab_size = int(model.config.vocab_size)
        self.__name__ = "causal_lm_loss"

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1).to(wide.device)
        total = F.cross_entropy(wide.reshape(-1, self.vocab_size), shifted, ignore_index=IGNORE_INDEX,
                                reduction="sum")
        return total / (shifted != IGNORE_INDEX).sum().clamp(min=1)
