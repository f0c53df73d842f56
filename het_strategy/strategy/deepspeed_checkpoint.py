"""``hetero_deepspeed`` checkpoints: a DeepSpeed checkpoint directory with Lightning's entries as client state.

``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) make ``path`` a DeepSpeed checkpoint directory (tag
``CHECKPOINT_TAG``) written by every rank through ``PlanRunner.save_checkpoint``: each stage's layers and optimizer
state (one subdirectory per replica of an asymmetric plan), with Lightning's other entries (loops, callbacks, LR
schedulers, the loader's position), the plan (``PLAN_KEY``) and het_strategy's checkpoint format as client state.
Rank 0 writes ``elastic.COMPLETE_MARKER`` once every rank's files are there.

``fit(ckpt_path=path)`` resumes exactly, mid-epoch too, after ``setup`` (the engine is built in
``setup_optimizers``).  Invariants: a checkpoint of another format, or whose plan differs in the model, global
batch or dtype, is refused (naming the fields) before anything is loaded; one of another plan of the same model,
batch and dtype loads through its per-layer files (``ds_runtime.layer_state``); a plan that writes none
(tensor-parallel, fp16 on DeepSpeed's own fp16 optimizers, ZeRO 2/3) loads into its own plan only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_zero_info
from het_strategy.core.plan import Plan
from het_strategy.ds_runtime.checkpoint_files import load_as_data
from het_strategy.ds_runtime.engine import PlanRunner
from het_strategy.ds_runtime.layer_state import LAYERS_DIR, read_layer_states, read_manifest, write_layer_states
from het_strategy.strategy.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_KEY, FORMAT_KEY, check_format
from het_strategy.strategy.elastic import COMPLETE_MARKER

__all__ = ["CHECKPOINT_TAG", "PLAN_KEY", "save_plan_checkpoint", "load_plan_checkpoint", "read_saved_plan",
           "check_same_model"]

CHECKPOINT_TAG = "checkpoint"
"""The DeepSpeed tag checkpoints are written under (``<dir>/checkpoint/``, ``<dir>/replica<p>/checkpoint/``)."""
PLAN_KEY = "hetero_deepspeed_plan"
"""The client-state key of the plan a checkpoint was trained with (``Plan.to_dict()``)."""


def save_plan_checkpoint(runner: PlanRunner, plan: Plan, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Every rank writes its share into the directory ``filepath``; Lightning's entries ride as client state."""
    client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    client[PLAN_KEY] = plan.to_dict()
    client[CHECKPOINT_KEY] = {FORMAT_KEY: CHECKPOINT_FORMAT}
    runner.save_checkpoint(filepath, CHECKPOINT_TAG, client)
    write_layer_states(runner, filepath, list(client))
    _mark_complete(runner, Path(filepath))


def _mark_complete(runner: PlanRunner, path: Path) -> None:
    """Once every rank's files are written (a barrier), rank 0 writes ``elastic.COMPLETE_MARKER`` (by a rename): an
    elastic restart takes only a directory that has it (``elastic.latest_checkpoint``)."""
    runner.barrier()
    if runner.rank == 0:
        part = path / f".{COMPLETE_MARKER}.part"
        part.write_text(json.dumps({"global_steps": int(runner.engine.global_steps)}) + "\n")
        os.replace(part, path / COMPLETE_MARKER)


