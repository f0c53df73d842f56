"""What the cost model says of one plan (``CostModel.score``): its step time, per-stage costs and memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from het_strategy.core.memory import GiB

__all__ = ["StageCost", "PlanScore"]


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
