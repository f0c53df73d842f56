"""The main job's MoE model: ``CharGPT`` with a ``HeteroMoE`` feed-forward in every ``moe_every``-th block.

``MoECharGPT`` is the analytic ``TransformerConfig`` with ``num_experts > 0``:
block i is MoE when ``i % moe_every == moe_every - 1`` (the workload's rule);
its MLP is replaced by a router ``Linear(h, E, bias=False)`` and E experts
``Linear(h, f_e) -> GELU -> Linear(f_e, h)`` (``f_e = expert_ffn_hidden_size``),
so parameters match ``transformer_workload`` exactly.  The training loss adds
``aux_loss_coef`` x the layers' load-balancing losses.  Where each expert
lives is the strategy's business (``HeteroStrategy(moe_placement=...)``);
built before any process group, every rank first holds every expert.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from typing_extensions import override

from het_strategy.core.errors import field_error, require_number
from het_strategy.core.workload import TransformerConfig
from het_strategy.demo.char_gpt import CharGPT, _init_weights
from het_strategy.moe import HeteroMoE

__all__ = ["MoECharGPT", "build_char_model"]


class _MoEFeedForward(nn.Module):
    """A block's MLP slot holding a HeteroMoE layer; keeps the layer's last auxiliary loss."""

    def __init__(self, moe: HeteroMoE) -> None:
        super().__init__()
        self.moe = moe
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self.aux_loss, _ = self.moe(x)
        return out


class MoECharGPT(CharGPT):
    """A byte-level GPT whose every ``moe_every``-th block has a mixture-of-experts feed-forward."""

    def __init__(self, num_layers: int = 4, hidden_size: int = 64, num_heads: int = 4, seq_len: int = 64,
                 vocab_size: int = 256, lr: float = 3e-3, weight_decay: float = 0.0, dropout: float = 0.0,
                 num_experts: int = 12, top_k: int = 2, moe_every: int = 2, expert_ffn_hidden_size: int | None = None,
                 capacity_factor: float = 1.25, drop_tokens: bool = True, aux_loss_coef: float = 0.01) -> None:
        super().__init__(num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads, seq_len=seq_len,
                         vocab_size=vocab_size, lr=lr, weight_decay=weight_decay, dropout=dropout)
        TransformerConfig(name="moe_char_gpt", num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                          seq_len=seq_len, vocab_size=vocab_size, num_experts=num_experts, top_k=top_k,
                          moe_every=moe_every, expert_ffn_hidden_size=expert_ffn_hidden_size)
        if num_experts < 1:
            raise field_error("model.num_experts", num_experts, "be >= 1 for MoECharGPT (use CharGPT for a dense model)")
        require_number(aux_loss_coef, "moe.aux_loss_coef", allow_zero=True)
        width = expert_ffn_hidden_size or 4 * hidden_size

        def expert() -> nn.Module:
            module = nn.Sequential(nn.Linear(hidden_size, width), nn.GELU(), nn.Linear(width, hidden_size))
            module.apply(_init_weights)
            return module

        for i, block in enumerate(self.blocks):
            if i % moe_every == moe_every - 1:
                moe = HeteroMoE(hidden_size, expert, num_experts=num_experts, k=top_k,
                                capacity_factor=capacity_factor, eval_capacity_factor=capacity_factor,
                                min_capacity=0, drop_tokens=drop_tokens)
                _init_weights(moe.gate)
                block.mlp = _MoEFeedForward(moe)

    @override
    def workload_config(self) -> TransformerConfig:
        hp = self.hparams
        return TransformerConfig(name="char_gpt", num_layers=hp.num_layers, hidden_size=hp.hidden_size,
                                 num_heads=hp.num_heads, seq_len=hp.seq_len, vocab_size=hp.vocab_size,
                                 num_experts=hp.num_experts, top_k=hp.top_k, moe_every=hp.moe_every,
                                 expert_ffn_hidden_size=hp.expert_ffn_hidden_size)

    @override
    def pipeline_layers(self) -> list[nn.Module]:
        raise field_error("strategy", "hetero_deepspeed", "not be used with MoECharGPT in this version (HeteroMoE "
                          "runs under the hetero strategy, DDP)")

    def aux_loss(self) -> torch.Tensor:
        """The sum of the MoE layers' last load-balancing losses."""
        losses = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, _MoEFeedForward)]
        return torch.stack([loss for loss in losses if loss is not None]).sum()

    @override
    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = self.pipeline_loss(self(x), y)
        if self.training:
            loss = loss + self.hparams.aux_loss_coef * self.aux_loss()
        return loss


def build_char_model(cfg: TransformerConfig, moe: dict[str, Any] | None = None, **training: Any) -> CharGPT:
    """CharGPT for a dense config, MoECharGPT for one with experts (``moe``: capacity_factor, drop_tokens,
    aux_loss_coef)."""
    if not cfg.num_experts:
        return CharGPT.from_workload_config(cfg, **training)
    if cfg.ffn_hidden_size not in (None, 4 * cfg.hidden_size):
        raise field_error("model.ffn_hidden_size", cfg.ffn_hidden_size,
                          f"be 4 * hidden_size = {4 * cfg.hidden_size} for MoECharGPT", "or leave it out")
    return MoECharGPT(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                      seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, num_experts=cfg.num_experts, top_k=cfg.top_k,
                      moe_every=cfg.moe_every, expert_ffn_hidden_size=cfg.expert_ffn_hidden_size,
                      **(moe or {}), **training)
