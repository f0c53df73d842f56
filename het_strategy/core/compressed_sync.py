"""The price of a gradient sync whose inter-node hop is compressed (the hierarchical exchange).

``compression/hierarchical.py`` runs it: each node sums its gradients
uncompressed over its own link, the node leaders exchange the node sums
compressed (a ring of ``N`` leaders, the two-phase quantized exchange), and each
leader broadcasts the mean inside its node.  ``hierarchical_sync_s`` prices it,
term by term: the node's reduce and broadcast, the leaders' ring in wire bytes
and the codec's passes.

- ``INTER_NODE_TOKENS``: the methods a plan may run the inter-node hop in (the
  codecs of a fixed size per element); ``check_token`` refuses any other;
- ``wire_fraction``: the bytes on the wire per gradient byte;
- ``codec_bandwidth``: a device's codec throughput, its ``codec_gbs`` where the
  catalog or the cluster file gives one, else ``CODEC_FRACTION`` of its memory
  bandwidth;
- ``JOINT_CHOICES``: the methods the joint planner tries.

The wire bytes per gradient element and whether a codec encodes are its
``CodecSpec``'s (``core/codecs.py``), the same figures the comm hook sends, so
the price and the run count the same bytes.  The error a method adds is not
priced: the planner only offers methods within the adaptive controller's
quality budget (``JOINT_CHOICES``: no coarser than uniform 4-bit).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from het_strategy.core.codecs import CODECS, ELEMENTWISE_CODECS, Codec, Exchange, codec
from het_strategy.core.dtypes import DTYPE_BYTES

if TYPE_CHECKING:
    from het_strategy.core.device_spec import DeviceSpec

__all__ = ["INTER_NODE_TOKENS", "JOINT_CHOICES", "CODEC_FRACTION", "check_token", "wire_fraction",
           "codec_bandwidth", "hierarchical_sync_s"]

INTER_NODE_TOKENS: tuple[Codec, ...] = ELEMENTWISE_CODECS
"""Method tokens a plan may run the inter-node hop in: the codecs of a fixed size per element."""
JOINT_CHOICES: tuple[Codec, ...] = (Codec.NONE, Codec.Q8, Codec.Q4)
"""What the joint planner tries: none, and the quantizers within the default quality budget (uniform 4-bit)."""
CODEC_FRACTION = {"cpu": 1 / 60, "accelerator": 1 / 8}
"""Input bytes/s of quantize + dequantize, as a fraction of the device's memory bandwidth, for a device without
a ``codec_gbs`` (``benchmarks/gpu_calibration.py`` measures one on a GPU).  Measured for CPUs
(docs/how-it-works/cost-model.md; the catalog CPU keeps the fraction).  Assumed for accelerators: a memory-bound
kernel that reads the fp32 tensor and writes its codes in a few passes, 1/8 of the memory bandwidth."""


def check_token(token: Any, field: str) -> str:
    """``token`` if a plan may run the inter-node hop in it (``INTER_NODE_TOKENS``), else a ConfigError."""
    return codec(token, field, INTER_NODE_TOKENS).value


def wire_fraction(token: str, grad_dtype: str = "fp32") -> float:
    """Bytes on the wire per gradient byte in ``grad_dtype`` (``CodecSpec.bytes_per_element`` at the default
    bucket and scaling): 1 uncompressed, 1/2 for fp32 gradients in half precision, (b + 64/256) / 32 for
    fp32 gradients in b-bit maxmin quantization."""
    per_element = CODECS[codec(token, "compression", INTER_NODE_TOKENS)].bytes_per_element(grad_dtype)
    assert per_element is not None  # INTER_NODE_TOKENS are the elementwise codecs
    return per_element / DTYPE_BYTES[grad_dtype]


def codec_bandwidth(device: DeviceSpec) -> float:
    """Bytes/s of fp32 input ``device`` quantizes and dequantizes: its measured ``codec_gbs`` where given, else
    its memory bandwidth x ``CODEC_FRACTION`` (a device whose type starts with ``CPU`` takes the CPU's)."""
    if device.codec_gbs is not None:
        return device.codec_gbs * 1e9
    is_cpu = device.type.upper().startswith("CPU")
    return device.memory_bandwidth_gbs * 1e9 * CODEC_FRACTION["cpu" if is_cpu else "accelerator"]


def hierarchical_sync_s(num_bytes: Any, members: int, nodes: int, intra_bw: float, inter_ring_s: Any,
                        latency_s: float, codec_bw: float, token: str) -> Any:
    """Seconds of the hierarchical exchange of ``num_bytes`` (scalar or array) over ``members`` replicas on
    ``nodes`` nodes; ``inter_ring_s`` is the ring allreduce time of the wire bytes among the node leaders
    (priced by the caller's network model), ``intra_bw`` the slowest node's own link (bytes/s).

    For a ring of ``M = members`` replicas over ``N = nodes`` nodes (``L = ceil(M / N)`` per node) and
    ``B = num_bytes``, the sum of

    * **within the node**: the reduce to the leader ``(L-1)/L x B / bw_intra`` plus the broadcast
      ``(L-1)/L x B / bw_intra`` (and a latency for each);
    * **across nodes**: the ring allreduce of the *wire* bytes ``B x f`` among the ``N`` leaders over the
      route's inter-node links (``f``: ``wire_fraction``), ``inter_ring_s`` as given;
    * **codec**: quantizing and dequantizing the whole tensor twice (the exchange's two phases) at
      ``codec_bw``, the slowest device's ``codec_bandwidth``, for codecs that encode (not for a cast).
    """
    b = np.asarray(num_bytes, dtype=float)
    local = math.ceil(members / nodes)
    # the node's reduce to its leader and the leader's broadcast: (local - 1) / local of the bytes each
    intra = 0.0 if local <= 1 else 2 * (local - 1) / local * b / intra_bw + 2 * latency_s
    encodes = CODECS[codec(token, "compression", INTER_NODE_TOKENS)].exchange is not Exchange.ALLREDUCE
    coding = 2 * b / codec_bw if encodes else 0.0
    out = intra + np.asarray(inter_ring_s, dtype=float) + coding
    if isinstance(num_bytes, np.ndarray):
        return np.where(b > 0, out, 0.0)
    return float(out) if num_bytes > 0 else 0.0
