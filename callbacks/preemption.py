"""A preemption notice becomes a checkpoint: SIGTERM -> one checkpoint at the next step boundary, then exit 0.

A spot or preemptible VM gets SIGTERM a short while before it is taken (30 s on GCP, 2 minutes on AWS), and
a scheduler stopping a job sends the same.  ``PreemptionCheckpoint``:

1. From ``on_train_start`` it handles SIGTERM itself: the handler only notes the time (Lightning's own handler,
   which it replaces for the run, runs a collective inside the signal handler, which can meet the training
   step's collectives in another order on another rank).
2. After every training step the ranks agree, in one small all-reduce (max of "noticed"), whether any of
   them got the notice: the platform may signal one process or all of them.
3. When one did, every rank takes part in ``trainer.save_checkpoint`` into ``<dirpath>/<filename>.tmp``, which
   rank 0 renames to ``<dirpath>/<filename>`` once complete (an ``AsyncCheckpointIO`` is waited for): a kill
   during the write leaves the previous checkpoint, never a half-written one.  Rank 0 says in one line the
   step, the path, how long it took against ``grace_s`` and how to resume.
4. ``SystemExit(exit_code)``: Lightning tears the run down and the process exits cleanly.

Cost: one 1-element all-reduce per training step.  Resuming is Lightning's ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any
import lightning.pytorch as pl
from typing_extensions import override

from het_strategy.core.errors import field_error, require_int, require_number
from het_strategy.core.log import logger

__all__ = ["PreemptionCheckpoint"]


class PreemptionCheckpoint(pl.Callback):
    """On SIGTERM, a checkpoint at the next step boundary and a clean exit (module docstring).

    Args:
        dirpath: the folder the checkpoint is written into (created when missing).
        filename: its name (``preempted.ckpt``); ``{step}`` in it becomes the global step saved.
        grace_s: seconds the platform leaves between the notice and the kill; a save that takes longer is
            reported.
        exit_code: the code every rank exits with after the save (0; 143 under torchrun's elastic agent, where the
            same SIGTERM is how an agent stops its worker when the group's membership changes: with
            ``filename="step_{step}.ckpt"`` in the periodic checkpoints' folder, ``elastic.latest_checkpoint``
            takes it and the new group goes on from the step the old one reached; an exit code of 0 would read
            to an agent that has not yet seen the change as the job finished, and it would leave the group).
    """

    def __init__(self, dirpath: str | Path, filename: str = "preempted.ckpt", grace_s: float = 30.0,
                 exit_code: int = 0) -> None:
        if not isinstance(filename, str) or not filename.strip() or "/" in filename:
            raise field_error("filename", filename, "be a file name")
        try:
            filename.format(step=0)
        except (KeyError, IndexError, ValueError):
            raise field_error("filename", filename, "be a file name whose only placeholder is {step}") from None
        self.dirpath = Path(dirpath)
        self.filename = filename
        self.grace_s = require_number(grace_s, "grace_s")
        self.exit_code = require_int(exit_code, "exit_code", minimum=0)
        if self.exit_code > 255:
            raise field_error("exit_code", exit_code, "be a process exit code, 0 to 255")
        self.saved: Path | None = None
        """The checkpoint written on SIGTERM (None until then)."""
        self._noticed: float | None = None
        self._previous: Any = None

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` goes."""
        return self.dirpath / self.filename.format(step=step)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = signal.signal(signal.SIGTERM, self._notice)

    def _notice(self, signum: int, frame: Any) -> None:
        """The SIGTERM handler: note the time, nothing else (no I/O, no collective)."""
        if self._noticed is None:
            self._noticed = time.monotonic()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._agreed(trainer):
            return
        started = time.perf_counter()
        path = self.path(trainer.global_step)
        partial = path.with_name(path.name + ".tmp")
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(partial, weights_only=False)  # every rank; ends with a barrier
        _written(trainer.strategy.checkpoint_io)  # an asynchronous writer finishes first
        if trainer.is_global_zero:
            _move(partial, path)
            took = time.perf_counter() - started
            over = took > self.grace_s
            (logger.warning if over else logger.info)(
                "SIGTERM: checkpoint of step %d written to %s in %.1f s (grace %g s%s); resume with "
                "fit(ckpt_path=%r) (het-train resume=%s)", trainer.global_step, path, took, self.grace_s,
                ": over it, the platform may have ended the job first" if over else "", str(path), path)
        trainer.strategy.barrier("PreemptionCheckpoint")
        self.saved = path
        raise SystemExit(self.exit_code)

    def _agreed(self, trainer: pl.Trainer) -> bool:
        """Whether any rank got the notice (one all-reduce of a flag, on every rank)."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([0.0 if self._noticed is None else 1.0], device=trainer.strategy.root_device)
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _written(checkpoint_io: Any) -> None:
    """Wait until ``checkpoint_io`` wrote what it was given: Lightning's ``AsyncCheckpointIO`` writes in a thread
    (its ``teardown`` waits for it; the process exits right after)."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    if isinstance(checkpoint_io, AsyncCheckpointIO):
        checkpoint_io.teardown()


def _move(partial: Path, final: Path) -> None:
    """``partial`` becomes ``final``: a file in one rename; a checkpoint directory (``hetero_deepspeed``) after the
    previous one at ``final``, if any, is removed."""
    if partial.is_dir() and final.is_dir():
        shutil.rmtree(final)
    os.replace(partial, final)
