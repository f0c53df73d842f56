"""The fsdp planner: fully sharded data parallelism with shares by speed and shards by memory (``hetero_fsdp``).

Every device of the cluster is a rank holding a piece of every unit (``core/fsdp_cost.py``: the units, the
price, the memory and the rule of the fractions). ``plan_fsdp(cm)`` searches, for each count ``K`` of lockstep
micro-steps (every value where the largest share's micro-batch size changes, and 1 to 16):

1. **Micro-batches**: a rank with share ``n`` runs micro-batches of ``m(n, K)``, the smallest size of
   ``settings.micro_batch_sizes`` that cuts ``n`` into at most ``K`` micro-batches (the largest size when none
   does), so more micro-steps hold fewer activations: a share whose activations do not fit at once is cut into
   micro-batches. A size above the share runs the share as one micro-batch.
2. **Shares by speed**: the exact integer min-max (``allocation.allocate_min_max``, as the dp split) of each
   rank's compute over its micro-batches, ``cost_r(n) = (k - 1) c_r(m) + c_r(n - (k - 1) m)`` with
   ``m = m(n, K)``, ``k = ceil(n / m)`` and ``c_r`` the rank's forward + backward of the whole model (+ a filler
   sample in each of the ``K - k`` micro-steps left); every rank at least one sample (``settings.equal_shares``:
   the even split instead), each share capped so ``K`` micro-batches fit beside the gathered units and collective
   buffers (priced with the even layout's pieces, the least any layout pads to; if refused, with its own).
3. **Shards by memory**: ``f_r = free_r / sum free`` (``FsdpCost.fractions``), or ``1 / W`` (``even_shards=True``:
   even FSDP, the comparison); the layout is kept when every rank's largest phase (``FsdpCost.memory``) fits.
4. **Price** (``FsdpCost.price``): the fastest layout that fits is the plan.

When no ``K`` fits, the refusal of the layout with the fewest activations (every micro-batch one sample) is
raised: a ``ConfigError`` naming ``plan.shards.<device>``, the rank, its need by part and its memory. The shares
are optimal for the compute (exactly so under the FLOPs model, where every unit's slowest rank is the same);
the fractions follow the memory rule, not a search over fractions.
"""

from __future__ import annotations

import math
from typing import Sequence

from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.fsdp_cost import FILLER_SAMPLES, FsdpCost, even_fractions
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.planning.allocation import allocate_min_max
from het_strategy.planning.structure import StructureResult, device_dtypes

__all__ = ["plan_fsdp", "fsdp_layout_plan", "micro_batch_size", "SMALL_COUNTS"]

SMALL_COUNTS = 16
"""Micro-step counts 1 .. ``SMALL_COUNTS`` are all tried; beyond, only those where the largest share's
micro-batch size changes."""


def _counts(largest_share: int) -> list[int]:
    """The micro-step counts worth trying for shares up to ``largest_share``."""
    out = set(range(1, min(largest_share, SMALL_COUNTS) + 1))
    out |= {math.ceil(largest_share / m) for m in range(1, largest_share + 1)}
    return sorted(out)


def fsdp_layout_plan(cm: CostModel, devices: Sequence[str], shares: Sequence[int], micro_batches: Sequence[int],
                     fractions: Sequence[float]) -> Plan:
    """The ``Plan`` of one fsdp layout on the cost model's cluster (mode ``fsdp``, ZeRO 0, ``shards`` set)."""
    L = cm.workload.num_layers
    pipes = tuple(Pipeline((Stage((d,), (0, L)),), m, n) for d, n, m in zip(devices, shares, micro_batches))
    return Plan(cluster=cm.cluster.name, cluster_devices=tuple(d.name for d in cm.cluster.devices),
                model=cm.workload.fingerprint(), global_batch_size=cm.settings.global_batch_size, pipelines=pipes,
                zero_stage=0, dtype=cm.settings.dtype, device_dtypes=device_dtypes(cm), mode="fsdp",
                shards=dict(zip(devices, fractions)))


def micro_batch_size(samples: int, micro_steps: int, sizes: Sequence[int]) -> int:
    """The smallest of ``sizes`` cutting ``samples`` into at most ``micro_steps`` micro-batches (the largest of
    ``sizes`` when none does)."""
    return next((m for m in sorted(sizes) if math.ceil(samples / m) <= micro_steps), max(sizes))


