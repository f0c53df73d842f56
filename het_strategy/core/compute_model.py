"""How long a layer's kernels take on a GPU nobody profiled: a roofline over the layer's matmuls and memory passes.

The cost model uses it with ``settings.compute_model=roofline`` (``ComputeModel``); the default, ``flops``, prices
a layer by its FLOPs at the datasheet rate times the device's ``efficiency`` (why the roofline is not the default
yet: docs/how-it-works/cost-model.md).

A transformer layer (``LayerShape``) is priced kernel by kernel (``layer_seconds``) from the datasheet figures of
the catalog (``DeviceSpec``: the matmul rate of the dtype, the memory bandwidth and the number of compute units):
its matmuls (``gemm_s``: their FLOPs at the rate of the unit the runtime's dtype uses, ``device_roofline``, times
an efficiency for their shape), its memory-bound passes (``memory_s``, counted from the kernels Megatron-style
blocks run) and its attention as it runs (``AttentionKernel``).  Each kernel also pays a launch time.

What callers may rely on:

- Only the five constants of ``ComputeCalibration`` are fitted, once (``reference/compute_calibration.py``), on
  the public per-layer measurements the project holds, Sailor's and AMP's, and shipped in
  ``data/compute_calibration.json``; the shapes, pass counts and datasheet figures are not fitted.
- A layer's time per sample falls with the micro-batch (the kernels fill the device better): the planners'
  bounds take that into account.
- Tensor-parallel communication is not priced here: the cost model adds the Megatron all-reduces over the
  node's link (``network.Network.tp_allreduce_s``).
- A layer without a shape (a model profiled as an ``nn.Module``), or a device the roofline does not describe (a
  CPU, an emulated device, a throughput given in the cluster file: ``device_roofline`` is None) is priced by
  FLOPs at the device's sustained rate.  Pure Python: no torch.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from het_strategy.core.dtypes import Dtype, Float32MatmulPrecision

if TYPE_CHECKING:
    from het_strategy.core.device_spec import DeviceSpec

__all__ = ["ComputeModel", "AttentionKernel", "LayerShape", "Roofline", "ComputeCalibration",
           "CALIBRATION_FILE", "device_roofline", "gemm_s", "memory_s", "layer_seconds"]

CALIBRATION_FILE = Path(__file__).with_name("data") / "compute_calibration.json"
"""The shipped calibration (written by ``reference/compute_calibration.py``)."""
TILES = ((256, 128), (128, 128), (128, 64), (64, 64))
"""Output tiles of one thread block a matmul library chooses among (CUTLASS's and cuBLAS's common tiles)."""
LOGITS_BYTES = 4
"""The loss upcasts the logits to fp32 whatever the training dtype."""


class ComputeModel(StrEnum):
    """How the cost model prices a layer without a measured profile (``settings.compute_model``)."""

    flops = "flops"
    """The layer's FLOPs at the device's datasheet rate times its ``efficiency`` (backward = 2 x forward)."""
    roofline = "roofline"
    """This module's roofline, for a layer with a shape on a catalog GPU (FLOPs over the rate elsewhere)."""


class AttentionKernel(StrEnum):
    """How a block's attention runs (a model YAML's ``attention``).

    ``fused`` keeps the ``s x s`` scores on chip, so attention is matmul work only (its backward recomputes the
    scores: 5 matmuls against the forward's 2); ``materialized`` (Megatron without flash attention, as Sailor's
    and AMP's profiles were measured) writes them and runs its softmax and dropout over them, fused into one
    kernel in 16-bit and as separate scale, mask, softmax and dropout kernels in fp32 (``_block_passes``).
    """

    fused = "fused"
    """torch's ``scaled_dot_product_attention`` (flash or memory-efficient): the scores never reach memory."""
    materialized = "materialized"
    """The scores and probabilities written to memory (Megatron without flash attention)."""


