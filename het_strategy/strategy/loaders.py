"""How the ``hetero`` strategy hands each rank its part of the training loader: ``BatchSplitter``.

Lightning's DDP adds a distributed sampler to every loader (unless
``Trainer(use_distributed_sampler=False)``) and builds the loader again around
it.  For the training loader the hetero strategy replaces what Lightning added
by its planned split; what Lightning left alone stays the user's, and the
evaluation loaders stay exactly as Lightning's DDP made them (equal shares,
its ``DistributedSampler``).  Three modes (``LoaderMode``) for the training loader:

- ``split`` — the default batch sampler: the loader, in its own class, draws
  from a ``HeteroBatchSampler`` that gives this rank ``shares[r]`` samples of
  every global batch of one global order (Lightning's seeded shuffle,
  sequential, or the user's sampler); shares change live (``apply_plan``) and
  its position resumes mid-epoch;
- ``user_batches`` — a custom ``BatchSampler``: built again over this rank's
  shard with ``batch_size`` = the rank's share (``user_batches.py``);
- ``as_is`` — Lightning added no distributed sampler (``use_distributed_sampler=False``,
  or the user's own ``DistributedSampler``): the loader runs as given; the
  rank's share is its batch size.

In every mode the strategy knows how many samples each rank really uses in a
training batch (``counts``), so each rank's loss is weighted and the update is
the mean over the whole global batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from enum import StrEnum
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import logger
from het_strategy.profiling.batch_contents import batch_length
from het_strategy.strategy.constructor_args import RECORDING
from het_strategy.strategy.loader_rebuild import bind_position, fixed_batch_size, rebuild_batch_sampler, rebuild_loader
from het_strategy.strategy.sampler import GlobalOrder, HeteroBatchSampler, order_fingerprint
from het_strategy.strategy.user_batches import EqualSteps, RankShard, whole_batch_shares

__all__ = ["LoaderMode", "BatchSplitter", "WrappedSamplerOrder", "check_splittable", "split_loader",
           "check_same_order", "loader_at", "batch_index", "is_split"]


class LoaderMode(StrEnum):
    """How a loader is given to this rank (see the module docstring)."""

    SPLIT = "split"
    USER_BATCHES = "user_batches"
    AS_IS = "as_is"


def is_split(dataloader: Any) -> bool:
    """Whether ``dataloader`` is one the strategy already rebuilt (Lightning may hand it over again)."""
    return isinstance(getattr(dataloader, "batch_sampler", None), (HeteroBatchSampler, EqualSteps))


def loader_mode(dataloader: DataLoader) -> LoaderMode:
    """``split`` or ``user_batches`` for a loader Lightning gave a distributed sampler; refuses what can't be split."""
    if isinstance(dataloader.dataset, torch.utils.data.IterableDataset):
        raise field_error("DataLoader.dataset", type(dataloader.dataset).__name__,
                          "be a map-style dataset (the strategy cuts every global batch by sample index)")
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is None:
        raise field_error("DataLoader.batch_size", None, "be set, or a batch_sampler given (the hetero strategy "
                          "splits every global batch by shares)")
    return LoaderMode.SPLIT if type(batch_sampler) is BatchSampler else LoaderMode.USER_BATCHES


def check_splittable(dataloader: DataLoader) -> None:
    """Refuse what can't be cut into shares of one global batch: an IterableDataset, a custom batch sampler."""
    if loader_mode(dataloader) is LoaderMode.USER_BATCHES:
        raise field_error("DataLoader.batch_sampler", type(dataloader.batch_sampler).__name__,
                          "be the default one (give batch_size, and optionally a sampler)",
                          "every rank loads the whole global batch and cuts the plan's micro-batches from it")


def _global_order(dataloader: DataLoader) -> GlobalOrder:
    shuffle, seed, base = _global_order_source(dataloader)
    return GlobalOrder(len(dataloader.dataset), shuffle=shuffle, seed=seed, base_sampler=base)  # type: ignore[arg-type]


def split_loader(dataloader: DataLoader, global_batch: int, shares: list[int], rank: int,
                 next_step: Callable[[], int] | None) -> DataLoader:
    """``dataloader`` (its own class) drawing this rank's ``shares[rank]`` of every global batch of one global
    order; with ``next_step`` its position resumes through Lightning's ``state_dict``/``load_state_dict``."""
    sampler = HeteroBatchSampler(_global_order(dataloader), global_batch, shares, rank,
                                 drop_last=bool(dataloader.drop_last))
    loader = rebuild_loader(dataloader, sampler)
    if next_step is not None:
        bind_position(loader, lambda: sampler.state_dict(next_step()), sampler.load_state_dict)
    return loader


