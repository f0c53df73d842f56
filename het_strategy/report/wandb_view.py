"""What only wandb can show of a run: tables, the plan picture, files — to the Trainer's ``WandbLogger`` s.

Scalars go to every logger through ``logger.log_metrics`` (the callbacks do
that); this module handles what a CSV or TensorBoard logger cannot take, and
does nothing when no ``WandbLogger`` is among the loggers:

- ``log_table`` — a ``wandb.Table`` (``WandbLogger.log_table``) at a step;
- ``log_picture`` — draws the plan picture (``picture.py``, matplotlib; for a
  data-parallel plan the step picture, with a run's measured split when given)
  into the wandb run's folder and logs it as a ``wandb.Image``; without
  matplotlib it logs one debug message and nothing else;
- ``save_file`` — ``run.save`` of a file written elsewhere (``summary.json``):
  linked into the run's ``files/`` folder, uploaded with the run, offline
  runs included (``wandb sync``).

Call these on rank 0 only (Lightning's ``WandbLogger`` runs its experiment
there).  wandb itself is imported only where an image is made.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from het_strategy.core.log import logger

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan import Plan
    from het_strategy.core.plan_score import DeviceStepTimes, PlanScore

__all__ = ["wandb_loggers", "log_table", "log_picture", "save_file"]


def wandb_loggers(loggers: Sequence[Any]) -> list[Any]:
    """The ``WandbLogger`` s among ``loggers`` (either Lightning package's, recognised by name)."""
    return [lg for lg in loggers if any(cls.__name__ == "WandbLogger" for cls in type(lg).__mro__)]


def log_table(loggers: Sequence[Any], key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
              step: int | None = None) -> bool:
    """Log a table under ``key`` to every WandbLogger; False when there is none."""
    targets = wandb_loggers(loggers)
    for lg in targets:
        lg.log_table(key=key, columns=list(columns), data=[list(r) for r in rows], step=step)
    return bool(targets)


def log_picture(loggers: Sequence[Any], key: str, plan: "Plan", cluster: "ClusterSpec", step: int | None = None,
                figures: "PlanScore | Mapping[str, Any] | None" = None,
                measured: "Sequence[DeviceStepTimes] | None" = None, file_name: str = "plan.png") -> Path | None:
    """Draw ``plan`` (``picture.plot_plan``: ``figures`` default the plan's ``predicted``; ``measured`` per rank
    for a dp plan) into each wandb run's folder as ``file_name`` and log it as an image; the last file drawn."""
    targets = wandb_loggers(loggers)
    if not targets:
        return None
    try:
        import matplotlib  # noqa: F401  (optional: only the picture needs it)
    except ImportError:
        logger.debug("matplotlib is not installed: the plan picture is not logged")
        return None
    import wandb

    from het_strategy.report.picture import plot_plan

    caption = (f"predicted and measured step of each rank on {cluster.name}" if measured is not None
               else f"plan for {cluster.name}")
    path = None
    for lg in targets:
        path = plot_plan(plan, cluster, Path(lg.experiment.dir) / file_name, measured=measured, figures=figures)
        lg.log_metrics({key: wandb.Image(str(path), caption=caption)}, step=step)
    return path


def save_file(loggers: Sequence[Any], path: str | Path) -> bool:
    """Add the file at ``path`` to every wandb run (its ``files/`` folder); False when there is no WandbLogger."""
    path = Path(path).resolve()
    targets = wandb_loggers(loggers)
    for lg in targets:
        lg.experiment.save(str(path), base_path=str(path.parent), policy="now")
    return bool(targets)