def read_saved_plan(checkpoint_path: Any, field: str = "ckpt_path") -> tuple[dict[str, Any], dict[str, Any]]:
    """Rank 0's client state of the checkpoint directory ``checkpoint_path`` (read as data, its format checked)
    and the plan it was trained with; a ``ConfigError`` on ``field`` for anything else."""
    path = Path(checkpoint_path)
    # rank 0's file carries the client state; an asymmetric plan's is under replica0/ (PlanRunner.checkpoint_dir)
    candidates = [d / CHECKPOINT_TAG / "mp_rank_00_model_states.pt" for d in (path, path / "replica0")]
    meta = next((c for c in candidates if c.is_file()), candidates[0])
    if not meta.is_file():
        raise field_error(field, str(checkpoint_path), "be a checkpoint directory written by "
                          f"hetero_deepspeed's save_checkpoint (no {meta.relative_to(path)} in it)")
    meta_state = load_as_data(meta, field)
    check_format(meta_state.get(CHECKPOINT_KEY), checkpoint_path, f"client state entry {CHECKPOINT_KEY!r}")
    return meta_state, meta_state.get(PLAN_KEY) or {}


def check_same_model(path: Any, saved: dict[str, Any], mine: dict[str, Any], field: str = "ckpt_path", *,
                     partial: bool = False) -> list[str]:
    """The plan fields ``saved`` and ``mine`` differ in (sorted); a ``ConfigError`` on ``field`` when one of them
    is not reshardable (the model, global batch, dtype, schema).  ``partial``: ``mine`` holds only the fields
    known before planning, and only those are compared."""
    keys = set(mine) if partial else set(mine) | set(saved)
    diff = sorted(k for k in keys if saved.get(k) != mine.get(k))
    fixed = [k for k in diff if k not in _RESHARDABLE]
    if fixed:
        raise field_error(field, str(path), "hold a checkpoint of this strategy's model, batch and dtype (its "
                          f"saved plan `{PLAN_KEY}` differs in: {', '.join(fixed)}; another plan of the same "
                          "model, global batch and dtype loads)", "resume with the checkpoint's model, global "
                          "batch and precision")
    return diff


def load_plan_checkpoint(runner: PlanRunner, plan: Plan, checkpoint_path: Any, *, strict: bool = True
                         ) -> dict[str, Any]:
    """Restore this rank's stage (layers, optimizer state); returns Lightning's entries (the client state)."""
    path = Path(checkpoint_path)
    meta_state, saved = read_saved_plan(path)
    mine = plan.to_dict()
    if saved != mine:
        return _resharded(runner, path, check_same_model(path, saved, mine), meta_state)
    _, client = runner.load_checkpoint(path, CHECKPOINT_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False, load_module_strict=strict)
    if client is None:
        raise field_error("ckpt_path", str(checkpoint_path), "be a DeepSpeed checkpoint DeepSpeed can load "
                          f"(tag {CHECKPOINT_TAG!r})")
    client = dict(client)
    client.pop(PLAN_KEY, None)
    client.pop(CHECKPOINT_KEY, None)
    return client


_RESHARDABLE = {"cluster", "cluster_devices", "pipelines", "zero_stage", "mode", "predicted", "idle_reasons",
                "rank_shares", "compression"}
"""Plan fields a checkpoint may differ in and still load, through its per-layer state (``layer_state``)."""


def _resharded(runner: PlanRunner, path: Path, diff: list[str], meta_state: dict[str, Any]) -> dict[str, Any]:
    """Load a checkpoint of another plan (``diff``: the plan fields it differs in) through its per-layer files;
    Lightning's entries from rank 0's file."""
    manifest = read_manifest(path)
    if manifest is None:
        raise field_error("ckpt_path", str(path), f"hold per-layer state ({LAYERS_DIR}/) to load into another plan "
                          f"(its plan differs in: {', '.join(diff)}; a checkpoint of a tensor-parallel or fp16 plan "
                          "has none)", "resume with the plan the checkpoint was trained with")
    read_layer_states(runner, path, manifest)
    client = {k: meta_state[k] for k in manifest["client_keys"] if k in meta_state}
    client.pop(PLAN_KEY, None)
    client.pop(CHECKPOINT_KEY, None)
    rank_zero_info(runner.rank, "hetero_deepspeed: checkpoint %s of another plan (%s differ) loaded layer by layer "
                   "into this plan", path, ", ".join(diff))
    return client
