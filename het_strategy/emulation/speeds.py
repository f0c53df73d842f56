"""Emulated devices: one machine's processes standing in for unequal accelerators.

A cluster config may give a device an ``emulated_speed``.  The rank that plays
that device then takes, for every batch, the compute time the cost model gives
that device: ``samples x t1``, with ``t1`` the forward + backward seconds of one
sample at the device's declared sustained FLOP/s x efficiency x emulated speed
(``emulated_seconds_per_sample``).  The runtime sleeps for what of that time
the real forward and backward did not take: when the step's last gradient
bucket is ready (``emulation.padding``), or, where no comm hook can be wrapped,
before backward with the expected real backward (``backward_ratio`` x forward).
So the step's last gradient collective starts after the emulated compute, and
the collectives themselves stay real (gloo or NCCL).

The shipped local clusters declare a CPU slower than a real core of this
machine, so the emulated time, not contention between the processes, sets each
rank's pace.  Emulation is logged at setup and never on unless the cluster
config asks for it.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import dataclass, field

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import field_error
from het_strategy.core.workload import WorkloadSpec

__all__ = ["EmulatedCompute", "emulated_seconds_per_sample", "emulated_expert_seconds_per_token", "emulated_factor", "cluster_is_emulated",
           "emulation_summary"]


def cluster_is_emulated(cluster: ClusterSpec) -> bool:
    """Whether any device of the cluster is emulated (has an ``emulated_speed``)."""
    return any(d.emulated_speed is not None for d in cluster.devices)


def emulated_seconds_per_sample(cluster: ClusterSpec, device_name: str, workload: WorkloadSpec,
                                dtype: str = "fp32", experts: bool = True) -> float:
    """Forward + backward seconds of one sample on ``device_name`` as the cost model sees it.

    ``experts=False``: the dense part only (an MoE layer pads its experts itself,
    ``moe/padding.py``, at ``emulated_expert_seconds_per_token``).
    """
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=1, dtype=dtype, micro_batch_sizes=(1,)))
    device = cluster.device(device_name)
    if not experts:
        return cm.stage_compute_s(device, 1, 1, 0, workload.num_layers)
    return float(cm.replicated_compute_prefix(device, 1, 1)[-1])


def emulated_expert_seconds_per_token(cluster: ClusterSpec, device_name: str, workload: WorkloadSpec,
                                      dtype: str = "fp32") -> list[float]:
    """Forward seconds one expert spends on one routed token on ``device_name``, per MoE layer (in layer order).

    Backward is counted as twice the forward, as for the dense part.
    """
    rate = cluster.device(device_name).flops_per_second(dtype)
    return [layer.moe.flops_per_token_per_expert / rate for layer in workload.layers if layer.moe is not None]


def emulated_factor(cluster: ClusterSpec, device_name: str, step: int) -> float:
    """The compute-time multiplier of ``device_name`` at optimizer ``step``: scheduled slowdowns x noise.

    The noise is a uniform factor in ``[1 - n, 1 + n]`` drawn from a seed of
    (device, step), so a run and its resumed copy see the same values.
    """
    factor = cluster.slowdown_factor(device_name, step)
    if cluster.emulation_noise:
        rng = random.Random(zlib.crc32(f"{device_name}:{step}".encode()))
        factor *= 1.0 + cluster.emulation_noise * (2.0 * rng.random() - 1.0)
    return factor


def emulation_summary(cluster: ClusterSpec, workload: WorkloadSpec, dtype: str, experts_inside: bool = False) -> str:
    """One line per device: its emulated speed and per-sample compute time.

    ``experts_inside``: MoE layers pad their experts themselves; the line then
    gives the dense part per sample and the expert time per 1000 routed tokens.
    """
    lines = [f"EMULATED cluster `{cluster.name}` (compute padded to the emulated device; collectives are real):"]
    for d in cluster.devices:
        t = emulated_seconds_per_sample(cluster, d.name, workload, dtype, experts=not experts_inside)
        line = f"  {d.name:<12} speed {d.emulated_speed or 1.0:<6g} {t * 1e3:9.2f} ms/sample"
        per_token = emulated_expert_seconds_per_token(cluster, d.name, workload, dtype) if experts_inside else []
        if per_token:
            line += (" (dense part) + experts " + ", ".join(f"{3e3 * x * 1e3:.1f}" for x in per_token)
                     + " ms per 1000 routed tokens (fwd + bwd, per MoE layer, padded inside the layer)")
        lines.append(line)
    for sd in cluster.slowdowns:
        until = f"until step {sd.end_step}" if sd.end_step is not None else "to the end"
        lines.append(f"  scheduled: {sd.device} {sd.factor:g}x slower from step {sd.start_step} {until}")
    if cluster.emulation_noise:
        lines.append(f"  noise: each step's compute x uniform [{1 - cluster.emulation_noise:g}, "
                     f"{1 + cluster.emulation_noise:g}]")
    return "\n".join(lines)


@dataclass
class EmulatedCompute:
    """Pads one rank's compute of a batch to ``samples x seconds_per_sample x factor``.

    ``begin()`` at the start of a batch; ``pad(samples, factor, computed_s)``
    sleeps for whatever of the emulated time the batch so far (``computed_s``)
    did not take, and returns it.  The ``hetero`` strategy calls
    it when the last gradient bucket is ready — the real forward and backward
    are over, so the emulated compute ends exactly on time, before the last
    gradient collective starts.  Without that hook (plain DDP) the caller pads
    before backward with an estimate of the backward still to come
    (``estimate_with_backward``).
    """

    seconds_per_sample: float
    backward_ratio: float = 2.0
    """Expected real backward time / real forward time, for padding before backward."""
    _t0: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds_per_sample, (int, float)) and self.seconds_per_sample > 0):
            raise field_error("emulation.seconds_per_sample", self.seconds_per_sample, "be > 0")
        if not (isinstance(self.backward_ratio, (int, float)) and self.backward_ratio >= 0):
            raise field_error("emulation.backward_ratio", self.backward_ratio, "be >= 0")

    def begin(self) -> None:
        self._t0 = time.perf_counter()

    def elapsed_s(self) -> float:
        """Wall time since ``begin()``."""
        return time.perf_counter() - self._t0

    def estimate_with_backward(self, waited_s: float = 0.0) -> float:
        """Called before backward: the real forward so far plus the backward expected from it."""
        return max(self.elapsed_s() - waited_s, 0.0) * (1.0 + self.backward_ratio)

    def target_s(self, samples: int, factor: float = 1.0) -> float:
        """Emulated forward + backward seconds of ``samples`` samples."""
        return samples * self.seconds_per_sample * factor

    def pad(self, samples: int, factor: float, computed_s: float) -> float:
        """Sleep for the emulated time ``computed_s`` of real compute did not take; returns the sleep."""
        remaining = self.target_s(samples, factor) - computed_s
        if remaining > 0:
            time.sleep(remaining)
            return remaining
        return 0.0
