"""The main job's model: a small character-level GPT as a LightningModule.

``CharGPT`` is a decoder-only transformer over the 256 byte values, built to
be *exactly* the analytic ``TransformerConfig`` the planner reasons about:
``transformer_workload(model.workload_config())`` lists an ``embedding``
layer, one layer per block and a ``head`` layer, and their parameter counts
add up to the module's.  That is what lets a Plan made by ``het-plan`` for
this model be applied to it without a profiling pass, and lets
``profile_module`` find the same layers (the blocks live in the
``nn.ModuleList`` named ``blocks``).

Its shape, in the workload's terms, is in ``CharGPT``'s docstring.

The blocks and the head carry a ``tensor_parallel_plan()`` (Megatron's
column/row split, the head's logits gathered), so a ``hetero_deepspeed`` plan
may run them on tensor-parallel stages; the embedding runs whole on each rank.

Weights are drawn from N(0, 0.02) (biases zero, LayerNorms at identity), so
``torch.manual_seed`` fixes the initial model on every rank.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from het_strategy.core.errors import field_error, require_number
from het_strategy.demo.stdlib_text import BYTE_VOCAB_SIZE
from het_strategy.core.workload import TransformerConfig
from het_strategy.tensor_parallel.tp_plan import Colwise, Rowwise, TensorParallelPlan

__all__ = ["CharGPT", "WORKLOAD_NAME"]

WORKLOAD_NAME = "char_gpt"
"""Name of the ``TransformerConfig`` a CharGPT reports (part of a Plan's model fingerprint)."""

_INIT_STD = 0.02
"""Standard deviation of the Linear and Embedding weights at initialisation (GPT-2's)."""


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused qkv projection, one output projection."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)  # this rank's heads under tensor parallelism: width h / tp each
        width = q.shape[-1]
        # (B, T, w) -> (B, heads, T, w / heads)
        q, k, v = (t.view(batch, seq, self.num_heads, width // self.num_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))


class _Block(nn.Module):
    """One pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(hidden_size)
        self.attn = _CausalSelfAttention(hidden_size, num_heads, dropout)
        self.ln_mlp = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(),
                                 nn.Linear(4 * hidden_size, hidden_size))
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_dropout(self.attn(self.ln_attn(x)))
        return x + self.resid_dropout(self.mlp(self.ln_mlp(x)))

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """Megatron's split: q/k/v and the first MLP linear by output columns, the attention's output projection
        and the second MLP linear by input rows; each rank runs ``num_heads / tp`` heads."""
        return TensorParallelPlan(linears={"attn.qkv": Colwise(fused=3), "attn.out": Rowwise(),
                                           "mlp.0": Colwise(), "mlp.2": Rowwise()},
                                  divide=("attn.num_heads",))


class _Embedding(nn.Module):
    """Pipeline layer 0 (the workload's ``embedding``): token + position embeddings of CharGPT's own modules."""

    def __init__(self, tok_emb: nn.Embedding, pos_emb: nn.Embedding, dropout: nn.Dropout, seq_len: int) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.dropout, self.seq_len = tok_emb, pos_emb, dropout, seq_len

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > self.seq_len:
            raise field_error("input.seq_len", x.shape[1], f"be <= model.seq_len ({self.seq_len})")
        return self.dropout(self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device)))


class _Head(nn.Module):
    """The last pipeline layer (the workload's ``head``): final LayerNorm and LM head."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        """The LM head split by vocabulary columns, its logits gathered whole on every rank."""
        return TensorParallelPlan(linears={"lm_head": Colwise(gather_output=True)})


class CharGPT(pl.LightningModule):
    """A byte-level GPT whose parameters match ``transformer_workload(self.workload_config())`` exactly.

    ``forward(x)`` maps ``(batch, T)`` byte ids (``T <= seq_len``) to
    ``(batch, T, vocab_size)`` logits; the training and validation steps take
    ``(x, y)`` batches as ``het_strategy.demo.stdlib_text.CharDataset`` yields and
    minimise next-byte cross-entropy with AdamW.

    Shape, in the workload's terms (h = hidden_size, s = seq_len, v = vocab_size):

    * embedding: token ``Embedding(v, h)`` + learned position ``Embedding(s, h)``;
    * each block (pre-norm): LayerNorm, causal self-attention (one ``Linear(h, 3h)``
      for q, k, v and a ``Linear(h, h)`` out projection, both with bias,
      ``scaled_dot_product_attention(is_causal=True)``), LayerNorm, MLP
      ``Linear(h, 4h)`` -> GELU -> ``Linear(4h, h)``; residual connections;
    * head: final LayerNorm and an untied ``Linear(h, v, bias=False)``.
    """

    def __init__(self, num_layers: int = 4, hidden_size: int = 128, num_heads: int = 4, seq_len: int = 128,
                 vocab_size: int = BYTE_VOCAB_SIZE, lr: float = 3e-3, weight_decay: float = 0.0,
                 dropout: float = 0.0) -> None:
        super().__init__()
        # TransformerConfig validates the shape (positive ints, heads dividing the width).
        TransformerConfig(name=WORKLOAD_NAME, num_layers=num_layers, hidden_size=hidden_size, num_heads=num_heads,
                          seq_len=seq_len, vocab_size=vocab_size)
        require_number(lr, "model.lr")
        require_number(weight_decay, "model.weight_decay", allow_zero=True)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise field_error("model.dropout", dropout, "be a number in [0, 1)")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, hidden_size)
        self.pos_emb = nn.Embedding(seq_len, hidden_size)
        self.emb_dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(_Block(hidden_size, num_heads, dropout) for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.apply(_init_weights)

    def workload_config(self) -> TransformerConfig:
        """The analytic config this model is an instance of (name ``char_gpt``), for planning."""
        hp = self.hparams
        return TransformerConfig(name=WORKLOAD_NAME, num_layers=hp.num_layers, hidden_size=hp.hidden_size,
                                 num_heads=hp.num_heads, seq_len=hp.seq_len, vocab_size=hp.vocab_size)

    @classmethod
    def from_workload_config(cls, cfg: TransformerConfig, **training: Any) -> "CharGPT":
        """A CharGPT of ``cfg``'s shape; ``training`` passes ``lr``, ``weight_decay``, ``dropout``.

        Only dense configs with the 4h MLP can be built: an MoE or other-width
        config would describe a model this class does not implement.
        """
        if cfg.num_experts:
            raise field_error("model.num_experts", cfg.num_experts, "be 0 for CharGPT (a dense model)")
        if cfg.ffn_hidden_size not in (None, 4 * cfg.hidden_size):
            raise field_error("model.ffn_hidden_size", cfg.ffn_hidden_size,
                              f"be 4 * hidden_size = {4 * cfg.hidden_size} for CharGPT", "or leave it out")
        return cls(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
                   seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, **training)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        if seq > self.hparams.seq_len:
            raise field_error("input.seq_len", seq, f"be <= model.seq_len ({self.hparams.seq_len})")
        positions = torch.arange(seq, device=x.device)
        h = self.emb_dropout(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.ln_f(h))

    def pipeline_layers(self) -> list[nn.Module]:
        """The model as the workload's layers, in order: ``[embedding, block0, ..., head]`` (``num_layers + 2``).

        The same parameters as ``forward`` (the layers wrap this module's own
        submodules), so a Plan's stage boundaries index this list and
        ``hetero_deepspeed`` can run it as a pipeline.
        """
        hp = self.hparams
        return [_Embedding(self.tok_emb, self.pos_emb, self.emb_dropout, hp.seq_len), *self.blocks,
                _Head(self.ln_f, self.lm_head)]

    @staticmethod
    def pipeline_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy of one micro-batch (the ``hetero_deepspeed`` contract), over the logits in
        fp32 at least: a bf16 or fp16 model's softmax would lose most of the loss's gradient to rounding (Megatron
        and the cost model's ``compute_model.LOGITS_BYTES`` do the same)."""
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return F.cross_entropy(wide.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    @override
    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # sync_dist: every rank logs the mean over ranks, so rank 0's progress bar shows the global loss.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay,
                                 betas=(0.9, 0.95))


def _init_weights(module: nn.Module) -> None:
    """N(0, 0.02) Linear/Embedding weights and zero biases; LayerNorms keep their identity init."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
