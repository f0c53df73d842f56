"""What a batch holds: its tensors in order, its main tensor, its sample count.

Batches are whatever a DataLoader's ``collate_fn`` returns: tensors nested in
tuples, lists and dicts.  The profiler, the strategy and the callbacks all read
them this one way.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["tensors_in", "first_tensor", "batch_length"]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in nested tuples, lists and dicts, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensors_in(v)


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor in nested tuples, lists and dicts (a batch's main tensor), or None."""
    return next(tensors_in(obj), None)


def batch_length(batch: Any) -> int:
    """Samples in a batch: its first tensor's dim 0 (1 for a scalar, 0 without a tensor)."""
    first = first_tensor(batch)
    if first is None:
        return 0
    return int(first.shape[0]) if first.dim() else 1