def _shares(cm: CostModel, cost: FsdpCost, devices: list[str], K: int,
            largest: Sequence[int] | None = None) -> list[int] | None:
    B, W = cm.settings.global_batch_size, len(devices)
    sizes = cm.settings.micro_batch_sizes
    if cm.settings.equal_shares:
        return [B // W + (1 if r < B % W else 0) for r in range(W)]

    def rank_cost(device: str):
        def time_s(n: int) -> float:
            m = min(micro_batch_size(n, K, sizes), n)
            k = math.ceil(n / m)
            fillers = max(K - k, 0) * sum(cost.phase_compute_s(device, FILLER_SAMPLES))
            return (k - 1) * sum(cost.phase_compute_s(device, m)) + sum(cost.phase_compute_s(device, n - (k - 1) * m)) \
                + fillers
        return time_s

    def cap(device: str) -> int:
        """The most samples cut into at most ``K`` micro-batches whose size leaves the rank room for its gathered
        units and collective buffers (``largest``: a layout's largest pieces, default the even layout's; at least
        one)."""
        lo, hi = 1, B
        while lo < hi:
            mid = (lo + hi + 1) // 2
            m = min(micro_batch_size(mid, K, sizes), mid)
            if math.ceil(mid / m) <= K and cost.free_for_shards(device, m, largest, W) >= 0:
                lo = mid
            else:
                hi = mid - 1
        return lo

    by_key: dict[tuple, tuple] = {}  # devices of equal cost share one callable: the allocation groups them
    costs, caps = [], []
    for d in devices:
        key = cm.device_key(cm.cluster.device(d))
        if key not in by_key:
            by_key[key] = (rank_cost(d), cap(d))
        costs.append(by_key[key][0])
        caps.append(by_key[key][1])
    capped = allocate_min_max(costs, B, minimum=[1] * W, cap=caps)  # type: ignore[arg-type]
    # none within the caps: the split by speed alone, which the memory check then refuses by name
    return capped if capped is not None else allocate_min_max(costs, B, minimum=[1] * W)  # type: ignore[arg-type]


def plan_fsdp(cm: CostModel, even_shards: bool = False) -> StructureResult:
    """The fastest fsdp plan that fits (the steps in the module docstring); ``even_shards``: every rank ``1 / W``
    of every parameter (even FSDP). ConfigError when none fits (naming the rank, its need and its memory)."""
    devices = [d.name for d in cm.cluster.devices]
    B, W = cm.settings.global_batch_size, len(devices)
    if B < W:
        raise field_error("settings.global_batch_size", B, f"be >= the number of fsdp ranks ({W}): every rank "
                          "computes a share of every step", "to use fewer devices, leave them out of the cluster")
    cost = FsdpCost(cm)
    best: StructureResult | None = None
    refusal: ConfigError | None = None
    seen: set[tuple] = set()
    for K in _counts(B - W + 1):
        largest = None  # the caps' collective buffers: the even layout's pieces, then a refused layout's own
        for _ in range(2):
            shares = _shares(cm, cost, devices, K, largest)
            if shares is None:
                break
            mbs = [micro_batch_size(n, K, cm.settings.micro_batch_sizes) for n in shares]
            if (key := (tuple(shares), tuple(mbs))) in seen:
                break
            seen.add(key)
            run = [min(m, n) for m, n in zip(mbs, shares)]  # the largest micro-batch each rank runs
            fractions = None if even_shards else cost.fractions(devices, run, shares)  # a rank with none free: 0
            if fractions is None:
                fractions = even_fractions(devices)
            frac = [fractions[d] for d in devices]
            err = cost.memory_refusal(devices, run, frac, shares)
            if err is None:
                step = cost.price(devices, shares, run, frac).step_time_s
                if best is None or step < best.step_time_s:
                    best = StructureResult(fsdp_layout_plan(cm, devices, shares, mbs, frac), step)
                break
            refusal = err  # the latest: the fewest activations so far
            largest = cost.largest_pieces(frac)
    if best is None:
        if refusal is not None:
            raise refusal
        raise ConfigError("no fsdp plan: no split of the global batch over the ranks was found")
    return best