@dataclass(frozen=True)
class LayerShape:
    """What the roofline needs of a layer: its kind and the model's dimensions (per sample: ``seq_len`` tokens)."""

    kind: Literal["embedding", "block", "head"]
    hidden: int
    heads: int = 1
    ffn: int = 0
    """The MLP's width (an MoE block: its shared expert's, 0 without one; the routed experts are priced apart)."""
    vocab: int = 0
    attention: AttentionKernel = AttentionKernel.fused
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: ``heads``."""
    head_dim: int = 0
    """Width of one head; 0: ``hidden / heads``."""
    gated: bool = False
    """A gated MLP: gate and up projections (two ``ffn``-wide matmuls) and the activation times up."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim if self.head_dim else self.hidden

    @property
    def kv_width(self) -> int:
        return self.q_width // self.heads * self.kv_heads if self.kv_heads else self.q_width


@dataclass(frozen=True)
class Roofline:
    """One device's figures for one dtype."""

    matmul_flops: float
    """Peak FLOP/s of the matmul unit the dtype runs on."""
    tensor_cores: bool
    """Whether that unit is a tensor (matrix) core; False: fp32 on the vector units."""
    memory_bytes_per_s: float
    """Memory bandwidth, bytes/s."""
    compute_units: int
    """Streaming multiprocessors / compute units (one tile each per wave)."""


@dataclass(frozen=True)
class ComputeCalibration:
    """The fitted constants of the roofline (``data/compute_calibration.json``)."""

    tensor_efficiency: float
    """Peak fraction of a large matmul on tensor cores."""
    vector_efficiency: float
    """Peak fraction of a large fp32 matmul on the vector units."""
    memory_efficiency: float
    """Fraction of the memory bandwidth a memory-bound pass reaches."""
    small_dim: float
    """Reduction depth at which a matmul reaches half its efficiency."""
    launch_s: float
    """Fixed seconds per kernel."""

    @staticmethod
    @functools.lru_cache(maxsize=1)
    def shipped() -> "ComputeCalibration":
        """The calibration shipped with the package."""
        raw = json.loads(CALIBRATION_FILE.read_text())
        return ComputeCalibration(**{k: float(v) for k, v in raw["constants"].items()})

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def device_roofline(device: DeviceSpec, dtype: Dtype | str,
                    float32_matmul: Float32MatmulPrecision | str = Float32MatmulPrecision.highest) -> Roofline | None:
    """The roofline of ``device`` computing in ``dtype`` (an element dtype), or None where the device's own
    figures price it (no ``compute_units``: a CPU, an emulated device, a throughput from the cluster file).

    The matmul unit is the one the runtime uses: 16-bit matmuls run at the fp16/bf16 tensor-core rate; fp32
    matmuls run at the fp32 rate under torch's default ``torch.set_float32_matmul_precision("highest")``, and
    at the TF32 tensor-core rate where the user sets ``high`` or ``medium`` (``Float32MatmulPrecision``), as
    torch does on a device with TF32 units (``DeviceSpec.matmul_rate``, which the ``flops`` model reads too).
    """
    if device.compute_units is None:
        return None
    unit, tflops = device.matmul_rate(Dtype(dtype), float32_matmul)  # the one rule for every compute model
    return Roofline(tflops * 1e12, unit != Dtype.fp32, device.memory_bandwidth_gbs * 1e9, device.compute_units)


def gemm_s(m: float, n: float, k: float, batch: float, roof: Roofline, cal: ComputeCalibration) -> float:
    """Seconds of ``batch`` matmuls of ``(m x k) @ (k x n)`` with the fastest of ``TILES``.

    Each matmul is ``2·m·n·k`` FLOPs at the matmul rate times an efficiency, plus ``launch_s`` per kernel.  The
    efficiency is the calibrated peak fraction (``tensor_efficiency`` on tensor cores, ``vector_efficiency``
    for fp32 on CUDA cores) times three shape terms:

    1. *tile padding*: the output is computed in tiles, a partial tile costs a whole one;
    2. *wave quantisation*: the tiles run in waves of one tile per compute unit, a last partial wave costs a
       whole one (1 and 2 for each of ``TILES``, 256 x 128 down to 64 x 64, the best kept, as cuBLAS's
       heuristics pick a kernel per shape: ``_tile_fill``);
    3. *small-depth falloff* ``k / (k + small_dim)``: a short reduction cannot hide its loads.
    """
    if min(m, n, k, batch) <= 0:
        return 0.0
    shape = max(_tile_fill(m, n, batch, tile, roof.compute_units) for tile in TILES)
    depth = k / (k + cal.small_dim)
    peak = cal.tensor_efficiency if roof.tensor_cores else cal.vector_efficiency
    return 2.0 * m * n * k * batch / (roof.matmul_flops * peak * shape * depth) + cal.launch_s


