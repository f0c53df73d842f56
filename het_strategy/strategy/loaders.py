"""The DataLoader the strategy hands back: the user's loader with our batch sampler; ``BatchSplitter``.

``BatchSplitter`` is the ``hetero`` strategy's part that rebuilds every loader
Lightning hands it, keeps the training loader's sampler (its shares change on
``apply_plan``) and knows how many samples this rank uses in the current batch.
``split_loader`` checks that a loader can be split (a map-style dataset, the
default batch sampler), reads the global order it would have drawn — Lightning's
seeded shuffle under DDP, sequential, or the user's own sampler — and rebuilds
it with a ``HeteroBatchSampler`` that gives this rank its slice of every global
batch.  ``HeteroDataLoader`` saves and restores the sampler's position through
Lightning's resumable-loader interface (``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.strategy.sampler import GlobalOrder, HeteroBatchSampler, order_fingerprint

__all__ = ["BatchSplitter", "HeteroDataLoader", "WrappedSamplerOrder", "check_splittable", "split_loader", "check_same_order", "loader_at", "batch_index"]


class HeteroDataLoader(DataLoader):
    """A DataLoader over a ``HeteroBatchSampler``; Lightning saves and restores its position."""

    def __init__(self, *args: Any, next_step: Callable[[], int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._next_step = next_step

    def state_dict(self) -> dict[str, Any]:
        sampler: HeteroBatchSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler.state_dict(self._next_step() if self._next_step else 0)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)  # type: ignore[union-attr]


def check_splittable(dataloader: DataLoader) -> None:
    """Refuse what the strategy can't split: an IterableDataset, a custom batch sampler."""
    if isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
        raise field_error("DataLoader.dataset", type(dataloader.dataset).__name__,
                          "be a map-style dataset (the hetero strategy splits indices by shares)")
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None or (type(batch_sampler) is not BatchSampler
                                 and not isinstance(batch_sampler, HeteroBatchSampler)):
        raise field_error("DataLoader.batch_sampler", type(batch_sampler).__name__,
                          "be the default one (give batch_size, and optionally a sampler)",
                          "the hetero strategy builds each rank's batches itself from the global batch")


def split_loader(dataloader: DataLoader, global_batch: int, shares: list[int], rank: int,
                 next_step: Callable[[], int] | None) -> HeteroDataLoader:
    """``dataloader`` drawing this rank's ``shares[rank]`` of every global batch of one global order."""
    shuffle, seed, base = _global_order_source(dataloader)
    order = GlobalOrder(len(dataloader.dataset), shuffle=shuffle, seed=seed, base_sampler=base)  # type: ignore[arg-type]
    sampler = HeteroBatchSampler(order, global_batch, shares, rank, drop_last=bool(dataloader.drop_last))
    kwargs: dict[str, Any] = dict(
        dataset=dataloader.dataset, batch_sampler=sampler, num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn, pin_memory=dataloader.pin_memory, timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn, multiprocessing_context=dataloader.multiprocessing_context,
        generator=dataloader.generator, persistent_workers=dataloader.persistent_workers,
        pin_memory_device=dataloader.pin_memory_device)
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
    return HeteroDataLoader(next_step=next_step, **kwargs)


def _global_order_source(dl: DataLoader) -> tuple[bool, int, Any]:
    """(shuffle, seed, user sampler or None) of a DataLoader as Lightning handed it over."""
    sampler = dl.sampler
    if isinstance(sampler, DistributedSampler):
        if type(sampler).__name__ == "DistributedSamplerWrapper":  # Lightning's, around the user's own sampler
            return False, 0, WrappedSamplerOrder(sampler.dataset)
        return bool(sampler.shuffle), int(sampler.seed), None
    if isinstance(sampler, RandomSampler):
        return True, int(os.environ.get("PL_GLOBAL_SEED", 0)), None
    if isinstance(sampler, SequentialSampler):
        return False, 0, None
    return False, 0, sampler


class WrappedSamplerOrder(Sampler[int]):
    """The order of a user's sampler that Lightning wrapped in a ``DistributedSamplerWrapper``.

    Read through the wrapper's ``dataset``: an index view of the user's sampler whose ``reset()`` draws the
    sampler's order again (once per epoch, as Lightning's own wrapper does).
    """

    def __init__(self, view: Any) -> None:
        self.view = view

    def __len__(self) -> int:
        return len(self.view)

    def __iter__(self) -> Iterator[int]:
        self.view.reset()
        return iter([self.view[i] for i in range(len(self.view))])


