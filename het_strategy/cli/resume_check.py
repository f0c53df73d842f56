"""het-train's checks of ``resume=`` before any worker starts: a Lightning checkpoint, of the model ``model.*``
describes."""

from __future__ import annotations

import zipfile
from typing import TYPE_CHECKING, Any

from het_strategy.core.errors import field_error
from het_strategy.core.files import check_readable_file

if TYPE_CHECKING:
    from het_strategy.core.dtypes import Dtype
    from het_strategy.core.workload import TransformerConfig, WorkloadSpec

__all__ = ["check_checkpoint", "check_checkpoint_model", "check_pipeline_checkpoint"]


def check_checkpoint(path: str) -> dict:
    """``resume`` must be a checkpoint Lightning can load: a torch file holding a dict with ``state_dict``; its
    ``state_dict`` (memory-mapped)."""
    file = check_readable_file(path, "resume", "checkpoint file")
    if not zipfile.is_zipfile(file):
        raise field_error("resume", path, "be a Lightning checkpoint (a torch.save file, e.g. "
                          "output.dir/checkpoints/step_N.ckpt); this file is not one")
    import torch

    try:
        # what Lightning's resume does (torch's weights_only default), memory-mapped: no tensor is read here
        ckpt = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # a zip that is no torch file, or one holding objects a checkpoint doesn't
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise field_error("resume", path, f"be a Lightning checkpoint torch.load can read ({first})") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise field_error("resume", path, "be a Lightning checkpoint (a dict with `state_dict`; this file holds "
                          f"{'a dict with keys ' + ', '.join(map(str, list(ckpt)[:5])) if isinstance(ckpt, dict) else type(ckpt).__name__})")
    return ckpt["state_dict"]


def check_checkpoint_model(path: str, state: Any, cfg: "TransformerConfig") -> None:
    """``resume`` must hold this model: the parameter names and shapes of the char GPT ``model.*`` builds (built
    on the meta device: nothing is allocated)."""
    import torch

    from het_strategy.demo.moe_gpt import build_char_model

    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_char_model(cfg).state_dict().items()}
    found = {k: tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")} if isinstance(state, dict) else {}
    missing = [k for k in expected if k not in found]
    wrong = [k for k in expected if k in found and found[k] != expected[k]]
    extra = [k for k in found if k not in expected]
    if not (missing or wrong or extra):
        return
    if wrong:
        why = f"`{wrong[0]}` is {list(found[wrong[0]])} there, {list(expected[wrong[0]])} for this model"
    elif missing:
        why = f"it lacks `{missing[0]}`" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
    else:
        why = f"it holds `{extra[0]}`, which this model has not" + (f" (and {len(extra) - 1} more)" if len(extra) > 1
                                                                      else "")
    raise field_error("resume", path, f"be a checkpoint of the model `model.*` describes ({why})",
                      "resume with the model settings the checkpoint was trained with")


def check_pipeline_checkpoint(path: str, workload: "WorkloadSpec", global_batch_size: int, dtype: "Dtype") -> None:
    """``resume`` with strategy=hetero_deepspeed: a complete checkpoint directory that ``hetero_deepspeed`` wrote,
    of a plan of this model, global batch and dtype (any such plan: the strategy loads it layer by layer)."""
    from pathlib import Path

    from het_strategy.core.plan import SCHEMA_VERSION
    from het_strategy.strategy.deepspeed_checkpoint import check_same_model, read_saved_plan
    from het_strategy.strategy.elastic import COMPLETE_MARKER, is_whole_checkpoint

    folder = Path(path)
    if not folder.is_dir():
        raise field_error("resume", path, "be a checkpoint directory with strategy=hetero_deepspeed (every rank "
                          "writes its share: output.dir/checkpoints/step_N.ckpt/)")
    if not is_whole_checkpoint(folder):
        raise field_error("resume", path, f"be a complete checkpoint directory (it has no `{COMPLETE_MARKER}` "
                          "file: its writing did not finish)", "resume from the checkpoint before it")
    _, saved = read_saved_plan(folder, "resume")
    mine = {"schema_version": SCHEMA_VERSION, "model": workload.fingerprint(), "global_batch_size": global_batch_size,
            "dtype": str(dtype)}
    check_same_model(folder, saved, mine, "resume", partial=True)
