"""The hetero strategy's loader handling without processes: which loaders it splits, how a user's DataLoader
subclass and batch sampler are rebuilt around a rank's share, and data set up before the ranks launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from het_strategy.core.errors import ConfigError
from het_strategy.strategy.loader_rebuild import fixed_batch_size, rebuild_loader
from het_strategy.strategy.loaders import BatchSplitter, LoaderMode, is_split, user_batches_loader
from het_strategy.strategy.sampler import GlobalOrder, HeteroBatchSampler
from het_strategy.strategy.user_batches import EqualSteps, RankShard
from tests._data_compat_cases import EQUAL_CLUSTER, FixedFour, LengthBuckets, TaggedLoader
from tests._strategy_worker import IndexedData


def test_only_a_loader_lightning_gave_a_distributed_sampler_is_split() -> None:
    splitter = BatchSplitter()
    plain = DataLoader(list(range(8)), batch_size=2)
    assert splitter.mode(plain) is LoaderMode.AS_IS  # use_distributed_sampler=False: Lightning never asked
    splitter.lightning_injects()
    assert splitter.mode(plain) is LoaderMode.SPLIT
    assert splitter.mode(plain) is LoaderMode.AS_IS  # the flag is for one loader only
    splitter.lightning_injects()
    bucketed = DataLoader(list(range(8)), batch_sampler=LengthBuckets(SequentialSampler(range(8)), 2, False))
    assert splitter.mode(bucketed) is LoaderMode.USER_BATCHES


def test_a_dataloader_subclass_is_rebuilt_in_its_class_with_its_attributes() -> None:
    loader = TaggedLoader(IndexedData(8), tag="mine", batch_size=2, num_workers=0)
    sampler = HeteroBatchSampler(GlobalOrder(8), 4, [3, 1], 0)
    rebuilt = rebuild_loader(loader, sampler)
    assert type(rebuilt) is TaggedLoader and rebuilt.describe() == "tagged:mine"
    assert rebuilt.batch_sampler is sampler and [b[2].tolist() for b in rebuilt] == [[0, 1, 2], [4, 5, 6]]


def test_a_subclass_whose_arguments_are_not_attributes_is_refused_naming_them() -> None:
    class Hidden(DataLoader):
        def __init__(self, dataset, secret, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(dataset, **kwargs)

    with pytest.raises(ConfigError, match=r"`DataLoader` is 'Hidden'.*\['secret'\]"):
        rebuild_loader(Hidden(list(range(4)), 1, batch_size=2), HeteroBatchSampler(GlobalOrder(4), 2, [1, 1], 0))

    class OwnIndices(BatchSampler):
        def __init__(self, size):  # type: ignore[no-untyped-def]
            super().__init__(range(size), 4, False)

    with pytest.raises(ConfigError, match="DataLoader.batch_sampler.*`sampler` argument.*planned_batch_size"):
        fixed_batch_size(OwnIndices(8))


def test_a_bucketing_batch_sampler_gets_the_ranks_share_and_every_sample_once() -> None:
    data = IndexedData(20)
    loader = DataLoader(data, batch_sampler=LengthBuckets(SequentialSampler(data), 5, drop_last=False))
    seen, shapes = [], []
    lengths = []
    for rank, share in enumerate([6, 2]):  # a global batch of 8: 2 full ones and a short last one of 4
        rank_loader = user_batches_loader(loader, 8, [6, 2], rank, lambda own: max(own, 3))[0]
        lengths.append(len(rank_loader))
        batches = [b[2].tolist() for b in rank_loader]
        shapes.append([len(b) for b in batches])
        counts = rank_loader.batch_sampler.counts  # type: ignore[union-attr]
        seen += [i for step, b in enumerate(batches) if counts[step] for i in b]
        assert all(b == sorted(b, key=lambda i: (-(i % 5), i)) for b in batches)  # the user's own ordering
    assert sorted(seen) == list(range(20))
    assert shapes == [[6, 6, 3], [2, 2, 1]] and lengths == [3, 3]


def test_a_fixed_size_batch_sampler_gets_whole_batches_and_every_sample_once() -> None:
    data = IndexedData(24)
    loader = DataLoader(data, batch_sampler=FixedFour(SequentialSampler(data)))
    per_rank = []
    for rank in (0, 1):  # planned shares 9 and 3 of 12 run as whole batches of 4: 8 and 4
        rank_loader = user_batches_loader(loader, 12, [9, 3], rank, lambda own: own)[0]
        per_rank.append([b[2].tolist() for b in rank_loader])
    assert [[len(b) for b in batches] for batches in per_rank] == [[8, 8], [4, 4]]
    assert per_rank[0][0] == list(range(8)) and per_rank[1][0] == list(range(8, 12))
    assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(24))
    idle = user_batches_loader(loader, 12, [11, 1], 1, lambda own: max(own, 2))[0]  # 1 of 12 rounds to no batch
    assert [b[2].tolist() for b in idle] == [[0], [0]]  # fillers, counted 0
    assert [idle.batch_sampler.step_samples(s) for s in (0, 1)] == [0, 0]  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"`DataLoader.batch_sampler.batch_size` is 4; it must divide the global"):
        user_batches_loader(loader, 10, [5, 5], 0, lambda own: own)[0]


def test_equal_steps_pads_a_short_rank_with_fillers_counted_zero() -> None:
    slices = HeteroBatchSampler(GlobalOrder(9), 8, [7, 1], 1)  # rank 1: 1 of the first 8, 0 of the last 1
    shard = RankShard(slices)
    assert list(shard) == [7] and len(shard) == 1
    steps = EqualSteps(BatchSampler(shard, 1, False), steps=2)
    assert list(steps) == [[7], [0]]
    assert [steps.step_samples(0), steps.step_samples(1)] == [1, 0]

    class Liar(BatchSampler):
        def __len__(self) -> int:
            return 1

    with pytest.raises(ConfigError, match="yielded more batches than its len"):
        list(EqualSteps(Liar(range(4), 1, False), steps=1))


def test_data_set_up_before_the_ranks_launch_gives_the_epochs_steps() -> None:
    """``estimated_stepping_batches`` and ``num_training_batches`` before ``fit``: no rank runs yet, so the loader
    is split evenly (its length, the steps of an epoch, is the same for any shares)."""
    pl = pytest.importorskip("lightning.pytorch")
    import het_strategy
    from tests._data_compat_cases import make_module

    strategy = het_strategy.HeteroStrategy(cluster=EQUAL_CLUSTER, global_batch_size=12, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=3, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    module = make_module("plain", "/nonexistent", pl)
    trainer.strategy.connect(module)
    trainer._data_connector.attach_data(module)  # what Trainer.fit does first (as Lightning's own tests do)
    assert trainer.estimated_stepping_batches == 3 * 3  # ceil(32 / 12) steps per epoch
    assert trainer.num_training_batches == 3
    assert is_split(trainer.train_dataloader)


def test_no_bare_assert_on_a_user_path_in_the_strategies() -> None:
    """Every ``assert`` left in ``strategy/`` states an invariant the code itself guarantees, in a comment."""
    root = Path(__file__).resolve().parents[1] / "het_strategy" / "strategy"
    bare = [f"{path.name}:{n}: {line.strip()}" for path in sorted(root.glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if re.match(r"\s*assert\b", line) and "# invariant:" not in line]
    assert bare == []


def test_the_share_of_a_distributed_sampler_in_a_user_batch_sampler_is_read_through_it() -> None:
    """Lightning rebuilds a custom batch sampler over its DistributedSampler: the global order is read there."""
    data = IndexedData(8)
    inner = DistributedSampler(data, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(data, batch_sampler=LengthBuckets(inner, 2, drop_last=False))
    rank_loader = user_batches_loader(loader, 4, [2, 2], 0, lambda own: own)[0]
    expected = torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    got = [i for b in rank_loader for i in b[2].tolist()]
    assert sorted(got) == sorted(expected[0:2] + expected[4:6])
