"""torch's names for what the cost model names: dtypes by their short names, a device's synchronisation."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["TORCH_DTYPES", "DTYPE_NAMES", "synchronizer", "indexed_device"]

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""The cost model's dtype names -> torch dtypes."""
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}
"""torch dtypes -> the cost model's names."""


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``'s queued work (a no-op on the CPU): put one at every timing boundary."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def indexed_device(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>``; other devices unchanged."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
