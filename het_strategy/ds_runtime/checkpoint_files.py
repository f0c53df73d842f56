"""DeepSpeed checkpoint files read as data: ``torch.load(weights_only=True)``, never arbitrary pickles.

A checkpoint directory a user passes (``fit(ckpt_path=...)``) may come from
anywhere; a pickle can run code when it is loaded.  Every file of it this
project reads goes through ``load_as_data``: ``torch.load`` with
``weights_only=True`` (tensors, containers, numbers, strings and the types
torch allowlists, plus the four state types DeepSpeed pickles into its own
files: ``_deepspeed_state_types``), so a crafted file is refused instead of
run.  A file that needs another type is refused in one line that names the
file and the type.

DeepSpeed reads its files through the engine's checkpoint engine
(``engine.checkpoint_engine.load``; its ``TorchCheckpointEngine`` loads with
``weights_only=False``).  ``read_as_data(engine)`` gives the engine a
``TorchCheckpointEngine`` subclass whose ``load`` is ``load_as_data`` and
whose saving is DeepSpeed's own; other checkpoint engines (DeepSpeed's fast,
decoupled or Nebula writers, chosen in its config) are left as they are.

Import cost: torch at module level, deepspeed only inside functions.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from het_strategy.core.errors import field_error

__all__ = ["load_as_data", "read_as_data"]


def load_as_data(path: str | Path, field: str = "ckpt_path", map_location: Any = "cpu") -> Any:
    """``torch.load(path, map_location, weights_only=True)``; ``ConfigError`` on ``field`` naming the file and what
    it needs when it holds anything but data."""
    try:
        with torch.serialization.safe_globals(_deepspeed_state_types()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message: "... Unsupported global: GLOBAL x.y was not an allowed global by default ..."
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        needs = f"it needs {found.group(1)}, which is not data" if found else str(exc).splitlines()[0].rstrip(".")
        raise field_error(field, str(path), f"hold only data (it is read with torch.load(weights_only=True); "
                          f"{needs})", "save it with this version of het_strategy, or check where the file came "
                          "from") from None


def _deepspeed_state_types() -> list[Any]:
    """The types DeepSpeed 0.19 pickles into its own checkpoint files (its loss scalers in the optimizer state,
    the ZeRO stage, the fp32 fragments' addresses), allowlisted; nothing else beyond torch's defaults."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def read_as_data(engine: Any) -> None:
    """Make ``engine`` (a DeepSpeed engine) read every checkpoint file through ``load_as_data``."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is not TorchCheckpointEngine:  # already ours, or another engine that reads its own way
        return
    data_only = _data_only_class()()
    data_only.zipfile_serialization = current.zipfile_serialization
    engine.checkpoint_engine = data_only


def _data_only_class() -> type:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class DataOnlyCheckpointEngine(TorchCheckpointEngine):
        """DeepSpeed's ``TorchCheckpointEngine`` whose ``load`` reads data only (``load_as_data``)."""

        def load(self, path: str, map_location: Any = None) -> Any:
            return load_as_data(path, map_location=map_location)

    return DataOnlyCheckpointEngine
