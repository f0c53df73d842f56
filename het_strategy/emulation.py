"""Emulated devices: one machine's processes standing in for unequal accelerators.

A cluster config may give a device an ``emulated_speed``.  The rank that plays
that device then takes, for every batch, the compute time the cost model gives
that device: ``samples x t1``, with ``t1`` the forward + backward seconds of one
sample at the device's declared sustained FLOP/s x efficiency x emulated speed
(``emulated_seconds_per_sample``).  The runtime measures the real forward, and
sleeps, before backward starts, for what is left of that time after the real
forward and the expected real backward (``backward_ratio`` x forward).  So all
of the step's gradient collectives start after the emulated compute, and the
collectives themselves stay real (gloo or NCCL).

The shipped local clusters declare a CPU slower than a real core of this
machine, so the emulated time, not contention between the processes, sets each
rank's pace.  Emulation is logged at setup and never on unless the cluster
config asks for it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from het_strategy.cluster import ClusterSpec
from het_strategy.cost_model import CostModel, TrainSettings
from het_strategy.errors import field_error
from het_strategy.workload import WorkloadSpec

__all__ = ["EmulatedCompute", "emulated_seconds_per_sample", "cluster_is_emulated", "emulation_summary"]


def cluster_is_emulated(cluster: ClusterSpec) -> bool:
    """Whether any device of the cluster is emulated (has an ``emulated_speed``)."""
    return any(d.emulated_speed is not None for d in cluster.devices)


def emulated_seconds_per_sample(cluster: ClusterSpec, device_name: str, workload: WorkloadSpec,
                                dtype: str = "fp32") -> float:
    """Forward + backward seconds of one sample on ``device_name`` as the cost model sees it."""
    cm = CostModel(cluster, workload, TrainSettings(global_batch_size=1, dtype=dtype, micro_batch_sizes=(1,)))
    return float(cm.replicated_compute_prefix(cluster.device(device_name), 1, 1)[-1])


def emulation_summary(cluster: ClusterSpec, workload: WorkloadSpec, dtype: str) -> str:
    """One line per device: its emulated speed and per-sample compute time."""
    lines = [f"EMULATED cluster `{cluster.name}` (compute padded to the emulated device; collectives are real):"]
    for d in cluster.devices:
        t = emulated_seconds_per_sample(cluster, d.name, workload, dtype)
        lines.append(f"  {d.name:<12} speed {d.emulated_speed or 1.0:<6g} {t * 1e3:9.2f} ms/sample")
    return "\n".join(lines)


@dataclass
class EmulatedCompute:
    """Pads one rank's forward + backward to ``samples x seconds_per_sample``.

    ``begin()`` at the start of a batch, ``pad_before_backward(samples)`` after
    its forward.  ``slowdown(step)`` (a factor >= 1, default 1) lets a schedule
    make the device slower for a while.
    """

    seconds_per_sample: float
    backward_ratio: float = 2.0
    padded_s: float = 0.0
    real_forward_s: float = 0.0
    steps: int = 0
    _t0: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds_per_sample, (int, float)) and self.seconds_per_sample > 0):
            raise field_error("emulation.seconds_per_sample", self.seconds_per_sample, "be > 0")
        if not (isinstance(self.backward_ratio, (int, float)) and self.backward_ratio >= 0):
            raise field_error("emulation.backward_ratio", self.backward_ratio, "be >= 0")

    def begin(self) -> None:
        self._t0 = time.perf_counter()

    def target_s(self, samples: int, slowdown: float = 1.0) -> float:
        """Emulated forward + backward seconds of ``samples`` samples."""
        return samples * self.seconds_per_sample * slowdown

    def pad_before_backward(self, samples: int, slowdown: float = 1.0) -> float:
        """Sleep for the emulated time the real forward (and expected backward) did not take; returns it."""
        forward = time.perf_counter() - self._t0
        pad = self.target_s(samples, slowdown) - forward * (1.0 + self.backward_ratio)
        self.real_forward_s += forward
        self.steps += 1
        if pad > 0:
            time.sleep(pad)
            self.padded_s += pad
            return pad
        return 0.0
