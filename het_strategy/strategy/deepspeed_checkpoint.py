"""``hetero_deepspeed`` checkpoints: a DeepSpeed checkpoint directory with Lightning's entries as client state.

``trainer.save_checkpoint(path)`` (and ``ModelCheckpoint``) make ``path`` a
DeepSpeed checkpoint directory (tag ``CHECKPOINT_TAG``), written by every rank
through ``PlanRunner.save_checkpoint``: each stage's layers and its optimizer
state (partitioned under ZeRO 1; one subdirectory per replica for an
asymmetric plan), with Lightning's other entries (loops, callbacks, LR
schedulers, the training loader's position) and the plan (``PLAN_KEY``) as
client state, and het_strategy's checkpoint format (``checkpoint.CHECKPOINT_FORMAT``
under ``checkpoint.CHECKPOINT_KEY``).

Resuming: ``trainer.fit(model, loader, ckpt_path=path)`` (a new Trainer and
module are fine) continues exactly, mid-epoch too.  As in Lightning's
``DeepSpeedStrategy`` the checkpoint is read after ``setup`` (the engine is
built in ``setup_optimizers``): every rank's engine loads its stage's layers
and optimizer state, and the client state gives Lightning its loops and the
loader's position (the training loader saves its position through ``state_dict``: it resumes
at the next step of the saved epoch, in that epoch's order).  A checkpoint
without het_strategy's format, or of another one, is refused (``checkpoint.check_format``); one
whose saved plan is not the strategy's plan (``zero_stage`` override
included) is refused (``ConfigError`` on ``ckpt_path``, naming the plan
fields that differ) before anything is loaded.

Not supported: loading into another plan or world size (re-sharding), a
Lightning single-file checkpoint, ``ckpt_path`` for ``validate`` / ``test`` /
``predict``, and restoring the LightningModule's own full ``state_dict`` (on
each rank the layers of other stages stay untrained in the module).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from het_strategy.core.errors import field_error
from het_strategy.core.plan import Plan
from het_strategy.ds_runtime.checkpoint_files import load_as_data
from het_strategy.ds_runtime.engine import PlanRunner
from het_strategy.strategy.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_KEY, FORMAT_KEY, check_format

__all__ = ["CHECKPOINT_TAG", "PLAN_KEY", "save_plan_checkpoint", "load_plan_checkpoint"]

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


def load_plan_checkpoint(runner: PlanRunner, plan: Plan, checkpoint_path: Any, *, strict: bool = True
                         ) -> dict[str, Any]:
    """Restore this rank's stage (layers, optimizer state); returns Lightning's entries (the client state)."""
    path = Path(checkpoint_path)
    # rank 0's file carries the client state; an asymmetric plan's is under replica0/ (PlanRunner.checkpoint_dir)
    candidates = [d / CHECKPOINT_TAG / "mp_rank_00_model_states.pt" for d in (path, path / "replica0")]
    meta = next((c for c in candidates if c.is_file()), candidates[0])
    if not meta.is_file():
        raise field_error("ckpt_path", str(checkpoint_path), "be a checkpoint directory written by "
                          f"hetero_deepspeed's save_checkpoint (no {meta.relative_to(path)} in it)")
    meta_state = load_as_data(meta)
    check_format(meta_state.get(CHECKPOINT_KEY), checkpoint_path, f"client state entry {CHECKPOINT_KEY!r}")
    saved = meta_state.get(PLAN_KEY)
    mine = plan.to_dict()
    if saved != mine:
        diff = sorted(k for k in set(mine) | set(saved or {}) if (saved or {}).get(k) != mine.get(k))
        raise field_error("ckpt_path", str(checkpoint_path), "hold a checkpoint of this strategy's plan (its "
                          f"saved plan `{PLAN_KEY}` differs in: {', '.join(diff) or 'everything'})",
                          "resume with the plan (and zero_stage) the checkpoint was trained with")
    _, client = runner.load_checkpoint(path, CHECKPOINT_TAG, load_optimizer_states=True,
                                       load_lr_scheduler_states=False, load_module_strict=strict)
    if client is None:
        raise field_error("ckpt_path", str(checkpoint_path), "be a DeepSpeed checkpoint DeepSpeed can load "
                          f"(tag {CHECKPOINT_TAG!r})")
    client = dict(client)
    client.pop(PLAN_KEY, None)
    client.pop(CHECKPOINT_KEY, None)
    return client
