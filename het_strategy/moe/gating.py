"""Top-k token routing with capacity, as GShard / Switch route and DeepSpeed's gates do.

For the ``T`` tokens of one rank (its own, in order):

1. ``logits = W_g x`` (no bias; with ``noisy_gate_policy="Jitter"`` in training
   x is first scaled by uniform noise in [1 - 1e-2, 1 + 1e-2]); ``gates =
   softmax(logits)`` in fp32.
2. Choices: the j-th choice of a token is the arg-max of its selection scores
   over the experts not yet chosen; the scores are the logits, plus Gumbel
   noise with ``noisy_gate_policy="RSample"`` in training.
3. Capacity (``drop_tokens=True``): each expert takes at most
   ``C = max(ceil(k x T / E x capacity_factor), min_capacity)`` of the rank's
   tokens (``eval_capacity_factor`` in eval).  A token's slot at an expert is
   its position in token order among the tokens that chose that expert, first
   choices before second choices (counted before any drop, as DeepSpeed's
   top-2 gate counts); a slot >= C drops that choice.  Without ``drop_tokens``
   nothing is dropped: the all-to-all sends exactly the routed tokens, so no
   capacity padding is needed.
4. Weights: top-1 uses the gate probability of the kept choice; top-k > 1
   renormalises the kept choices' probabilities to sum to one (a dropped
   choice weighs 0).
5. Auxiliary loss (GShard's load balancing): ``E x sum_e mean_t(gates[t, e]) x
   fraction of tokens whose first choice is e``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["Routing", "route_tokens", "expert_capacity", "jitter", "NOISY_GATE_POLICIES"]

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
_JITTER_EPS = 1e-2


@dataclass
class Routing:
    """Where one rank's tokens go."""

    expert: torch.Tensor
    """``[T, k]`` long: the expert of each token's j-th choice."""
    weight: torch.Tensor
    """``[T, k]``: its combine weight (0 where dropped); differentiable w.r.t. the gate."""
    kept: torch.Tensor
    """``[T, k]`` bool: the choice is dispatched."""
    position: torch.Tensor
    """``[T, k]`` long: the choice's slot at its expert (< capacity where kept)."""
    aux_loss: torch.Tensor
    """Scalar load-balancing loss."""
    counts: torch.Tensor
    """``[E]`` long: kept choices per expert on this rank."""


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float,
                    min_capacity: int) -> int:
    """Tokens of this rank one expert may take."""
    return max(int(math.ceil(top_k * num_tokens / num_experts * capacity_factor)), min_capacity)


def route_tokens(logits: torch.Tensor, top_k: int, capacity: int | None, noisy_rsample: bool = False) -> Routing:
    """Route ``[T, E]`` gate logits (see the module docstring; ``capacity=None``: no drops)."""
    num_tokens, num_experts = logits.shape
    wide = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least (float64 stays float64)
    gates = F.softmax(logits.to(wide), dim=1)
    scores = logits.detach().to(wide)
    if noisy_rsample:
        uniform = torch.rand_like(scores).clamp_(1e-10, 1 - 1e-10)
        scores = scores - torch.log(-torch.log(uniform))
    chosen = []
    for _ in range(top_k):
        idx = scores.argmax(dim=1)
        chosen.append(idx)
        scores = scores.scatter(1, idx[:, None], float("-inf"))
    expert = torch.stack(chosen, dim=1)  # [T, k]
    masks = [F.one_hot(idx, num_experts) for idx in chosen]  # [T, E] each, before drops
    kept_cols, positions = [], []
    offset = torch.zeros(num_experts, dtype=torch.long, device=logits.device)
    for mask in masks:
        slot = (torch.cumsum(mask, dim=0) - 1 + offset) * mask  # position among the expert's tokens
        offset = offset + mask.sum(dim=0)
        positions.append(slot.sum(dim=1))
        if capacity is None:
            kept_cols.append(torch.ones(num_tokens, dtype=torch.bool, device=logits.device))
        else:
            kept_cols.append((slot.sum(dim=1) < capacity))
    kept = torch.stack(kept_cols, dim=1)
    probs = gates.gather(1, expert) * kept
    if top_k > 1:
        probs = probs / probs.sum(dim=1, keepdim=True).clamp(min=torch.finfo(probs.dtype).eps)
    me = gates.mean(dim=0)
    ce = masks[0].to(gates.dtype).mean(dim=0)
    aux = (me * ce).sum() * num_experts
    counts = torch.bincount(expert[kept], minlength=num_experts)
    return Routing(expert=expert, weight=probs.to(logits.dtype), kept=kept, position=torch.stack(positions, dim=1),
                   aux_loss=aux.to(logits.dtype), counts=counts)


def jitter(x: torch.Tensor) -> torch.Tensor:
    """Multiplicative input noise of the ``Jitter`` policy."""
    noise = torch.empty_like(x).uniform_(1.0 - _JITTER_EPS, 1.0 + _JITTER_EPS)
    return x * noise
