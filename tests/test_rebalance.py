"""Re-planning from measured speeds: the optimum of brute force, a whole valid Plan, idle ranks when capped."""

from __future__ import annotations

import itertools

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.planning.rebalance import rebalance
from het_strategy.planning.strategy_plans import data_parallel_plan, estimate_workload, shares_in_rank_order

CLUSTER = load_cluster("local_cpu4_mixed")


def _plan(global_batch: int):  # type: ignore[no-untyped-def]
    return data_parallel_plan(CLUSTER, estimate_workload("m", 10_000, 1, "fp32"), global_batch, "fp32")


def _brute_force(times: list[float], total: int, minimum: int = 0) -> float:
    best = float("inf")
    for split in itertools.product(range(minimum, total + 1), repeat=len(times)):
        if sum(split) == total:
            best = min(best, max(n * t for n, t in zip(split, times)))
    return best


@pytest.mark.parametrize("times, total", [([0.01, 0.01, 0.03, 0.01], 12), ([0.002, 0.005, 0.007, 0.011], 13),
                                          ([1.0, 1.0, 1.0, 1.0], 9)])
def test_rebalanced_shares_reach_the_brute_force_optimum(times: list[float], total: int) -> None:
    old = _plan(total)
    new = rebalance(old, CLUSTER, times)
    assert new is not None
    shares = shares_in_rank_order(new, CLUSTER)
    assert sum(shares) == total
    assert max(n * t for n, t in zip(shares, times)) == pytest.approx(_brute_force(times, total), rel=1e-9)
    # a whole plan for the same run: cluster, model, batch, dtype kept; re-priced from the measurements
    assert (new.cluster, new.cluster_devices, new.model, new.global_batch_size, new.dtype) == \
        (old.cluster, old.cluster_devices, old.model, old.global_batch_size, old.dtype)
    assert new.predicted["source"] == "measured"
    assert new.predicted["step_time_s"] >= max(n * t for n, t in zip(shares, times))
    assert type(new).from_dict(new.to_dict()).to_dict() == new.to_dict()  # JSON round trip (checkpoints)


def test_a_capped_rank_can_be_left_idle() -> None:
    new = rebalance(_plan(16), CLUSTER, [0.01, 0.01, 0.01, 0.5], cap=[None, None, None, 0])
    assert new is not None and shares_in_rank_order(new, CLUSTER)[3] == 0
    assert CLUSTER.devices[3].name not in new.used_devices


def test_bounds_that_cannot_hold_the_batch_give_none_and_bad_times_an_error() -> None:
    assert rebalance(_plan(8), CLUSTER, [0.01] * 4, cap=[1, 1, 1, 1]) is None
    with pytest.raises(ConfigError, match="seconds_per_sample"):
        rebalance(_plan(8), CLUSTER, [0.01, 0.0, 0.01, 0.01])
    with pytest.raises(ConfigError, match="seconds_per_sample"):
        rebalance(_plan(8), CLUSTER, [0.01] * 3)


def test_with_shares_builds_the_plan_of_given_shares_and_refuses_wrong_ones() -> None:
    from het_strategy.planning.rebalance import with_shares

    new = with_shares(_plan(16), CLUSTER, [7, 5, 4, 0])
    assert shares_in_rank_order(new, CLUSTER) == [7, 5, 4, 0] and new.predicted == {}
    with pytest.raises(ConfigError, match="shares"):
        with_shares(_plan(16), CLUSTER, [7, 5, 4, 1])
