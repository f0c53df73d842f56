"""What the user asks of gradient compression: one validated dataclass.

``CompressionConfig`` is what ``HeteroStrategy(compression=...)``, the Hydra
group ``compression=<name>`` and ``CompressionState`` take.  Per-layer choices
are *method tokens*: ``none``, ``fp16``, ``bf16``, ``q2`` ... ``q8`` (quantized to
that many bits with the config's scaling, bucket and rounding), ``powersgd``
(rank ``rank``) and ``topk`` (``topk_ratio`` of the entries).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from het_strategy.compression.quantize import SCALINGS, QuantizerSpec
from het_strategy.core.errors import check_keys, field_error, require_int

__all__ = ["CompressionConfig", "METHODS", "compression_config", "method_token_valid", "quantizer_for"]

METHODS = ("adaptive", "none", "fp16", "bf16", "quantize", "powersgd", "topk")
SCOPES = ("all", "inter_node")
_TOKEN = re.compile(r"^(none|fp16|bf16|powersgd|topk|q([0-9]+))$")


@dataclass(frozen=True)
class CompressionConfig:
    """Gradient compression for a DDP model: one method everywhere, or chosen per layer."""

    method: str = "adaptive"
    """adaptive (per layer, from measured bandwidth and gradients) | none | fp16 | bf16 | quantize | powersgd | topk."""
    bits: int = 4
    """Bits per element for ``quantize``; for ``adaptive``, the uniform default whose error is the budget."""
    scaling: str = "maxmin"
    """Quantization scale per bucket: maxmin (min and step) | maxnorm (symmetric, one scale)."""
    bucket_size: int = 256
    """Elements per quantization bucket (a multiple of 8)."""
    stochastic_rounding: bool = False
    """Round quantized values stochastically (unbiased) instead of to the nearest level."""
    error_feedback: bool = True
    """Carry each layer's compression error into its next gradient (quantize, topk, powersgd)."""
    rank: int = 4
    """PowerSGD's matrix approximation rank."""
    topk_ratio: float = 0.01
    """Fraction of each layer's entries that top-k sends."""
    min_numel: int = 1024
    """Tensors with fewer elements, and every 1-D tensor (biases, norms), stay uncompressed."""
    warmup_steps: int = 10
    """Optimizer steps of plain allreduce before any compression (training is most sensitive early)."""
    resolve_every: int = 50
    """adaptive: steps between re-solving the per-layer choice (doubles, up to 8x, while the choice holds)."""
    error_budget: float = 1.0
    """adaptive: allowed total compression error, as a multiple of uniform ``q{bits}``'s error on the same gradients."""
    candidates: tuple[str, ...] = ("none", "q8", "q4", "q3")
    """adaptive: the method tokens each layer may get (q2 is allowed; measured here it doubled the GPT's loss gap)."""
    min_saving: float = 0.2
    """adaptive: compress only if the predicted exchange time falls by at least this fraction (the model leaves out
    what an uncompressed allreduce gains by overlapping backward, and Python's per-call cost)."""
    link_mbit: float | None = None
    """adaptive: plan for a link of this many Mbit/s instead of timing allreduces (None: measure at each solve)."""
    verbose: bool = True
    """Print the per-layer decisions (rank 0) whenever they change."""
    scope: str = "all"
    """all: every rank's exchange is compressed (flat); inter_node: reduce within each node uncompressed and
    compress only the exchange among nodes (``hierarchical.py``; the cluster's nodes, equal in size)."""

    def __post_init__(self) -> None:
        if isinstance(self.candidates, list):  # a list from YAML or code: keep the config hashable and comparable
            object.__setattr__(self, "candidates", tuple(self.candidates))
        if self.method not in METHODS:
            raise field_error("compression.method", self.method, f"be one of {', '.join(METHODS)}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise field_error("compression.bits", self.bits, "be an integer from 2 to 8",
                              "fewer bits cannot carry a sign and a zero; more than 8 do not pay over fp16")
        if self.scaling not in SCALINGS:
            raise field_error("compression.scaling", self.scaling, f"be one of {', '.join(SCALINGS)}")
        require_int(self.bucket_size, "compression.bucket_size", minimum=8)
        if self.bucket_size % 8:
            raise field_error("compression.bucket_size", self.bucket_size, "be a multiple of 8 (the packing unit)")
        for name in ("stochastic_rounding", "error_feedback", "verbose"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(f"compression.{name}", getattr(self, name), "be true or false")
        require_int(self.rank, "compression.rank", minimum=1)
        ratio = self.topk_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise field_error("compression.topk_ratio", ratio, "be a number in (0, 1)")
        require_int(self.min_numel, "compression.min_numel", minimum=1)
        require_int(self.warmup_steps, "compression.warmup_steps", minimum=0)
        require_int(self.resolve_every, "compression.resolve_every", minimum=1)
        budget = self.error_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) \
                or budget <= 0:
            raise field_error("compression.error_budget", budget, "be a number > 0",
                              "1.0 allows the error of uniform quantization at `bits`")
        saving = self.min_saving
        if isinstance(saving, bool) or not isinstance(saving, (int, float)) or not 0 <= saving < 1:
            raise field_error("compression.min_saving", saving, "be a number in [0, 1)")
        if self.link_mbit is not None:
            link = self.link_mbit
            if isinstance(link, bool) or not isinstance(link, (int, float)) or not math.isfinite(link) or link <= 0:
                raise field_error("compression.link_mbit", link, "be a number > 0 (Mbit/s) or null to measure")
        if self.scope not in SCOPES:
            raise field_error("compression.scope", self.scope, f"be one of {', '.join(SCOPES)}")
        if not self.candidates:
            raise field_error("compression.candidates", list(self.candidates), "name at least one method token")
        for i, token in enumerate(self.candidates):
            if not method_token_valid(token):
                raise field_error(f"compression.candidates[{i}]", token,
                                  "be none, fp16, bf16, q2 ... q8, powersgd or topk")

    @property
    def uniform_token(self) -> str:
        """The method token of a non-adaptive config (what every eligible layer gets)."""
        return {"quantize": f"q{self.bits}"}.get(self.method, self.method)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["candidates"] = list(self.candidates)
        return out


