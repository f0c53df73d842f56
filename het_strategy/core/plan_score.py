"""What the cost model says of one plan (``CostModel.score``): its step time, per-stage costs and memory.

``dp_step_times`` splits the predicted step of a pure data-parallel plan per
device into compute, idle (waiting for the slowest rank), gradient sync and
optimizer update, from the figures ``CostModel.score`` gives (a ``PlanScore``,
or the plan's ``predicted`` mapping); the parts of a device add up to the step.
``DeviceStepTimes`` holds one device's split; a run's measured split
(``callbacks/telemetry.py``) fills the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from het_strategy.core.memory import GiB

if TYPE_CHECKING:
    from het_strategy.core.plan import Plan

__all__ = ["StageCost", "PlanScore", "DeviceStepTimes", "dp_step_times"]


@dataclass(frozen=True)
class StageCost:
    """Per-micro-batch cost of one stage, and its memory per device."""

    compute_s: float
    """Forward + backward of one micro-batch, seconds (tensor-parallel comm included)."""
    send_s: float
    """Activation to the next stage + gradient back, seconds (0 for the last stage)."""
    memory_bytes: float
    """Peak memory per device of the stage."""


@dataclass
class PlanScore:
    """The cost model's figures for one plan."""

    step_time_s: float
    samples_per_s: float
    pipeline_times_s: list[float]
    sync_time_s: float
    update_time_s: float
    memory_bytes: dict[str, float]
    memory_capacity_bytes: dict[str, float]
    stage_costs: list[list[StageCost]] = field(default_factory=list)
    grad_dtype: str = "fp32"
    """Dtype the gradients were priced in."""
    network: str = ""
    """The link model that priced communication (one line)."""
    compute: str = ""
    """Which stages a measured profile priced and which the analytic model did (one line; "" without a
    profile)."""
    device_sync_s: dict[str, float] = field(default_factory=dict)
    """Per used device: its gradient sync after the slowest pipeline, seconds (``sync_time_s`` is the one of the
    device that sets the step); not in ``to_dict``: the plan JSON keeps the plan-level figures."""
    device_update_s: dict[str, float] = field(default_factory=dict)
    """Per used device: its optimizer update, seconds (as ``device_sync_s``)."""
    memory_parts: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per used device of an fsdp plan: its peak bytes by part (shard, gathered, activations, framework;
    ``core/fsdp_cost.py``); empty for other plans; not in ``to_dict``."""

    @property
    def fits(self) -> bool:
        return all(self.memory_bytes[d] <= self.memory_capacity_bytes[d] for d in self.memory_bytes)

    def worst_memory(self) -> tuple[str, float, float]:
        """(device, needed bytes, capacity bytes) of the device with the least headroom."""
        dev = max(self.memory_bytes, key=lambda d: self.memory_bytes[d] / self.memory_capacity_bytes[d])
        return dev, self.memory_bytes[dev], self.memory_capacity_bytes[dev]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "pipeline_times_s": self.pipeline_times_s,
            "sync_time_s": self.sync_time_s,
            "update_time_s": self.update_time_s,
            "memory_gb": {d: round(b / GiB, 3) for d, b in self.memory_bytes.items()},
            "memory_capacity_gb": {d: round(b / GiB, 3) for d, b in self.memory_capacity_bytes.items()},
            "fits": self.fits,
            "grad_dtype": str(self.grad_dtype),  # plain JSON (a Dtype is a StrEnum)
        }


@dataclass(frozen=True)
class DeviceStepTimes:
    """One device's training step split into its parts, seconds; ``idle_s`` is what the parts leave of the step."""

    device: str
    """The device's name (rank order is the cluster's)."""
    samples: float
    """Samples of each global batch it computes (0: idle in the plan)."""
    compute_s: float
    """Forward + backward of its samples."""
    sync_s: float
    """The gradient all-reduce itself (waiting for slower ranks is ``idle_s``)."""
    update_s: float
    """The optimizer update (measured: with the loop's own work after backward)."""
    step_s: float
    """The whole step, the same for every rank of a synchronous plan."""
    data_s: float = 0.0
    """Fetching the batch (measured only; the cost model does not price it)."""

    @property
    def idle_s(self) -> float:
        """The step less compute, sync, update and data: waiting for the slowest rank (never negative)."""
        return max(self.step_s - self.compute_s - self.sync_s - self.update_s - self.data_s, 0.0)


def dp_step_times(plan: "Plan", figures: "PlanScore | Mapping[str, Any]",
                  devices: Sequence[str] | None = None) -> list[DeviceStepTimes] | None:
    """Per device of a pure data-parallel ``plan`` (``devices``, default the plan's ``cluster_devices``), its
    predicted step split, from ``figures``: a ``PlanScore`` of the plan or the plan's ``predicted`` mapping.

    Compute is the device's pipeline time (one single-device stage); sync and update are the device's own where
    the score has them, else the plan-level ones (the device that sets the step).  None when ``plan`` is not
    pure data parallel or ``figures`` lack the step or pipeline times (a hand-made plan never scored).
    """
    fig = figures.to_dict() if isinstance(figures, PlanScore) else figures
    dev_sync = figures.device_sync_s if isinstance(figures, PlanScore) else {}
    dev_update = figures.device_update_s if isinstance(figures, PlanScore) else {}
    times, step = fig.get("pipeline_times_s"), fig.get("step_time_s")
    if not plan.is_pure_dp or step is None or not isinstance(times, Sequence) or len(times) != plan.num_pipelines:
        return None
    sync, update = float(fig.get("sync_time_s", 0.0)), float(fig.get("update_time_s", 0.0))
    by_device = {p.stages[0].devices[0]: (p.samples, float(t)) for p, t in zip(plan.pipelines, times)}
    names = list(devices if devices is not None else plan.cluster_devices or by_device)
    out = []
    for name in names:
        if name not in by_device:
            out.append(DeviceStepTimes(name, 0, 0.0, 0.0, 0.0, float(step)))
            continue
        samples, compute = by_device[name]
        out.append(DeviceStepTimes(name, samples, compute, float(dev_sync.get(name, sync)),
                                   float(dev_update.get(name, update)), float(step)))
    return out