def loader_at(loaders: Any, dataloader_idx: int) -> Any:
    """The ``dataloader_idx``-th of Lightning's loaders (a loader, a list or a dict of them), or None."""
    if isinstance(loaders, (list, tuple)):
        return loaders[dataloader_idx] if dataloader_idx < len(loaders) else None
    if isinstance(loaders, dict):
        values = list(loaders.values())
        return values[dataloader_idx] if dataloader_idx < len(values) else None
    return loaders


def check_same_order(sampler: HeteroBatchSampler, world_size: int) -> None:
    """Every rank cuts the same global order: a user sampler must yield the same indices on every rank.
    A collective (every rank compares its order's fingerprint)."""
    fingerprints: list[Any] = [None] * world_size
    dist.all_gather_object(fingerprints, order_fingerprint(sampler.sampler.indices()))
    if len(set(fingerprints)) != 1:
        raise field_error("DataLoader.sampler", type(sampler.sampler.base_sampler).__name__,
                          "yield the same order on every rank (seed it): the hetero strategy cuts one "
                          "global order into per-rank slices", "or pass shuffle=True and no sampler")


def batch_index(args: tuple, kwargs: dict) -> int:
    """``batch_idx`` of a Lightning step's arguments."""
    if "batch_idx" in kwargs:
        return int(kwargs["batch_idx"])
    return int(args[1]) if len(args) > 1 else 0


class BatchSplitter:
    """Splits each DataLoader by shares and follows the current batch's sample counts.

    Args:
        global_batch_size: samples per optimizer step over all ranks for the training loader; None takes
            its ``batch_size x world size``.
    """

    def __init__(self, global_batch_size: int | None = None) -> None:
        self.global_batch_size = global_batch_size
        self.train_sampler: HeteroBatchSampler | None = None
        """The training loader's sampler (once the training loader is split)."""
        self.counts: tuple[int, int] | None = None
        """(this rank's samples, all ranks') of the current batch; None outside a split loader's batch."""

    def global_batch(self, dataloader: DataLoader, training: bool, world: int) -> int:
        """The global batch ``dataloader`` is split into (refusing a loader that cannot be split)."""
        check_splittable(dataloader)
        if training and self.global_batch_size is not None:
            return self.global_batch_size
        if dataloader.batch_size is None:
            raise field_error("DataLoader.batch_size", None, "be set (per-rank size; the global batch is "
                              "batch_size x world size)", "or pass HeteroStrategy(global_batch_size=...)")
        return int(dataloader.batch_size) * world

    def split(self, dataloader: DataLoader, global_batch: int, shares: list[int], rank: int, world: int,
              next_step: Callable[[], int] | None) -> HeteroDataLoader:
        """``dataloader`` split by ``shares``; with ``next_step`` (the training loader) its sampler is kept.

        A collective when the loader has a user sampler (every rank checks it draws the same order).
        """
        loader = split_loader(dataloader, global_batch, shares, rank, next_step)
        sampler: HeteroBatchSampler = loader.batch_sampler  # type: ignore[assignment]
        if sampler.sampler.base_sampler is not None:
            check_same_order(sampler, world)
        if next_step is not None:
            self.train_sampler = sampler
        return loader

    def begin_batch(self, loaders: Any, batch_idx: int, dataloader_idx: int = 0) -> tuple[int, int] | None:
        """A step of ``loaders``' ``dataloader_idx``-th loader starts: its counts (None for a loader not split)."""
        sampler = getattr(loader_at(loaders, dataloader_idx), "batch_sampler", None)
        self.counts = sampler.step_counts(batch_idx) if isinstance(sampler, HeteroBatchSampler) else None
        return self.counts

    @property
    def local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a filler), if known."""
        return None if self.counts is None else self.counts[0]

    def loss_weight(self, world: int) -> float | None:
        """What this rank's mean loss is multiplied by so DDP's average is the mean over the global batch."""
        if self.counts is None:
            return None
        local, total = self.counts
        return local * world / total

    def next_safe_step(self, device: Any) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        if self.train_sampler is None:
            raise ConfigError("next_safe_step: no training DataLoader has been split yet")
        produced = torch.tensor([self.train_sampler.produced], dtype=torch.long, device=device)
        dist.all_reduce(produced, op=dist.ReduceOp.MAX)
        return int(produced.item())