def method_token_valid(token: Any) -> bool:
    """True for none, fp16, bf16, powersgd, topk and q2 ... q8."""
    if not isinstance(token, str):
        return False
    match = _TOKEN.match(token)
    return bool(match) and (match.group(2) is None or 2 <= int(match.group(2)) <= 8)


def quantizer_for(token: str, config: CompressionConfig) -> QuantizerSpec:
    """The quantizer a ``q<bits>`` token stands for under ``config``."""
    return QuantizerSpec(bits=int(token[1:]), scaling=config.scaling, bucket_size=config.bucket_size,
                         stochastic=config.stochastic_rounding)


def compression_config(source: Any) -> CompressionConfig | None:
    """A ``CompressionConfig`` from a config, a method name, or a mapping (Hydra group); None for None."""
    if source is None or isinstance(source, CompressionConfig):
        return source
    if isinstance(source, str):
        if source.startswith("q") and method_token_valid(source):
            return CompressionConfig(method="quantize", bits=int(source[1:]))
        return CompressionConfig(method=source)
    if isinstance(source, Mapping):
        raw = dict(source)
        raw.pop("_target_", None)
        raw.pop("description", None)
        check_keys(raw, {f.name for f in fields(CompressionConfig)}, "compression")
        if "candidates" in raw:
            candidates = raw["candidates"]
            if isinstance(candidates, str) or not hasattr(candidates, "__iter__"):
                raise field_error("compression.candidates", candidates, "be a list of method tokens")
            raw["candidates"] = tuple(candidates)
        return CompressionConfig(**raw)
    raise field_error("compression", type(source).__name__,
                      "be a method name, a mapping of CompressionConfig fields, a CompressionConfig, "
                      "or a DDP comm hook callable")

