"""The price of a gradient sync whose inter-node hop is compressed (the hierarchical exchange).

``compression/hierarchical.py`` runs it: each node sums its gradients
uncompressed over its own link, the node leaders exchange the node sums
compressed (a ring of ``N`` leaders, the two-phase quantized exchange), and each
leader broadcasts the mean inside its node.  Priced here, for a ring of ``M``
replicas over ``N`` nodes (``L = ceil(M / N)`` per node):

* **within the node**: the reduce to the leader ``(L-1)/L x B / bw_intra`` plus
  the broadcast ``(L-1)/L x B / bw_intra`` (and a latency for each);
* **across nodes**: the ring allreduce of the *wire* bytes ``B x f`` among the
  ``N`` leaders over the route's inter-node links (``f``: ``wire_fraction``);
* **codec**: quantizing and dequantizing the whole tensor twice (the exchange's
  two phases) at a fraction of the slowest device's memory bandwidth
  (``codec_bandwidth``).

The CPU fraction is measured on this machine: 4-bit quantize + dequantize of
16 MiB fp32 ran at 0.65 GB/s of input (8-bit: 0.97 GB/s) on one core of a
loaded 2-core machine, against the catalog CPU's 50 GB/s memory bandwidth:
1/60.  For accelerators it is an assumption, not a measurement (no GPU here):
a memory-bound kernel that reads the fp32 tensor and writes its codes in a few
passes, 1/8 of the memory bandwidth (40 GB/s on a T4).  The error a method adds
is not priced: the planner only offers methods within the adaptive
controller's quality budget (``JOINT_CHOICES``: no coarser than uniform 4-bit).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from het_strategy.core.errors import field_error

__all__ = ["INTER_NODE_TOKENS", "JOINT_CHOICES", "CODEC_FRACTION", "check_token", "wire_fraction",
           "codec_bandwidth", "hierarchical_sync_s"]

INTER_NODE_TOKENS = ("none", "fp16", "bf16", "q2", "q3", "q4", "q5", "q6", "q7", "q8")
"""Method tokens a plan may run the inter-node hop in."""
JOINT_CHOICES = ("none", "q8", "q4")
"""What the joint planner tries: none, and the quantizers within the default quality budget (uniform 4-bit)."""
CODEC_FRACTION = {"cpu": 1 / 60, "accelerator": 1 / 8}
"""Input bytes/s of quantize + dequantize, as a fraction of the device's memory bandwidth (module docstring):
measured for CPUs, assumed for accelerators."""
_BUCKET = 256  # elements per quantization bucket (CompressionConfig's default), each with two fp32 figures (maxmin)


def check_token(token: Any, field: str) -> str:
    if token not in INTER_NODE_TOKENS:
        raise field_error(field, token, f"be one of {', '.join(INTER_NODE_TOKENS)}")
    return token


def wire_fraction(token: str) -> float:
    """Bytes on the wire per fp32 gradient byte: 1 uncompressed, 1/2 in half precision, (b + 64/256) / 32 for
    b-bit maxmin quantization (two fp32 figures per bucket of 256)."""
    if token == "none":
        return 1.0
    if token in ("fp16", "bf16"):
        return 0.5
    match = re.fullmatch(r"q([2-8])", token)
    if match is None:
        raise field_error("compression", token, f"be one of {', '.join(INTER_NODE_TOKENS)}")
    return (int(match.group(1)) + 64 / _BUCKET) / 32


def codec_bandwidth(memory_bandwidth_gbs: float, is_cpu: bool) -> float:
    """Bytes/s of fp32 input one device quantizes and dequantizes (``CODEC_FRACTION``)."""
    return memory_bandwidth_gbs * 1e9 * CODEC_FRACTION["cpu" if is_cpu else "accelerator"]


def hierarchical_sync_s(num_bytes: Any, members: int, nodes: int, intra_bw: float, inter_ring_s: Any,
                        latency_s: float, codec_bw: float, token: str) -> Any:
    """Seconds of the hierarchical exchange of ``num_bytes`` (scalar or array) over ``members`` replicas on
    ``nodes`` nodes; ``inter_ring_s`` is the ring allreduce time of the wire bytes among the node leaders
    (priced by the caller's network model), ``intra_bw`` the slowest node's own link (bytes/s)."""
    b = np.asarray(num_bytes, dtype=float)
    local = math.ceil(members / nodes)
    # the node's reduce to its leader and the leader's broadcast: (local - 1) / local of the bytes each
    intra = 0.0 if local <= 1 else 2 * (local - 1) / local * b / intra_bw + 2 * latency_s
    codec = 0.0 if token in ("none", "fp16", "bf16") else 2 * b / codec_bw
    out = intra + np.asarray(inter_ring_s, dtype=float) + codec
    if isinstance(num_bytes, np.ndarray):
        return np.where(b > 0, out, 0.0)
    return float(out) if num_bytes > 0 else 0.0
