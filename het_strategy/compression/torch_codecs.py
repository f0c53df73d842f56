"""The torch side of the codec registry: each codec's encoder and decoder, its bound, its wire bytes.

``core/codecs.py`` registers each codec once, with its pure facts
(``CodecSpec``: exchange, wire bytes, bound).  The torch side follows from
that registration: ``ENCODINGS`` holds one ``TorchCodec`` (encoder and
decoder) per ``Exchange``, reading the codec's own figures (wire dtype, bits)
from its spec, and ``TORCH_CODECS`` gives every token its exchange's.
``round_trip`` runs a flat gradient through a codec without communication,
``bound_ratio`` sets its error against the codec's stated ``Bound`` and
``wire_bytes`` gives a ``CodecSpec``'s bytes for one layer under a
``CompressionConfig``.

Invariants: importing this module fails unless ``ENCODINGS`` covers every
``Exchange``.  These encoders and decoders are the only place a codec's encoding
is written: the comm hook's collectives (``exchange.py``) carry and sum their
payloads, the adaptive controller measures their round trips.  PowerSGD's
exchange is torch's ``powerSGD_hook`` (warm-started factors, its own error
feedback); its encoder here is that hook's first step, which the controller
measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from het_strategy.compression.config import CompressionConfig, quantizer_for
from het_strategy.compression.quantize import Quantized, dequantize, error_bound, pack_codes, quantize, \
    unpack_codes, zero_padded
from het_strategy.core.codecs import CODECS, Bound, Codec, CodecSpec, Exchange, codec, low_rank, topk_count
from het_strategy.profiling.torch_device import TORCH_DTYPES

__all__ = ["TorchCodec", "ENCODINGS", "TORCH_CODECS", "round_trip", "bound_ratio", "wire_bytes"]

Encoder = Callable[[CodecSpec, torch.Tensor, Sequence[int], CompressionConfig, "torch.Generator | None"], Any]
Decoder = Callable[[CodecSpec, Any, CompressionConfig], torch.Tensor]


@dataclass(frozen=True)
class TorchCodec:
    """How one rank's flat fp32 gradient is encoded for the wire, and decoded back to flat fp32."""

    encode: Encoder
    """``(spec, flat, shape, config, generator) -> payload`` (the tensors that go on the wire)."""
    decode: Decoder
    """``(spec, payload, config) -> flat fp32``."""


def _cast(spec: CodecSpec, x: torch.Tensor, shape: Sequence[int], cfg: CompressionConfig,
          generator: torch.Generator | None) -> torch.Tensor:
    """``x`` in the codec's wire dtype, or as it is for a codec without one (``none``)."""
    return x.to(TORCH_DTYPES[spec.wire_dtype]) if spec.wire_dtype else x


def _to_fp32(spec: CodecSpec, payload: torch.Tensor, cfg: CompressionConfig) -> torch.Tensor:
    return payload.to(torch.float32)


