"""A hetero run in its loggers: the plan in the run config, the plan table and picture, every decision as a row.

``RunReport`` works on rank 0 through the Trainer's loggers:

1. **At the start of training** — the plan goes into every logger's run
   config (``log_hyperparams``) under ``hetero``: devices, shares per rank,
   stages, the predicted step time and speed-up over an even split
   (``report/run_record.py``), those figures also as scalars ``plan/<figure>``.
   With a ``WandbLogger``: the table ``hetero/plan`` (a row per rank) and the
   image ``hetero/plan_picture`` (``plan.png``, ``report/picture.py``; for a
   dp plan each rank's share and predicted compute | idle | sync | update).
2. **After every training step** — a new straggler decision
   (``StragglerMitigation.decisions``) or compression choice (the adaptive
   controller's per-layer rows) re-logs the whole table
   ``straggler/decisions`` or ``compression/decisions`` to wandb, and the count
   of decisions so far as a scalar to every logger.
3. **At the end of training** — the last decisions; for a dp plan the step
   picture with each rank's measured mean split (``StepTelemetry.
   measured_step_times``, already gathered) under the predicted one:
   ``step_times.png`` in ``output_dir`` (default: the first logger's local
   folder, CSV's ``version_N``) and ``hetero/step_times`` in wandb.

Predicted figures are the table's: the cost model's score when the runtime has
a workload, else the plan's ``predicted``.  No collective anywhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import lightning.pytorch as pl
from typing_extensions import override

from het_strategy.callbacks.runtime import runtime_of
from het_strategy.callbacks.straggler import StragglerMitigation
from het_strategy.callbacks.telemetry import StepTelemetry
from het_strategy.core.log import logger
from het_strategy.emulation.speeds import cluster_is_emulated
from het_strategy.report.picture import can_draw, plot_plan
from het_strategy.report.run_record import PLAN_COLUMNS, decision_rows, plan_config, plan_rows, predicted_figures
from het_strategy.report.wandb_view import log_picture, log_table, wandb_loggers

if TYPE_CHECKING:
    from het_strategy.callbacks.runtime import HeteroRuntime
    from het_strategy.core.plan_score import PlanScore

__all__ = ["RunReport", "STRAGGLER_COLUMNS", "COMPRESSION_COLUMNS"]

STRAGGLER_COLUMNS = ("step", "effective_step", "action", "ranks", "shares_before", "shares_after", "reason")
COMPRESSION_COLUMNS = ("step", "layer", "method", "bits_per_element", "bytes_per_rank", "error", "budget", "reason")


class RunReport(pl.Callback):
    """Log the plan and every straggler and compression decision of a ``hetero`` run (module docstring).

    Args:
        output_dir: where rank 0 writes ``step_times.png`` at the end of training (default: the first logger's
            local folder; none: not written, only logged to wandb).
    """

    def __init__(self, output_dir: str | Path | None = None) -> None:
        self.output_dir = Path(output_dir) if output_dir is not None else None
        self.step_picture: Path | None = None
        """The ``step_times.png`` written at the end of training (None before, or where none was)."""
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
            log_picture(trainer.loggers, "hetero/plan_picture", plan, cluster, step, figures=_figures(runtime))
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
            self._log_step_picture(trainer)

    def _log_step_picture(self, trainer: pl.Trainer) -> None:
        """The dp step picture with each rank's measured split beside the predicted one, written and logged."""
        runtime = runtime_of(trainer.strategy)
        telemetry = next((c for c in trainer.callbacks if isinstance(c, StepTelemetry)), None)
        if runtime is None or runtime.plan is None or runtime.cluster is None or telemetry is None:
            return
        plan, cluster, measured = runtime.plan, runtime.cluster, telemetry.measured_step_times()
        if not plan.is_pure_dp or measured is None or len(measured) != cluster.num_devices:
            return
        if not can_draw():
            logger.debug("matplotlib is not installed: the measured step picture is not drawn")
            return

        figures = _figures(runtime)
        folder = self.output_dir or _local_log_dir(trainer.loggers)
        if folder is not None:
            self.step_picture = plot_plan(plan, cluster, folder / "step_times.png", measured=measured, figures=figures)
        log_picture(trainer.loggers, "hetero/step_times", plan, cluster, trainer.global_step, figures=figures,
                    measured=measured, file_name="step_times.png")
        logger.debug("run report: measured step picture of %d ranks drawn (%s)", len(measured), self.step_picture)

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


def _figures(runtime: "HeteroRuntime") -> "PlanScore | Mapping[str, Any] | None":
    """The predicted figures the run's table shows: the cost model's score with the runtime's workload, else the
    plan's own (None: ``plan.predicted``)."""
    # workload and profile are the strategy's planning inputs, outside HeteroRuntime: optional here
    workload, profile = getattr(runtime, "workload", None), getattr(runtime, "profile", None)
    if workload is None or runtime.plan is None or runtime.cluster is None:
        return None
    return predicted_figures(runtime.plan, runtime.cluster, workload, profile)[1]


def _local_log_dir(loggers: Any) -> Path | None:
    """The local folder of the first logger that has one (CSV's, TensorBoard's ``version_N``), wandb's aside (it
    gets the picture in its run's files)."""
    wandb = wandb_loggers(loggers)
    for lg in loggers:
        folder = getattr(lg, "log_dir", None) if lg not in wandb else None
        if isinstance(folder, (str, Path)) and "://" not in str(folder):
            return Path(folder)
    return None