def _tile_fill(m: float, n: float, batch: float, tile: tuple[int, int], units: int) -> float:
    """The fraction of the compute units' tile slots doing useful work: the tiles' padding times the occupancy
    of their waves."""
    tiles_m, tiles_n = math.ceil(m / tile[0]), math.ceil(n / tile[1])
    tiles = batch * tiles_m * tiles_n
    waves = math.ceil(tiles / units)
    return (tiles / (waves * units)) * (m * n) / (tiles_m * tile[0] * tiles_n * tile[1])


def memory_s(elements: float, element_bytes: float, kernels: int, roof: Roofline, cal: ComputeCalibration) -> float:
    """Seconds of ``kernels`` memory-bound kernels moving ``elements`` elements of ``element_bytes`` in all.

    Layer norms, activations, softmax, dropout, bias and residual adds and layout copies move their elements
    at the memory bandwidth times ``memory_efficiency`` (an element read and written counts 2), each kernel
    paying ``launch_s``.
    """
    return elements * element_bytes / (roof.memory_bytes_per_s * cal.memory_efficiency) + kernels * cal.launch_s


def layer_seconds(shape: LayerShape, seq_len: int, micro_batch: int, tp: int, element_bytes: int, roof: Roofline,
                  cal: ComputeCalibration) -> tuple[float, float]:
    """(forward, backward) seconds of one layer for one micro-batch on one rank of a ``tp``-way group (its
    share of the split matmuls and passes; the tensor-parallel all-reduces are not included)."""
    tokens = micro_batch * seq_len
    if shape.kind == "embedding":
        return _embedding(shape, tokens, tp, element_bytes, roof, cal)
    if shape.kind == "head":
        return _head(shape, tokens, tp, element_bytes, roof, cal)
    return _block(shape, seq_len, micro_batch, tp, element_bytes, roof, cal)


def _linear(m: float, n: float, k: float, roof: Roofline, cal: ComputeCalibration) -> tuple[float, float]:
    """A linear layer ``(m x k) -> (m x n)``: its forward matmul, and its backward's two (input and weight
    gradients: ``m x k x n`` and ``k x n x m``)."""
    return gemm_s(m, n, k, 1, roof, cal), gemm_s(m, k, n, 1, roof, cal) + gemm_s(k, n, m, 1, roof, cal)


def _block_passes(shape: LayerShape, tokens: float, heads: float, seq_len: int, micro_batch: int, tp: int,
                  element_bytes: int) -> tuple[float, float, int, int]:
    """Elements moved by a block's memory-bound kernels (forward, backward) and their kernel counts.

    Per token of width ``h`` (whole on every tp rank): two layer norms (read + write: 2 each; backward 3 each:
    input, gradient in, gradient out), two bias-dropout-residual adds (read two, write one, a 1-byte mask:
    3.25; backward 4.25): 10.5 forward, 14.5 backward.  The q/k/v and context layout copies: 4 ``h / tp``
    each way.  The MLP activation over ``ffn / tp``: 2 forward, 3 backward.  Materialized attention over the
    ``heads / tp x s x s`` scores: in 16-bit one fused scale-mask-softmax kernel (2; backward 3) and dropout
    (2.25 both ways); in fp32 separate scale, mask and softmax kernels (6; backward 7) and dropout.  With
    grouped-query attention the copies are of q's, k's, v's and the context's own widths; a gated MLP adds
    the product of the activation and the up projection (3 forward, 5 backward, one kernel each way).
    """
    h, f = shape.hidden, shape.ffn / tp
    copies = (2 * shape.q_width + 2 * shape.kv_width) / tp
    fwd = tokens * (10.5 * h + copies + 2 * f)
    bwd = tokens * (14.5 * h + copies + 3 * f)
    kernels_f, kernels_b = 9, 9
    if shape.gated:
        fwd, bwd = fwd + tokens * 3 * f, bwd + tokens * 5 * f
        kernels_f, kernels_b = kernels_f + 1, kernels_b + 1
    if shape.attention == AttentionKernel.materialized:
        scores = micro_batch * heads * seq_len * seq_len
        softmax_f, softmax_b, kernels = (2.0, 3.0, 1) if element_bytes < 4 else (6.0, 7.0, 3)
        fwd += scores * (softmax_f + 2.25)
        bwd += scores * (softmax_b + 2.25)
        kernels_f, kernels_b = kernels_f + kernels + 1, kernels_b + kernels + 1
    return fwd, bwd, kernels_f, kernels_b


