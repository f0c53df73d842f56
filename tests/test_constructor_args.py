"""The recorded constructor calls of DataLoader and BatchSampler subclasses (``strategy.constructor_args``) and the
rebuild around a rank's share that reads them (``strategy.loader_rebuild``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

from het_strategy.core.errors import ConfigError
from het_strategy.strategy.constructor_args import RECORDING, ConstructorRecording, called_again, recorded_call
from het_strategy.strategy.loader_rebuild import rebuild_batch_sampler, rebuild_loader


class FeatureLoader(DataLoader):
    """Takes a required argument it only checks and never stores."""

    def __init__(self, dataset: Any, num_features: int, *, tag: str = "", **kwargs: Any) -> None:
        if num_features != 3:
            raise ValueError(f"num_features {num_features}")
        super().__init__(dataset, **kwargs)
        self.label = f"{tag}:{num_features}"


class NoKwargsLoader(DataLoader):
    """Names every DataLoader argument it takes; no ``**kwargs``."""

    def __init__(self, dataset: Any, scale: int, batch_size: int = 1, shuffle: bool = False,
                 sampler: Any = None, batch_sampler: Any = None, drop_last: bool = False) -> None:
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, drop_last=drop_last)
        self.doubled = 2 * scale


class Plain(DataLoader):
    """A subclass without an ``__init__`` of its own."""


class EveryOther(BatchSampler):
    """A batch sampler with an argument of its own it does not store."""

    def __init__(self, sampler: Any, batch_size: int, stride: int, drop_last: bool = False) -> None:
        super().__init__(sampler, batch_size, drop_last)
        self.kept = stride > 0


def _data(n: int = 12) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64))


@pytest.fixture(autouse=True)
def closed_recording():
    yield
    RECORDING.close()


def test_a_call_made_while_open_is_recorded_once_and_the_constructors_are_restored() -> None:
    own = {cls: cls.__dict__["__init__"] for cls in (DataLoader, FeatureLoader, BatchSampler, EveryOther)}
    recording = ConstructorRecording()
    recording.open()
    recording.open()  # one recording
    data = _data()
    loader = FeatureLoader(data, 3, tag="t", batch_size=4)
    inherited = Plain(data, batch_size=2)
    assert recorded_call(loader).args == (data, 3) and recorded_call(loader).kwargs == {"tag": "t", "batch_size": 4}
    assert recorded_call(inherited).kwargs == {"batch_size": 2}  # recorded by DataLoader's own __init__
    recording.close()
    assert {cls: cls.__dict__["__init__"] for cls in own} == own
    assert recorded_call(FeatureLoader(data, 3)) is None  # closed: nothing recorded


def test_a_wrapper_another_tool_set_after_opening_is_left_to_it() -> None:
    own = FeatureLoader.__dict__["__init__"]
    recording = ConstructorRecording()
    recording.open()
    theirs = lambda self, *a, **k: None  # noqa: E731
    FeatureLoader.__init__ = theirs
    recording.close()
    assert FeatureLoader.__dict__["__init__"] is theirs
    FeatureLoader.__init__ = own


def test_a_loader_with_an_unstored_argument_is_built_again_from_its_call() -> None:
    RECORDING.open()
    loader = FeatureLoader(_data(), 3, tag="x", batch_size=4, shuffle=True, num_workers=0)
    RECORDING.close()
    batches = BatchSampler(SequentialSampler(range(12)), 5, drop_last=False)
    rebuilt = rebuild_loader(loader, batches)
    assert type(rebuilt) is FeatureLoader and rebuilt.label == "x:3"
    assert rebuilt.batch_sampler is batches and rebuilt.batch_size is None
    assert [b[0].tolist() for b in rebuilt] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]


def test_a_loader_without_kwargs_gets_the_sampling_arguments_by_name() -> None:
    RECORDING.open()
    loader = NoKwargsLoader(_data(), 5, 4, True)  # batch_size and shuffle given positionally
    RECORDING.close()
    batches = BatchSampler(SequentialSampler(range(12)), 6, drop_last=False)
    rebuilt = rebuild_loader(loader, batches)
    assert type(rebuilt) is NoKwargsLoader and rebuilt.doubled == 10 and rebuilt.batch_sampler is batches


def test_a_batch_sampler_subclass_is_built_again_from_its_call() -> None:
    RECORDING.open()
    user = EveryOther(SequentialSampler(range(8)), 4, stride=2)
    RECORDING.close()
    rebuilt = rebuild_batch_sampler(user, SequentialSampler(range(3)), 2)
    assert type(rebuilt) is EveryOther and rebuilt.kept and list(rebuilt) == [[0, 1], [2]]


def test_a_required_argument_the_class_cannot_take_is_refused_in_one_line() -> None:
    class Narrow(DataLoader):
        def __init__(self, dataset: Any, batch_size: int = 1) -> None:
            super().__init__(dataset, batch_size=batch_size)

    RECORDING.open()
    loader = Narrow(_data(), 4)
    RECORDING.close()
    refused = r"`DataLoader` is 'Narrow'; it must accept the arguments \['batch_sampler'\]"
    with pytest.raises(ConfigError, match=refused):
        rebuild_loader(loader, BatchSampler(SequentialSampler(range(12)), 6, drop_last=False))
    assert called_again(loader, {"shuffle": False}, required=()) is not None  # an optional one is dropped


def test_an_unrecorded_loader_falls_back_to_its_attributes_and_names_the_missing_one() -> None:
    loader = FeatureLoader(_data(), 3, batch_size=4)  # made outside any recording
    with pytest.raises(ConfigError, match=r"keep its __init__ arguments \['num_features'\] as attributes"):
        rebuild_loader(loader, BatchSampler(SequentialSampler(range(12)), 6, drop_last=False))