def _quantize(spec: CodecSpec, x: torch.Tensor, shape: Sequence[int], cfg: CompressionConfig,
              generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(packed codes, per-bucket metadata, element count), the tensor padded with zeros to whole buckets."""
    q_spec = quantizer_for(spec.token, cfg)
    q = quantize(zero_padded(x, q_spec.bucket_size), q_spec, generator)
    return pack_codes(q.codes, q_spec.bits), q.meta, x.numel()


def _dequantize(spec: CodecSpec, payload: tuple[torch.Tensor, torch.Tensor, int],
                cfg: CompressionConfig) -> torch.Tensor:
    packed, meta, n = payload
    q_spec = quantizer_for(spec.token, cfg)
    return dequantize(Quantized(unpack_codes(packed, q_spec.bits), meta), q_spec)[:n]


def _topk(spec: CodecSpec, x: torch.Tensor, shape: Sequence[int], cfg: CompressionConfig,
          generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(values, int32 indices, element count) of the ``topk_count`` largest-magnitude entries of flat ``x``."""
    top = x.abs().topk(topk_count(x.numel(), cfg.topk_ratio), sorted=False).indices
    return x[top], top.to(torch.int32), x.numel()


def _scatter(spec: CodecSpec, payload: tuple[torch.Tensor, torch.Tensor, int],
             cfg: CompressionConfig) -> torch.Tensor:
    values, indices, n = payload
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    out[indices.long()] = values
    return out


def _factor(spec: CodecSpec, x: torch.Tensor, shape: Sequence[int], cfg: CompressionConfig,
            generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """PowerSGD's first step: ``P = orth(M Q0)`` from a random ``Q0``, then ``Q = M^T P`` (the whole matrix where
    factors would not be smaller, as torch's hook sends it)."""
    m = x.view(shape[0], -1)
    rank = low_rank(m.shape[0], m.shape[1], cfg.rank)
    if not rank:
        return x
    q0 = torch.randn(m.shape[1], rank, generator=generator).to(m.device)
    p = torch.linalg.qr(m @ q0).Q
    return p, m.T @ p


def _unfactor(spec: CodecSpec, payload: tuple[torch.Tensor, torch.Tensor] | torch.Tensor,
              cfg: CompressionConfig) -> torch.Tensor:
    if isinstance(payload, torch.Tensor):
        return payload
    p, q = payload
    return (p @ q.T).reshape(-1)


ENCODINGS: dict[Exchange, TorchCodec] = {
    Exchange.ALLREDUCE: TorchCodec(_cast, _to_fp32),
    Exchange.QUANTIZED: TorchCodec(_quantize, _dequantize),
    Exchange.ALLGATHER: TorchCodec(_topk, _scatter),
    Exchange.LOW_RANK: TorchCodec(_factor, _unfactor),
}
"""The encoder and decoder of each ``Exchange``'s payload; a codec's own figures (wire dtype, bits) come from
its ``CodecSpec``.  The payloads (the tensors that go on the wire):

- ``ALLREDUCE`` — one tensor the backend can sum: ``flat`` as it is (``none``;
  the hook passes it in the gradients' dtype) or cast to the wire dtype;
- ``QUANTIZED`` — ``(packed codes, per-bucket fp32 metadata, element count)``,
  padded with zeros to whole buckets;
- ``ALLGATHER`` — ``(fp32 values, int32 indices, element count)`` of the
  entries top-k keeps;
- ``LOW_RANK`` — PowerSGD's factors ``(P, Q)``, or the whole tensor where
  factors would not be smaller.
"""

if set(ENCODINGS) != set(Exchange):
    raise ImportError(f"compression/torch_codecs.py: ENCODINGS covers {sorted(ENCODINGS)}, core.codecs.Exchange "
                      f"{sorted(Exchange)}; a new exchange needs its encoder and decoder here")

TORCH_CODECS: dict[Codec, TorchCodec] = {token: ENCODINGS[spec.exchange] for token, spec in CODECS.items()}
"""Every codec's encoder and decoder, by token: its exchange's (one entry per ``core.codecs.CODECS`` entry)."""


def round_trip(token: str, x: torch.Tensor, shape: Sequence[int], cfg: CompressionConfig,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """What flat fp32 ``x`` (a layer of ``shape``) becomes through ``token``'s encoder and decoder, without
    communication (the adaptive controller measures each candidate's error so)."""
    spec = CODECS[codec(token, "token")]
    coder = TORCH_CODECS[spec.token]
    return coder.decode(spec, coder.encode(spec, x, shape, cfg, generator), cfg)


def bound_ratio(token: str, x: torch.Tensor, got: torch.Tensor, shape: Sequence[int],
                cfg: CompressionConfig) -> float:
    """The round trip ``x -> got``'s error over ``token``'s ``Bound``: the worst element's error over its bound
    (``inf`` where a zero bound is broken), or the error's norm over the bound's for ``PROJECTION``; at most 1
    when the bound holds."""
    spec = CODECS[codec(token, "token")]
    err = (got - x).abs()
    whole = spec.bound is Bound.PROJECTION and not low_rank(shape[0], x.numel() // shape[0], cfg.rank)
    if spec.bound is Bound.PROJECTION and not whole:
        return float(err.norm() / x.norm()) if float(x.norm()) > 0 else (0.0 if float(err.max()) == 0 else math.inf)
    if spec.bound is Bound.EXACT or whole:  # a matrix PowerSGD sends whole arrives exactly
        bound = torch.zeros_like(x)
    elif spec.bound is Bound.ROUNDING:
        info = torch.finfo(TORCH_DTYPES[spec.wire_dtype])
        bound = spec.unit_roundoff * x.abs() + info.tiny * info.eps / 2
    elif spec.bound is Bound.HALF_STEP:
        q_spec = quantizer_for(spec.token, cfg)
        bound = error_bound(zero_padded(x, q_spec.bucket_size), q_spec)[:x.numel()]
    else:  # DROPPED: an element above the k-th largest magnitude is sent exactly
        kth = x.abs().topk(topk_count(x.numel(), cfg.topk_ratio)).values[-1]
        bound = torch.where(x.abs() <= kth, x.abs(), torch.zeros_like(x))
    ratio = torch.where(bound > 0, err / bound.clamp_min(torch.finfo(torch.float32).tiny),
                        torch.where(err > 0, math.inf, 0.0))
    return float(ratio.max())


def wire_bytes(token: str, shape: Sequence[int], world: int, config: CompressionConfig,
               grad_dtype: str = "fp32") -> int:
    """Bytes one rank sends for one layer's gradient of ``shape`` in ``grad_dtype`` (``CodecSpec.wire_bytes``
    under ``config``'s bucket, scaling, rank and top-k ratio)."""
    return CODECS[codec(token, "token")].wire_bytes(shape, world, grad_dtype, config.codec_params)
