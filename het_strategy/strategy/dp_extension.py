"""``DataParallelExtension``: what an algorithm built on the ``hetero`` run's uneven data parallelism changes.

``HeteroRun`` owns the flow of uneven DDP (the plan, the split loaders, the comm hook, the pacing, the
checkpoint); an extension it is given decides the few things an algorithm on top of it does differently,
and is called at fixed points of that flow.  The defaults here are plain uneven data parallelism
(``strategy="hetero"``); ``hetero_diloco``'s outer loop is ``diloco_run.DiLoCoExtension``.  An extension
owns its own state; ``HeteroRun`` hands it what it needs as arguments.
"""

from __future__ import annotations

from typing import Any, Callable

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.strategy_plans import data_parallel_plan
from het_strategy.strategy.loss_tokens import summed_count

__all__ = ["DataParallelExtension"]


class DataParallelExtension:
    """Plain uneven data parallelism; a subclass changes the points below (each is called on every rank)."""

    runtime = Runtime.hetero
    """The rule table's runtime a given plan must pass (``core.runtime_rules``)."""

    def check_sources(self, cluster: ClusterSpec | str, given: Plan | None) -> None:
        """At construction: the checked cluster (or ``"auto"``) and the given plan (or None)."""

    def make_plan(self, cluster: ClusterSpec, workload: WorkloadSpec, global_batch: int, dtype: str,
                  given: Plan | None, profile: MeasuredProfile | None) -> Plan:
        """The run's plan (on rank 0): ``given`` checked, or the data-parallel planner's optimum."""
        return data_parallel_plan(cluster, workload, global_batch, dtype, given, profile)

    def plan_ready(self, plan: Plan) -> None:
        """``plan`` is the training plan every rank runs from now on (searched, given or restored)."""

    def loss_weight(self, counts: tuple[int, int | None], world: int, device: Any) -> float:
        """What a rank's mean loss is multiplied by, ``counts`` = (its count, every rank's): ``n_r x world / N``,
        so DDP's average over the ranks is the mean loss over the whole global batch.

        The count is the loss's unit (``loss_tokens.LossWeighting``): samples (every rank's known from the
        split), or counted label tokens, every rank's None until summed here (a collective)."""
        local, total = counts
        if total is None:
            total = summed_count(local, device)
        return local * world / total if total else 0.0

    def check_precision(self, precision: str) -> None:
        """The Trainer's precision (Lightning's string, ``per_device`` for ``PerDevicePrecision``), attached in
        ``Trainer(...)``: a ``ConfigError`` if the algorithm cannot run it."""

    def ddp_process_group(self) -> Any:
        """The process group DDP reduces over (None: every rank)."""
        return None

    restores_after_setup = False
    """Whether checkpoints are read after Lightning's setup (into the model as ``wrap_model`` made it)."""

    def loaded_state_itself(self) -> bool:
        """Whether ``read_checkpoint`` read the model's and optimizer's states itself: Lightning's own loading of
        them is then skipped."""
        return False

    def wrap_model(self, strategy: Any, plan_now: Callable[[], Plan]) -> bool:
        """Wrap ``strategy.model`` in place of DDP and return True (False: DDP with the run's comm hook).
        ``plan_now()`` is the training plan, made now if there is none yet (a collective)."""
        return False

    def write_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                         write: Callable[[dict[str, Any], Any], None]) -> None:
        """Write ``checkpoint`` to ``filepath`` (on every rank; ``write``: Lightning's, rank 0 writes one file)."""
        write(checkpoint, filepath)

    def read_checkpoint(self, strategy: Any, path: Any, read: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint at ``path`` (``read``: Lightning's)."""
        return read(path)

    # -- points of the run's flow ---------------------------------------------------------------------
    def environment_ready(self, strategy: Any, cluster: ClusterSpec, given: Plan | None, timeout: Any) -> None:
        """The process group is up and the cluster resolved (``setup_environment``)."""

    def setup_done(self, strategy: Any, trainer: Any) -> None:
        """Lightning's ``setup`` has run (the optimizers exist)."""

    def before_ddp(self, strategy: Any) -> None:
        """Just before DDP wraps the module."""

    def after_ddp(self, strategy: Any) -> None:
        """DDP wraps the module and the comm hook is registered."""

    def after_optimizer_step(self, strategy: Any) -> None:
        """A training optimizer step is done."""

    def train_end(self, strategy: Any) -> None:
        """Before Lightning's ``on_train_end``."""

    def validation_start(self, strategy: Any) -> None:
        """After Lightning's ``on_validation_start``."""

    def validation_end(self, strategy: Any) -> None:
        """Before Lightning's ``on_validation_end``."""

    def module_state(self, state_of: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The module's state dict a checkpoint holds (``state_of()``: the run's own)."""
        return state_of()

    def add_to_checkpoint(self, strategy: Any, checkpoint: dict[str, Any]) -> None:
        """Add this extension's part to the checkpoint being saved (called on every rank)."""

    def checkpoint_loaded(self, checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
        """A checkpoint was read (before the model and optimizer states are loaded)."""

    def model_state_loaded(self, strategy: Any) -> None:
        """Lightning loaded the checkpoint's model state."""

    def optimizer_state_loaded(self, strategy: Any) -> None:
        """Lightning loaded the checkpoint's optimizer states."""

    def teardown(self) -> None:
        """After Lightning's teardown."""
