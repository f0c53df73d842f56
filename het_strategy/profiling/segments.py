"""A model cut into segments for profiling, and the timeline of a pass through them.

Segments are numbered ``0`` (code before the first block: embeddings),
``1..n`` (the blocks) and ``n + 1`` (code after the last block: norm, head,
loss).  A ``Timeline`` knows which segment is running and is told, by forward
hooks on the blocks (``block_hooks``), when the next one starts; the counting
pass (``block_counts.py``) and the timed passes (``block_times.py``) both run
on it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from torch import nn

__all__ = ["BlockList", "Timeline", "block_hooks", "call_module"]

BlockList = Sequence[tuple[str, nn.Module]]
"""(dotted name, module) of each block, in execution order."""


class Timeline:
    """The segment whose interval is running; calls ``on_leave(segment)`` at every boundary."""

    def __init__(self, on_leave: Callable[[int], None]) -> None:
        self.current = 0
        self.on_leave = on_leave

    def switch(self, segment: int) -> None:
        self.on_leave(self.current)
        self.current = segment


@contextmanager
def block_hooks(block_list: BlockList, pre_hook: Callable[[int], Callable], post_hook: Callable[[int], Callable]
                ) -> Iterator[None]:
    """Forward pre- and post-hooks (with kwargs) on every block while the block runs; removed however it ends.

    ``pre_hook(i)`` and ``post_hook(i)`` make the hooks of block ``i``.
    """
    handles = []
    try:
        for i, (_, block) in enumerate(block_list):
            handles.append(block.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
            handles.append(block.register_forward_hook(post_hook(i), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def call_module(module: nn.Module, batch: Any) -> Any:
    """``module`` called on a sample batch: ``module(**batch)`` for a dict, ``module(*batch)`` for a tuple or
    list, ``module(batch)`` otherwise."""
    if isinstance(batch, Mapping):
        return module(**batch)
    if isinstance(batch, (tuple, list)):
        return module(*batch)
    return module(batch)
