"""What a plan costs in money: the list prices of the devices it uses, per hour and per iteration.

A plan rents only the devices it uses (an idle device of the cluster is not
paid for), so

* ``dollars_per_hour`` = the sum of ``price_per_hour`` over the plan's used devices;
* ``dollars_per_iteration`` = ``dollars_per_hour * step_time_s / 3600``.

Prices come from the catalog (approximate 2024 on-demand list prices per
device-hour) or a cluster file's per-device ``price_per_hour:``.  A custom
device with no price makes the figures unknown (None), never a guess.
Pure Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from het_strategy.core.errors import field_error

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan import Plan

__all__ = ["SECONDS_PER_HOUR", "PlanPrice", "devices_price_per_hour", "unpriced_devices", "require_prices",
           "plan_price"]

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class PlanPrice:
    """The money figures of one plan (None: some used device has no price)."""

    dollars_per_hour: float | None
    """USD per hour for the plan's used devices."""
    dollars_per_iteration: float | None
    """USD per optimizer step: ``dollars_per_hour * step_time_s / 3600``."""
    num_used: int
    """Devices the plan uses (and so rents)."""
    unpriced_types: tuple[str, ...] = ()
    """Device types among the used ones without a price (why the figures are None)."""

    def to_dict(self) -> dict[str, float]:
        """The figures for ``plan.predicted`` (nothing when unknown)."""
        if self.dollars_per_hour is None or self.dollars_per_iteration is None:
            return {}
        return {"dollars_per_hour": self.dollars_per_hour, "dollars_per_iteration": self.dollars_per_iteration}


def unpriced_devices(cluster: "ClusterSpec", names: Iterable[str]) -> list[str]:
    """The devices among ``names`` without a ``price_per_hour``."""
    return [n for n in names if cluster.device(n).price_per_hour is None]


def devices_price_per_hour(cluster: "ClusterSpec", names: Iterable[str]) -> float | None:
    """USD per hour of renting the devices ``names`` (None when one of them has no price)."""
    total = 0.0
    for n in names:
        price = cluster.device(n).price_per_hour
        if price is None:
            return None
        total += price
    return total


def require_prices(cluster: "ClusterSpec", why: str) -> None:
    """ConfigError naming the first device of ``cluster`` without a price (``why``: the setting that needs them)."""
    missing = unpriced_devices(cluster, (d.name for d in cluster.devices))
    if missing:
        dev = cluster.device(missing[0])
        raise field_error(f"device `{dev.name}`.price_per_hour", None, f"be given for {why}",
                          f"device type `{dev.type}` is not in the catalog, so it has no list price; add "
                          "`price_per_hour: <USD per device-hour>` to its entry in the cluster file")


def plan_price(plan: "Plan", cluster: "ClusterSpec", step_time_s: float | None = None) -> PlanPrice:
    """The money figures of ``plan`` on ``cluster`` (``step_time_s``: the plan's predicted one when None)."""
    used = plan.used_devices
    step: Any = plan.predicted.get("step_time_s") if step_time_s is None else step_time_s
    per_hour = devices_price_per_hour(cluster, used)
    if per_hour is None or not isinstance(step, (int, float)):
        unpriced = tuple(dict.fromkeys(cluster.device(n).type for n in unpriced_devices(cluster, used)))
        return PlanPrice(per_hour, None, len(used), unpriced)
    return PlanPrice(per_hour, per_hour * float(step) / SECONDS_PER_HOUR, len(used))