def user_batches_loader(dataloader: DataLoader, global_batch: int, shares: list[int], rank: int,
                        steps_of_all: Callable[[int], int]) -> tuple[DataLoader, HeteroBatchSampler]:
    """``dataloader`` with its own batch sampler class over this rank's shard, ``shares[rank]`` per step, and the
    slices it is cut from.

    A sampler that fixes its batch size gets whole batches (the shares rounded to multiples of it).
    ``steps_of_all(own)`` is the largest step count of any rank (a collective across ranks).
    """
    user = dataloader.batch_sampler
    fixed = fixed_batch_size(user)
    if fixed is not None:
        rounded = whole_batch_shares(global_batch, shares, fixed, "DataLoader.batch_sampler.batch_size")
        if rounded != shares and rank == 0:
            logger.info("hetero: %s makes batches of a fixed %d samples: the shares %s run as whole batches %s",
                        type(user).__name__, fixed, shares, rounded)
        shares = rounded
    slices = HeteroBatchSampler(_global_order(dataloader), global_batch, shares, rank,
                                drop_last=bool(getattr(user, "drop_last", False)))
    batches = rebuild_batch_sampler(user, RankShard(slices), None if fixed is not None else max(shares[rank], 1))
    steps = EqualSteps(batches, 0, group=1 if fixed is None else shares[rank] // fixed)
    steps.steps = steps_of_all(steps.own_steps())
    return rebuild_loader(dataloader, steps), slices


def _global_order_source(dl: DataLoader) -> tuple[bool, int, Any]:
    """(shuffle, seed, user sampler or None) of a DataLoader as Lightning handed it over."""
    sampler = dl.sampler if dl.batch_sampler is None or type(dl.batch_sampler) is BatchSampler \
        else getattr(dl.batch_sampler, "sampler", dl.sampler)
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
    """Gives each rank its part of the training loader and follows the current batch's sample counts.

    Args:
        global_batch_size: samples per optimizer step over all ranks for the training loader; None takes
            its ``batch_size x world size``.
    """

    def __init__(self, global_batch_size: int | None = None) -> None:
        self.global_batch_size = global_batch_size
        self.train_sampler: HeteroBatchSampler | None = None
        """The training loader's sampler in ``split`` mode (its shares change on ``apply_plan``)."""
        self.train_mode: LoaderMode | None = None
        """How the training loader was given to this rank (once it was)."""
        self.counts: tuple[int, int] | None = None
        """(this rank's samples, all ranks') of the current batch; None when not known (an evaluation batch)."""
        self._lightning_injects = False

    # -- which loaders are ours to split -------------------------------------------------------------
    def lightning_injects(self) -> None:
        """Lightning is about to add a distributed sampler to the loader it hands over next.

        Lightning asks the strategy's ``distributed_sampler_kwargs`` only then: a loader it hands over without
        having asked keeps the user's own sampling (``use_distributed_sampler=False``, the user's
        ``DistributedSampler``), as under DDP.  The loader Lightning builds next records its constructor's
        arguments (``constructor_args``), so it can be built again around this rank's share.
        """
        self._lightning_injects = True
        RECORDING.open()

    def mode(self, dataloader: DataLoader) -> LoaderMode:
        """How ``dataloader``, just handed over by Lightning, is given to this rank."""
        RECORDING.close()
        injected, self._lightning_injects = self._lightning_injects, False
        return loader_mode(dataloader) if injected else LoaderMode.AS_IS

    def forget_injection(self) -> None:
        """A loader the strategy does not touch (evaluation, already split) was handed over."""
        RECORDING.close()
        self._lightning_injects = False

    # -- split and user_batches ---------------------------------------------------------------------
    def global_batch(self, dataloader: DataLoader, world: int) -> int:
        """The global batch the training ``dataloader`` is split into."""
        if self.global_batch_size is not None:
            return self.global_batch_size
        batch_size = rank_batch_size(dataloader)
        if batch_size is None:
            raise field_error("DataLoader.batch_size", None, "be set (per-rank size; the global batch is "
                              "batch_size x world size)", "or pass HeteroStrategy(global_batch_size=...)")
        return int(batch_size) * world

    def split(self, dataloader: DataLoader, mode: LoaderMode, global_batch: int, shares: list[int], rank: int,
              world: int, next_step: Callable[[], int] | None) -> DataLoader:
        """The training ``dataloader`` split by ``shares``; with ``next_step`` (once the ranks run) it is the one
        followed.

        A collective when the loader has a user sampler (every rank checks it draws the same order) or a user
        batch sampler (every rank runs as many batches as the longest); ``world == 1`` means no other rank
        takes part yet (before the ranks are launched).
        """
        if mode is LoaderMode.USER_BATCHES:
            loader, sampler = user_batches_loader(dataloader, global_batch, shares, rank,
                                                  lambda own: _largest(own, world))
        else:
            loader = split_loader(dataloader, global_batch, shares, rank, next_step)
            sampler = loader.batch_sampler  # type: ignore[assignment]
        if sampler.sampler.base_sampler is not None and world > 1:
            check_same_order(sampler, world)
        if next_step is not None:
            self.train_mode = mode
            self.train_sampler = sampler if mode is LoaderMode.SPLIT else None
        return loader

    # -- as_is --------------------------------------------------------------------------------------
    def keep_as_is(self, dataloader: DataLoader, world: int) -> list[int | None]:
        """The training loader runs as given: every rank's batch size (a collective).

        Refuses loaders of different lengths: ranks would run different numbers of steps and the last
        gradient sync would wait forever.
        """
        batch_size = rank_batch_size(dataloader)
        length = len(dataloader) if _has_len(dataloader) else None
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (batch_size, length))
        lengths = [g[1] for g in gathered]
        if None not in lengths and len(set(lengths)) != 1:
            raise field_error("train_dataloader", f"batches per rank {lengths}",
                              "hold as many batches on every rank (use_distributed_sampler=False keeps each "
                              "rank's loader as given; DDP needs the same steps on every rank)")
        self.train_mode, self.train_sampler = LoaderMode.AS_IS, None
        return [g[0] for g in gathered]

    # -- the current batch --------------------------------------------------------------------------
    def begin_batch(self, loaders: Any, batch_idx: int, dataloader_idx: int = 0, batch: Any = None,
                    training: bool = False, device: Any = None) -> tuple[int, int] | None:
        """A step of ``loaders``' ``dataloader_idx``-th loader starts: its counts (None when not known).

        In training a ``user_batches`` or ``as_is`` loader's counts take a collective (every rank's samples
        of the step are summed).
        """
        batch_sampler = getattr(loader_at(loaders, dataloader_idx), "batch_sampler", None)
        local: int | None = None
        if isinstance(batch_sampler, HeteroBatchSampler):
            self.counts = batch_sampler.step_counts(batch_idx)
            return self.counts
        if training and isinstance(batch_sampler, EqualSteps):
            local = batch_sampler.step_samples(batch_idx)
        elif training and self.train_mode is LoaderMode.AS_IS:
            local = batch_length(batch)
        self.counts = None if local is None else (local, _summed(local, device))
        return self.counts

    @property
    def local_samples(self) -> int | None:
        """Samples this rank really uses in the current batch (0 for a filler), if known."""
        return None if self.counts is None else self.counts[0]

    # -- the training loader's shares ---------------------------------------------------------------
    def train_shares(self) -> list[int] | None:
        """Samples per rank of the training loader's global batch (None unless it runs in ``split`` mode)."""
        return None if self.train_sampler is None else list(self.train_sampler.shares)

    def train_global_batch(self) -> int:
        """The training loader's global batch (``split`` mode)."""
        if self.train_sampler is None:
            raise ConfigError(self.not_rebalanceable())
        return self.train_sampler.global_batch_size

    def set_train_shares(self, shares: list[int], first_step: int) -> None:
        """The training loader draws ``shares`` from step ``first_step`` of this epoch on (every rank, same
        arguments): updates stay exact and each sample of the epoch is still used once."""
        if self.train_sampler is None:
            raise ConfigError(self.not_rebalanceable())
        self.train_sampler.set_shares(shares, first_step)

    def next_safe_step(self, device: Any) -> int:
        """The first step of the epoch no rank has produced yet (a collective: call it on every rank)."""
        if self.train_sampler is None:
            raise ConfigError(self.not_rebalanceable())
        produced = torch.tensor([self.train_sampler.produced], dtype=torch.long, device=device)
        dist.all_reduce(produced, op=dist.ReduceOp.MAX)
        return int(produced.item())

    def not_rebalanceable(self) -> str:
        """Why the training shares can't change now."""
        if self.train_mode is None:
            return "no training DataLoader has been split yet"
        return (f"the training DataLoader runs in {self.train_mode.value!r} mode: its per-rank batch sizes are "
                "fixed for the epoch; live rebalancing needs the default batch sampler and "
                "use_distributed_sampler=True")


def rank_batch_size(dataloader: DataLoader) -> int | None:
    """Samples per batch of ``dataloader`` on one rank: its batch sampler's ``batch_size`` (None if it has none)."""
    return getattr(dataloader.batch_sampler, "batch_size", dataloader.batch_size)


def _has_len(dataloader: DataLoader) -> bool:
    try:
        len(dataloader)
    except TypeError:
        return False
    return True


def _largest(own: int, world: int) -> int:
    """The largest of every rank's ``own`` (a collective when ``world > 1``)."""
    if world == 1:
        return own
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, own)
    return max(gathered)


def _summed(local: int, device: Any) -> int:
    value = torch.tensor([local], dtype=torch.long, device=device)
    dist.all_reduce(value)
    return int(value.item())
