"""A hetero run in its loggers: the plan in the run config, the plan table and picture, every decision as a row.

``RunReport`` works on rank 0 through the Trainer's loggers:

1. **At the start of training** — the plan goes into the run config of every
   logger (``log_hyperparams``: wandb's config, CSV's ``hparams.yaml``) under
   ``hetero``: the cluster's devices, the shares per rank, the stages, the
   cost model's predicted step time and its speed-up over an even split
   (``report/run_record.py``).  The predicted figures are also scalars
   ``plan/<figure>`` for every logger.  Where a ``WandbLogger`` is present:
   the table ``hetero/plan`` (one row per rank) and the image
   ``hetero/plan_picture`` (``plan.png``; skipped without matplotlib).
2. **After every training step** — a new straggler decision
   (``StragglerMitigation.decisions``: step, effective step, action, ranks,
   shares before and after, reason) or a new compression choice (the
   adaptive controller's per-layer rows: method, bits, bytes, error, budget,
   reason) re-logs the whole table ``straggler/decisions`` or
   ``compression/decisions`` to wandb, and the count of decisions so far as a
   scalar to every logger.
3. **At the end of training** — the decisions made after the last step's check.

Per-step shares, times and bytes per rank come from ``StepTelemetry``; the
run summary file from ``ThroughputMonitor``.  No collective anywhere.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from het_strategy.callbacks.runtime import runtime_of
from het_strategy.callbacks.straggler import StragglerMitigation
from het_strategy.core.log import logger
from het_strategy.emulation.speeds import cluster_is_emulated
from het_strategy.report.run_record import PLAN_COLUMNS, decision_rows, plan_config, plan_rows
from het_strategy.report.wandb_view import log_picture, log_table

__all__ = ["RunReport", "STRAGGLER_COLUMNS", "COMPRESSION_COLUMNS"]

STRAGGLER_COLUMNS = ("step", "effective_step", "action", "ranks", "shares_before", "shares_after", "reason")
COMPRESSION_COLUMNS = ("step", "layer", "method", "bits_per_element", "bytes_per_rank", "error", "budget", "reason")


class RunReport(pl.Callback):
    """Log the plan and every straggler and compression decision of a ``hetero`` run (module docstring)."""

    def __init__(self) -> None:
        self._straggler_logged = 0  # decisions of the straggler callback already in the table
        self._compression_through = -1  # compression rows up to this step already in the table

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        runtime = runtime_of(trainer.strategy)
        if runtime is None or runtime.plan is None or runtime.cluster is None or trainer.global_rank != 0:
            return
        plan, cluster = runtime.plan, runtime.cluster
        # workload and profile are the strategy's planning inputs, outside HeteroRuntime: optional here
        workload, profile = getattr(runtime, "workload", None), getattr(runtime, "profile", None)
        state = runtime.compression_state
        config = plan_config(plan, cluster, workload, profile, emulated=cluster_is_emulated(cluster),
                             compression=state.config.to_dict() if state is not None else None)
        for lg in trainer.loggers:
            lg.log_hyperparams({"hetero": config})
        scalars = {f"plan/{k}": float(v) for k, v in config["predicted"].items()
                   if isinstance(v, (int, float)) and math.isfinite(v)}
        if scalars:
            for lg in trainer.loggers:
                lg.log_metrics(scalars, step=trainer.global_step)
        step = trainer.global_step
        if log_table(trainer.loggers, "hetero/plan", PLAN_COLUMNS, plan_rows(plan, cluster, workload, profile), step):
            log_picture(trainer.loggers, "hetero/plan_picture", plan, cluster, step)
        logger.debug("run report: plan of %s logged to %d logger(s)", cluster.name, len(trainer.loggers))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_rank == 0:
            self._log_decisions(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0:
            self._log_decisions(trainer)

    def _log_decisions(self, trainer: pl.Trainer) -> None:
        """Re-log a decision table that has new rows (a table is logged whole: wandb keeps its last version)."""
        step = trainer.global_step
        straggler = next((c for c in trainer.callbacks if isinstance(c, StragglerMitigation)), None)
        if straggler is not None and len(straggler.decisions) > self._straggler_logged:
            for lg in trainer.loggers:
                lg.log_metrics({"straggler/decisions": float(len(straggler.decisions))}, step=step)
            log_table(trainer.loggers, "straggler/decisions", *decision_rows(straggler.decisions, STRAGGLER_COLUMNS),
                      step=step)
            self._straggler_logged = len(straggler.decisions)
        state = runtime.compression_state if (runtime := runtime_of(trainer.strategy)) is not None else None
        if state is None or not state.decisions or int(state.decisions[-1]["step"]) <= self._compression_through:
            return
        solves = len({int(row["step"]) for row in state.decisions})
        for lg in trainer.loggers:
            lg.log_metrics({"compression/decisions": float(solves)}, step=step)
        log_table(trainer.loggers, "compression/decisions", *decision_rows(state.decisions, COMPRESSION_COLUMNS),
                  step=step)
        self._compression_through = int(state.decisions[-1]["step"])
