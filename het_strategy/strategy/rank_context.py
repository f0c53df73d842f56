"""Where this process runs: ``RankContext`` (its rank, the world size, its device, the training dtype).

The ``hetero`` strategy knows these only once Lightning has launched the ranks
and chosen the precision; it hands a ``RankContext`` to its collaborators'
methods instead of letting them read the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RankContext"]


@dataclass(frozen=True)
class RankContext:
    """This process's place in the run."""

    rank: int
    """The global rank; rank r plays the cluster's r-th device."""
    world: int
    """The number of ranks."""
    device: Any
    """This rank's ``torch.device``."""
    dtype: str
    """The training dtype as the cost model names it (``fp32``, ``bf16``, ``fp16``)."""