def _block(shape: LayerShape, seq_len: int, micro_batch: int, tp: int, element_bytes: int, roof: Roofline,
           cal: ComputeCalibration) -> tuple[float, float]:
    h, tokens = shape.hidden, micro_batch * seq_len
    heads = shape.heads / tp
    head_dim = shape.head_dim or shape.hidden / shape.heads
    q, kv, ffn = shape.q_width, shape.kv_width, shape.ffn / tp
    matmuls = [((q + 2 * kv) / tp, h), (h, q / tp), (ffn, h), (h, ffn)]  # qkv, out, fc1 (gate), fc2 (down)
    if shape.gated:
        matmuls.append((ffn, h))  # the up projection
    fwd = bwd = 0.0
    for n, k in matmuls:
        f, b = _linear(tokens, n, k, roof, cal)
        fwd, bwd = fwd + f, bwd + b
    batch = micro_batch * heads
    scores = gemm_s(seq_len, seq_len, head_dim, batch, roof, cal)  # q @ k^T
    context = gemm_s(seq_len, head_dim, seq_len, batch, roof, cal)  # p @ v
    fwd += scores + context
    bwd += 2 * (scores + context) if shape.attention == AttentionKernel.materialized \
        else 2.5 * (scores + context)  # fused: the scores recomputed, then four gradient matmuls
    moved_f, moved_b, kernels_f, kernels_b = _block_passes(shape, tokens, heads, seq_len, micro_batch, tp,
                                                           element_bytes)
    return (fwd + memory_s(moved_f, element_bytes, kernels_f, roof, cal),
            bwd + memory_s(moved_b, element_bytes, kernels_b, roof, cal))


def _embedding(shape: LayerShape, tokens: float, tp: int, element_bytes: int, roof: Roofline,
               cal: ComputeCalibration) -> tuple[float, float]:
    """Token and position lookups, their sum and dropout (forward: 7.25 elements per token and width);
    backward: the dropout, the gradient scattered into the table (3) and the table's gradient zeroed."""
    h = shape.hidden
    fwd = memory_s(tokens * h * 7.25, element_bytes, 3, roof, cal)
    bwd = memory_s(tokens * h * 5.25 + shape.vocab * h / tp, element_bytes, 3, roof, cal)
    return fwd, bwd


def _head(shape: LayerShape, tokens: float, tp: int, element_bytes: int, roof: Roofline,
          cal: ComputeCalibration) -> tuple[float, float]:
    """The final layer norm, the vocabulary matmul (split over tp) and the cross-entropy over fp32 logits
    (forward: upcast, max, exp-sum and loss: 5 elements per logit; backward: softmax minus target, cast: 3)."""
    logits = tokens * shape.vocab / tp
    f, b = _linear(tokens, shape.vocab / tp, shape.hidden, roof, cal)
    norm_f = memory_s(tokens * shape.hidden * 2, element_bytes, 1, roof, cal)
    norm_b = memory_s(tokens * shape.hidden * 3, element_bytes, 1, roof, cal)
    return (f + norm_f + memory_s(logits * 5, LOGITS_BYTES, 3, roof, cal),
            b + norm_b + memory_s(logits * 3, LOGITS_BYTES, 2, roof, cal))
