"""HeteroBatchSampler: every sample once per epoch across ranks, shares honoured, live share changes, resume."""

from __future__ import annotations

import random

import pytest

from het_strategy.core.errors import ConfigError
from het_strategy.strategy.sampler import GlobalOrder, HeteroBatchSampler, split_by_shares


def _samplers(n: int, batch: int, shares: list[int], *, shuffle: bool = True, drop_last: bool = False,
              epoch: int = 0) -> list[HeteroBatchSampler]:
    out = []
    for r in range(len(shares)):
        order = GlobalOrder(n, shuffle=shuffle, seed=7)
        order.set_epoch(epoch)
        out.append(HeteroBatchSampler(order, batch, shares, r, drop_last=drop_last))
    return out


def _epoch(samplers: list[HeteroBatchSampler]) -> list[list[list[int]]]:
    """Per step, per rank, the counted (non-filler) indices."""
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1, "every rank must run the same number of steps"
    steps = []
    for step in range(len(per_rank[0])):
        row = []
        for r, s in enumerate(samplers):
            local, _ = s.step_counts(step)
            batch = per_rank[r][step]
            assert len(batch) == max(local, 1)
            row.append(batch[:local])
        steps.append(row)
    return steps


def test_split_by_shares_is_exact_for_full_batches_and_proportional_otherwise() -> None:
    assert split_by_shares(16, [10, 4, 2]) == [10, 4, 2]
    assert split_by_shares(2, [10, 4, 2]) == [1, 1, 0]
    rng = random.Random(0)
    for _ in range(200):
        shares = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        if sum(shares) == 0:
            continue
        total = rng.randint(0, 3 * sum(shares))
        parts = split_by_shares(total, shares)
        assert sum(parts) == total
        # largest remainder: every part within 1 of its exact proportional value
        assert all(abs(p - total * s / sum(shares)) < 1 for p, s in zip(parts, shares))


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_sample_once_per_epoch_random_cases(drop_last: bool) -> None:
    rng = random.Random(1)
    for _ in range(60):
        world = rng.randint(1, 5)
        shares = [rng.randint(0, 6) for _ in range(world)]
        shares[rng.randrange(world)] += 1
        batch = sum(shares)
        n = rng.randint(1, 5 * batch)
        steps = _epoch(_samplers(n, batch, shares, drop_last=drop_last))
        used = sorted(i for step in steps for part in step for i in part)
        expected = (n // batch) * batch if drop_last else n
        assert len(used) == expected and len(set(used)) == expected
        for step in steps[: n // batch]:
            assert [len(p) for p in step] == shares


def test_epochs_reshuffle_identically_on_every_rank() -> None:
    e0 = _epoch(_samplers(40, 8, [5, 2, 1], epoch=0))
    e1 = _epoch(_samplers(40, 8, [5, 2, 1], epoch=1))
    assert e0 != e1
    assert e0 == _epoch(_samplers(40, 8, [5, 2, 1], epoch=0))


def test_set_shares_from_a_step_keeps_the_epoch_exact() -> None:
    samplers = _samplers(50, 10, [6, 3, 1])
    for s in samplers:
        s.set_shares([4, 4, 2], first_step=2)
    steps = _epoch(samplers)
    assert [len(p) for p in steps[1]] == [6, 3, 1]
    assert [len(p) for p in steps[2]] == [4, 4, 2]
    assert sorted(i for step in steps for part in step for i in part) == list(range(50))
    # the new shares carry into the next epoch
    for s in samplers:
        s.set_epoch(1)
    assert [len(p) for p in _epoch(samplers)[0]] == [4, 4, 2]


def test_set_shares_refuses_a_step_already_produced() -> None:
    (s,) = _samplers(30, 10, [10])
    it = iter(s)
    next(it), next(it)
    with pytest.raises(ConfigError, match="already produced"):
        s.set_shares([10], first_step=1)


def test_state_round_trip_resumes_at_the_next_step() -> None:
    a = _samplers(45, 10, [7, 3], epoch=2)
    full = [list(s) for s in a]
    b = _samplers(45, 10, [7, 3])
    for old, new in zip(a, b):
        new.load_state_dict(old.state_dict(next_step=3))
    assert [list(s) for s in b] == [batches[3:] for batches in full]
    assert [list(s) for s in b] == full  # the next epoch iterator starts at step 0 again


@pytest.mark.parametrize("shares, batch, field", [([3, 3], 7, "shares"), ([3, -1], 2, "shares"),
                                                  ([2.5, 2], 4, "shares")])
def test_bad_shares_name_the_field(shares: list, batch: int, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        HeteroBatchSampler(GlobalOrder(10), batch, shares, 0)


def test_user_sampler_order_is_the_global_order() -> None:
    order = GlobalOrder(6, base_sampler=[5, 4, 3, 2, 1, 0])  # type: ignore[arg-type]
    s = HeteroBatchSampler(order, 3, [2, 1], 0)
    assert list(s) == [[5, 4], [2, 1]]
    with pytest.raises(ConfigError, match="sampler"):
        list(HeteroBatchSampler(GlobalOrder(6, base_sampler=[0, 1]), 3, [2, 1], 0))  # type: ignore[arg-type]
