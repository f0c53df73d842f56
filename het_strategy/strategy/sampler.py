"""Per-rank batches of uneven size that together cover every global batch exactly once.

Every rank builds the same global order of the epoch (a seeded permutation, the
plain index order, or the indices of the user's own sampler), cuts it into
global batches of ``global_batch_size`` samples and takes its own contiguous
slice of each: ``shares[r]`` samples of a full global batch, a proportional
part (largest remainder) of a short last one.  So, across ranks, every sample
of an epoch is used exactly once and every rank runs the same number of steps.

Two corner cases keep the collectives matched instead of hanging a rank:

* a rank whose slice of some step is empty (a share of 0, or a last global
  batch with fewer samples than ranks) gets one *filler* sample with weight 0:
  it runs forward and backward, its gradient is multiplied by 0, and the
  sample is not counted (``step_counts`` reports 0 for it);
* ``drop_last=True`` drops the short last global batch on every rank.

Shares can change during a run (live rebalancing): ``set_shares(shares,
first_step)`` applies from a given step of the epoch on, so every rank (and
every prefetching DataLoader) switches at the same step whatever it has
already produced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Sampler

from het_strategy.core.errors import ConfigError, field_error

__all__ = ["GlobalOrder", "HeteroBatchSampler", "split_by_shares", "order_fingerprint"]


def split_by_shares(total: int, shares: Sequence[int]) -> list[int]:
    """``total`` samples split in proportion to ``shares`` (largest remainder, ties to the lower rank).

    Exact when ``total == sum(shares)``; the parts always sum to ``total``.
    """
    whole = sum(shares)
    if whole <= 0:
        raise field_error("shares", list(shares), "sum to a positive number of samples")
    if total == whole:
        return list(shares)
    exact = [total * s / whole for s in shares]
    parts = [int(x) for x in exact]
    left = total - sum(parts)
    order = sorted(range(len(shares)), key=lambda r: (-(exact[r] - parts[r]), r))
    for r in order[:left]:
        parts[r] += 1
    return parts


def order_fingerprint(indices: Sequence[int]) -> str:
    """A short hash of an index order (ranks compare it to check they draw the same order)."""
    return hashlib.sha256(",".join(map(str, indices)).encode()).hexdigest()[:16]


class GlobalOrder(Sampler[int]):
    """The epoch's order of sample indices, identical on every rank.

    A seeded permutation (``seed + epoch``), the plain index order, or the
    indices of the user's own sampler (which must then yield the same order on
    every rank).  Lightning calls ``set_epoch`` on it at every epoch start.
    """

    def __init__(self, num_samples: int, *, shuffle: bool = False, seed: int = 0,
                 base_sampler: Sampler[int] | None = None) -> None:
        if not isinstance(num_samples, int) or num_samples < 1:
            raise field_error("dataset length", num_samples, "be >= 1 (a map-style dataset with samples)")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.base_sampler = base_sampler
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def indices(self) -> list[int]:
        if self.base_sampler is not None:
            if hasattr(self.base_sampler, "set_epoch"):
                self.base_sampler.set_epoch(self.epoch)
            order = [int(i) for i in self.base_sampler]
            if len(order) != self.num_samples:
                raise field_error("sampler", type(self.base_sampler).__name__,
                                  f"yield each of the dataset's {self.num_samples} indices once per epoch "
                                  f"(it yielded {len(order)})")
            return order
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(self.num_samples, generator=g).tolist()
        return list(range(self.num_samples))


class HeteroBatchSampler(Sampler[list[int]]):
    """This rank's batch of every step: its slice of each global batch of ``sampler``'s order.

    Args:
        sampler: the global order (``GlobalOrder``); its epoch is the sampler's epoch.
        global_batch_size: samples per step over all ranks.
        shares: samples per rank of a full global batch (sum = ``global_batch_size``).
        rank: this process's rank (index into ``shares``).
        drop_last: drop the short last global batch.
    """

    def __init__(self, sampler: GlobalOrder, global_batch_size: int, shares: Sequence[int], rank: int, *,
                 drop_last: bool = False) -> None:
        if not isinstance(global_batch_size, int) or global_batch_size < 1:
            raise field_error("global_batch_size", global_batch_size, "be an integer >= 1")
        self.sampler = sampler
        self.num_samples = sampler.num_samples
        self.global_batch_size = global_batch_size
        self.world_size = len(shares)
        if not 0 <= rank < self.world_size:
            raise field_error("rank", rank, f"lie in [0, {self.world_size}) (one share per rank)")
        self.rank = rank
        self.drop_last = drop_last
        self._schedule: list[tuple[int, tuple[int, ...]]] = [(0, self._checked(shares))]
        self._epoch = sampler.epoch  # the epoch the schedule and resume position belong to
        self._produced = 0  # batches this epoch's iterator has yielded so far
        self._start_step = 0  # first step the next iterator yields (resume)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    # -- shares ---------------------------------------------------------------------------------
    def _checked(self, shares: Sequence[int]) -> tuple[int, ...]:
        shares = tuple(shares)
        if len(shares) != self.world_size:
            raise field_error("shares", list(shares), f"give one share per rank ({self.world_size})")
        if any(not isinstance(s, int) or isinstance(s, bool) or s < 0 for s in shares):
            raise field_error("shares", list(shares), "be integers >= 0 (samples per rank)")
        if sum(shares) != self.global_batch_size:
            raise field_error("shares", list(shares),
                              f"sum to the global batch size {self.global_batch_size} (they sum to {sum(shares)})",
                              "re-plan for this global batch or pass matching shares")
        return shares

    @property
    def shares(self) -> tuple[int, ...]:
        """The shares of the latest schedule entry."""
        return self._schedule[-1][1]

    def shares_at(self, step: int) -> tuple[int, ...]:
        """The shares that apply to ``step`` of the epoch."""
        current = self._schedule[0][1]
        for first, shares in self._schedule:
            if first > step:
                break
            current = shares
        return current

    @property
    def produced(self) -> int:
        """Steps of this epoch the current iterator has already yielded (prefetched ones included)."""
        self._sync_epoch()
        return self._produced

    def set_shares(self, shares: Sequence[int], first_step: int) -> None:
        """Use ``shares`` from ``first_step`` of this epoch on (and in later epochs).

        ``first_step`` must not lie before a batch this rank has already produced:
        every rank must cut that step the same way.
        """
        checked = self._checked(shares)
        self._sync_epoch()
        if first_step < self._produced:
            raise ConfigError(f"set_shares: step {first_step} is already produced on rank {self.rank} "
                              f"(next is {self._produced}); choose a later step so every rank switches together")
        self._schedule = [(f, s) for f, s in self._schedule if f < first_step] + [(first_step, checked)]

    # -- epoch layout ---------------------------------------------------------------------------
    def _sync_epoch(self) -> None:
        """A new epoch keeps the shares in force and starts at its first step."""
        if self.sampler.epoch != self._epoch:
            self._schedule = [(0, self.shares)]
            self._start_step = 0
            self._produced = 0
            self._epoch = self.sampler.epoch

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch_size)
        return full if (self.drop_last or rest == 0) else full + 1

    def step_counts(self, step: int) -> tuple[int, int]:
        """(samples of this rank, samples of all ranks) in ``step`` of the epoch; fillers count 0."""
        self._sync_epoch()
        size = self._global_size(step)
        return split_by_shares(size, self.shares_at(step))[self.rank], size

    def _global_size(self, step: int) -> int:
        if not 0 <= step < len(self):
            raise field_error("step", step, f"lie in [0, {len(self)}) (steps of an epoch)")
        return min(self.global_batch_size, self.num_samples - step * self.global_batch_size)

    def batch_indices(self, order: Sequence[int], step: int) -> list[int]:
        """This rank's indices in ``step`` (one filler index when its slice is empty)."""
        start = step * self.global_batch_size
        parts = split_by_shares(self._global_size(step), self.shares_at(step))
        offset = start + sum(parts[: self.rank])
        if parts[self.rank] == 0:
            return [order[start]]  # filler, weight 0
        return list(order[offset: offset + parts[self.rank]])

    def __iter__(self) -> Iterator[list[int]]:
        self._sync_epoch()
        order = self.sampler.indices()
        first = self._start_step
        self._start_step = 0
        self._produced = first
        for step in range(first, len(self)):
            self._produced = step + 1
            yield self.batch_indices(order, step)

    # -- resume ---------------------------------------------------------------------------------
    def state_dict(self, next_step: int) -> dict[str, Any]:
        """What resumes this sampler at ``next_step`` of its epoch with the same shares."""
        return {"epoch": self.epoch, "next_step": next_step,
                "schedule": [[f, list(s)] for f, s in self._schedule]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved step of the saved epoch.  The saved shares apply when they are one per rank of this
        run; a checkpoint of another world size (a device gone or joined: the strategy re-planned) keeps this
        run's shares: every step still takes the next global batch of the epoch's order, so no sample is lost or
        seen twice."""
        self.sampler.set_epoch(int(state["epoch"]))
        self._epoch = self.sampler.epoch
        saved = [(int(f), [int(x) for x in s]) for f, s in state["schedule"]]
        if all(len(s) == self.world_size for _, s in saved):
            self._schedule = [(f, self._checked(s)) for f, s in saved]
        else:
            self._schedule = [(0, self.shares)]
        self._start_step = int(state["next_step"])
        self._produced = self._start_step
