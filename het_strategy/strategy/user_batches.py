"""A user's own ``BatchSampler`` (bucketing by length, say) run on this rank's share of the data.

Lightning's DDP keeps a custom batch sampler by building it again over a
distributed sampler.  The hetero strategy does the same over ``RankShard``:
this rank's slice of every global batch of the epoch's one order (the slices
``HeteroBatchSampler`` cuts), with ``batch_size`` set to the rank's share.  So
every sample of an epoch is still used once, by one rank, and each rank's
batches are its share's size; how the sampler groups them (buckets) is its own.

A batch sampler whose class fixes its batch size (it takes no ``batch_size``)
gets whole batches instead: the shares are rounded to multiples of its size
(``whole_batch_shares``) and each step of rank r joins its next ``shares[r] / size``
batches.

A batch sampler may give ranks different numbers of batches (a short last
slice, bucket remainders), and DDP needs the same number of steps on every
rank: ``EqualSteps`` pads a rank's epoch with *filler* batches (one sample,
counted 0, its gradient multiplied by 0) up to the largest count of any rank,
and records how many samples each step of this rank really holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.strategy.sampler import HeteroBatchSampler, split_by_shares

__all__ = ["RankShard", "EqualSteps", "whole_batch_shares"]


def whole_batch_shares(global_batch: int, shares: list[int], batch_size: int, field: str) -> list[int]:
    """``shares`` rounded to whole batches of ``batch_size`` (largest remainder), still summing to the global
    batch, which must be a multiple of ``batch_size``."""
    if global_batch % batch_size:
        raise field_error(field, batch_size, f"divide the global batch ({global_batch}): the hetero strategy gives "
                          "each rank whole batches of a sampler that fixes its batch size",
                          "pass HeteroStrategy(global_batch_size=<a multiple>)")
    return [units * batch_size for units in split_by_shares(global_batch // batch_size, shares)]


class RankShard(Sampler[int]):
    """This rank's sample indices of an epoch: its slice of every global batch, in order (no fillers)."""

    def __init__(self, slices: HeteroBatchSampler) -> None:
        self.slices = slices

    def set_epoch(self, epoch: int) -> None:
        self.slices.set_epoch(epoch)

    def __len__(self) -> int:
        return sum(self.slices.step_counts(step)[0] for step in range(len(self.slices)))

    def __iter__(self) -> Iterator[int]:
        order = self.slices.sampler.indices()
        for step in range(len(self.slices)):
            if self.slices.step_counts(step)[0]:
                yield from self.slices.batch_indices(order, step)


class EqualSteps(Sampler[list[int]]):
    """The user's batch sampler, padded with filler batches to ``steps`` batches per epoch.

    Args:
        batches: the user's batch sampler, built over a ``RankShard``.
        steps: steps per epoch on every rank (the largest ``own_steps`` of any rank).
        group: the user's batches joined into one step's batch (whole batches of a fixed-size sampler; 1
            otherwise; 0 for a rank with no share).
        filler_index: the sample a filler batch holds (its gradient counts 0).
    """

    def __init__(self, batches: Any, steps: int, group: int = 1, filler_index: int = 0) -> None:
        self.batches, self.steps, self.group, self.filler_index = batches, steps, group, filler_index
        self.counts: dict[int, int] = {}
        """Samples really used by each step of the epoch being drawn (0 for a filler), until the step starts."""

    @property
    def sampler(self) -> Any:
        """The rank's shard (Lightning sets its epoch through here)."""
        return getattr(self.batches, "sampler", None)

    def set_epoch(self, epoch: int) -> None:
        shard = self.sampler
        if hasattr(shard, "set_epoch"):
            shard.set_epoch(epoch)

    def __len__(self) -> int:
        return self.steps

    def own_steps(self) -> int:
        """The steps this rank's batches fill (before fillers)."""
        try:
            count = len(self.batches)
        except TypeError:
            raise field_error("DataLoader.batch_sampler", type(self.batches).__name__,
                              "define __len__ (its batches per epoch): every rank must run the same number of steps")
        return -(-count // self.group) if self.group else 0

    def __iter__(self) -> Iterator[list[int]]:
        self.counts = {}
        step, joined, parts = 0, [], 0
        for batch in self.batches if self.group else ():
            joined += list(batch)
            parts += 1
            if parts < self.group:
                continue
            yield from self._step(step, joined)
            step, joined, parts = step + 1, [], 0
        if joined:
            yield from self._step(step, joined)
            step += 1
        for filler in range(step, self.steps):
            self.counts[filler] = 0
            yield [self.filler_index]

    def _step(self, step: int, batch: list[int]) -> Iterator[list[int]]:
        if step == self.steps:
            raise ConfigError(f"DataLoader.batch_sampler ({type(self.batches).__name__}) yielded more batches "
                              f"than its len() said: every rank must run the same steps ({self.steps}), so its "
                              "len() must count the batches it yields")
        self.counts[step] = len(batch)
        yield batch

    def step_samples(self, step: int) -> int:
        """Samples of this rank in ``step`` (0 for a filler); forgets the step."""
        if step not in self.counts:
            raise field_error("batch_idx", step, "be a step this rank's batch sampler has drawn")
        return self.counts.pop(step)
