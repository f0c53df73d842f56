"""``hetero_fsdp``: the ``hetero`` run with its model fully sharded, shards sized by memory (``FSDPExtension``).

``fsdp_run(...)`` is ``HeteroRun`` with an ``FSDPExtension``: everything uneven data parallelism does stays the
run's (the planned shares of every batch, the loss weighting that makes the update exact, the emulated padding,
the telemetry), and the extension changes what full sharding changes:

1. **Plan in setup.** The shards must exist before Lightning builds the optimizer, so the plan is made when
   Lightning wraps the model (``configure_ddp``), from the strategy's ``global_batch_size`` (or the given
   plan's): ``planning.strategy_plans.fsdp_plan``, shares by speed and ``plan.shards`` by memory.
2. **Shard instead of DDP.** ``het_strategy.fsdp.shard_model`` cuts the LightningModule into units (``units``:
   its blocks; by default the children of its largest ``nn.ModuleList`` / ``nn.Sequential``), each rank keeping
   ``plan.shards[device]`` of every unit's flat parameter; ``strategy.model`` becomes a thin wrapper through
   which Lightning calls the module, so the module's hooks gather and free the units around every step.  The
   optimizer Lightning builds next steps the shards.
3. **Checkpoints** are directories written by ``torch.distributed.checkpoint`` (``fsdp.checkpoint``): every rank
   its chunks, the rest of Lightning's checkpoint once; loadable into another shard layout and world size.
   ``full_state_dict()`` gathers the whole model on rank 0 for export.
4. **After fit** the module is whole again on every rank (``ShardedModel.unshard``), so ``trainer.validate``,
   ``test`` and ``predict`` run on it as DDP would, and a spawned fit hands the trained model back.

Each rank runs its share of a step in one forward and backward, so the plan is searched with whole shares: where
a share's activations fit only in pieces, the refusal names the rank and suggests Lightning's
``accumulate_grad_batches`` (every rank then runs the same number of micro-steps, each one planned global batch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.log import rank_debug
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.planning.strategy_plans import fsdp_plan
from het_strategy.strategy.dp_extension import DataParallelExtension
from het_strategy.strategy.hetero_run import HeteroRun

__all__ = ["fsdp_run", "FSDPExtension", "default_units", "ModuleCaller", "FSDP_PRECISIONS"]

FSDP_PRECISIONS: tuple[str, ...] = ("32-true", "64-true", "bf16-mixed", "bf16-true")
"""Lightning's precisions ``hetero_fsdp`` runs: the shards are float32 masters (float64 for a float64 model), the
units gathered in the parameters' dtype, autocast as Lightning sets it."""

_REFUSED = (("compression", "the gradients are reduce-scattered in full precision, not through DDP's comm hook"),
            ("compression_state", "there is no DDP comm hook"),
            ("extension", "it is hetero_fsdp's own"),
            ("moe_placement", "HeteroMoE's experts are placed by the hetero strategy's DDP"))


def fsdp_run(cluster: Any = "auto", plan: Any = None, units: list[str] | None = None, prefetch: bool = True,
             activation_checkpointing: bool = False, **kwargs: Any) -> HeteroRun:
    """The ``hetero_fsdp`` strategy's run: ``HeteroRun`` with an ``FSDPExtension``.

    Args:
        units: the module's blocks by dotted name (``["net.0", "net.2"]``), in forward order; None: the children
            of its largest ``nn.ModuleList`` or ``nn.Sequential``.
        prefetch: start the next unit's all-gather while the current one computes.
        activation_checkpointing: recompute each unit's forward in its backward.
        kwargs: ``HeteroRun``'s arguments (``global_batch_size`` is needed without a ``plan``).
    """
    for key, why in _REFUSED:
        if kwargs.get(key) not in (None, "planned"):
            raise field_error(key, kwargs[key] if isinstance(kwargs[key], str) else type(kwargs[key]).__name__,
                              f"be left out for hetero_fsdp ({why})")
    if plan is None and kwargs.get("global_batch_size") is None:
        raise field_error("global_batch_size", None, "be given for hetero_fsdp (or a plan): the shards are planned "
                          "in setup, before the DataLoaders exist", "HeteroFSDPStrategy(global_batch_size=...)")
    if units is not None and (not isinstance(units, (list, tuple)) or not all(isinstance(u, str) for u in units)):
        raise field_error("units", units, "be a list of the module's block names (dotted paths), or null")
    return HeteroRun(cluster, plan, extension=FSDPExtension(units, prefetch, activation_checkpointing), **kwargs)


def default_units(module: nn.Module) -> list[str]:
    """The children with parameters of ``module``'s largest ``nn.ModuleList`` / ``nn.Sequential`` (by parameter
    count; the first of equal ones), by dotted name; ``[]`` when it has none (one root unit)."""
    best: tuple[int, str, nn.Module] | None = None
    for path, sub in module.named_modules():
        if path and isinstance(sub, (nn.ModuleList, nn.Sequential)):
            size = sum(p.numel() for p in sub.parameters())
            if best is None or size > best[0]:
                best = (size, path, sub)
    if best is None:
        return []
    _, path, container = best
    return [f"{path}.{name}" for name, child in container.named_children()
            if any(True for _ in child.parameters())]


class ModuleCaller(nn.Module):
    """What Lightning calls in place of the LightningModule (``strategy.model``): calling it calls the module,
    whose hooks gather and free the units (Lightning redirects the call to ``training_step`` and the others)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class FSDPExtension(DataParallelExtension):
    """Full sharding with per-rank shards from the plan (module docstring).

    Args:
        units: the blocks by name (None: ``default_units``).
        prefetch: overlap the next unit's all-gather with the current unit's compute.
        activation_checkpointing: recompute each unit's forward in its backward.
    """

    runtime = Runtime.hetero_fsdp
    restores_after_setup = True

    def __init__(self, units: list[str] | None, prefetch: bool, activation_checkpointing: bool) -> None:
        self.units = None if units is None else list(units)
        self.prefetch = prefetch
        self.activation_checkpointing = activation_checkpointing
        self.sharded: Any = None
        """This rank's ``fsdp.ShardedModel`` (from ``wrap_model`` to the end of ``fit``)."""
        self.layout: Any = None
        """The ``ShardedModel`` of the last fit, kept after it for what it measured and how it cut the units
        (``units``' names and ``sizes``, ``comm_wait_s``); the module no longer uses it."""
        self._read_itself = False
        self.cluster: ClusterSpec | None = None

    def check_precision(self, precision: str) -> None:
        """fp16 needs one overflow decision over every rank's pieces, and per-device precision unscales each rank's
        gradients in DDP's buckets: neither is in this runtime yet."""
        if precision not in FSDP_PRECISIONS:
            raise field_error("Trainer.precision", precision, f"be one of {', '.join(FSDP_PRECISIONS)} under "
                              "hetero_fsdp (fp16 would need one overflow decision over every rank's pieces, "
                              "per-device precision its unscaling in DDP's buckets)")

    def environment_ready(self, strategy: Any, cluster: ClusterSpec, given: Plan | None, timeout: Any) -> None:
        self.cluster = cluster

    def make_plan(self, cluster: ClusterSpec, workload: WorkloadSpec, global_batch: int, dtype: str,
                  given: Plan | None, profile: MeasuredProfile | None) -> Plan:
        """``given`` checked (memory too), or the fsdp planner's optimum with every share in one forward."""
        try:
            return fsdp_plan(cluster, workload, global_batch, dtype, given, profile, whole_shares=True,
                             activation_checkpointing=self.activation_checkpointing)
        except ConfigError as exc:
            if not str(exc).startswith("`plan.shards."):
                raise
            raise ConfigError(f"{exc} (or run lockstep micro-steps: Trainer(accumulate_grad_batches=k) with a k "
                              "times smaller global_batch_size, each micro-step one planned global batch)",
                              field=exc.field, value=exc.value) from None

    def wrap_model(self, strategy: Any, plan_now: Callable[[], Plan]) -> bool:
        """Shard the LightningModule by the plan's fractions; Lightning then calls it through a ``ModuleCaller``."""
        from het_strategy.fsdp import shard_model

        plan = plan_now()
        cluster = self.cluster
        assert cluster is not None  # invariant: environment_ready ran
        devices = [d.name for d in cluster.devices]
        rank, world = strategy.global_rank, strategy.world_size
        _check_one_micro_batch(plan, devices)
        fractions = [float(plan.shards.get(d, 0.0)) for d in devices]
        module = strategy.lightning_module
        units = self.units if self.units is not None else default_units(module)
        self.sharded = shard_model(module, units, fractions, rank, world, param_dtype=None,
                                   prefetch=self.prefetch, checkpoint_activations=self.activation_checkpointing,
                                   sync_module_states=True)
        strategy.model = ModuleCaller(module)
        rank_debug(rank, "hetero_fsdp: %d units, this rank holds %.3f of each", len(self.sharded.units),
                   fractions[rank])
        return True

    def setup_done(self, strategy: Any, trainer: Any) -> None:
        if trainer.gradient_clip_val:
            raise field_error("Trainer.gradient_clip_val", trainer.gradient_clip_val,
                              "be None under hetero_fsdp (Lightning's clipping sees this rank's shards only)",
                              "clip in configure_gradient_clipping with trainer.strategy.run.extension.sharded."
                              "clip_grad_norm_(max_norm)")

    def train_end(self, strategy: Any) -> None:
        """The module whole again on every rank, with the trained values (a collective, after the LightningModule's
        and the callbacks' ``on_train_end``, before Lightning's teardown moves it): what ``trainer.validate``,
        ``test`` and ``predict`` after ``fit`` run, and what a spawned fit hands back to the main process."""
        if self.sharded is not None:
            self.sharded.unshard()
            self.layout, self.sharded = self.sharded, None
            strategy.model = strategy.lightning_module
            rank_debug(strategy.global_rank, "hetero_fsdp: the module is whole again")

    def module_state(self, state_of: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Nothing while sharded (a checkpoint's model is then its shards: ``write_checkpoint``), else the
        module's own."""
        return {} if self.sharded is not None else state_of()

    def write_checkpoint(self, strategy: Any, checkpoint: dict[str, Any], filepath: Any,
                         write: Callable[[dict[str, Any], Any], None]) -> None:
        """While sharded, a directory at ``filepath``: every rank's chunks of the shards and optimizer state, and
        the rest of Lightning's checkpoint (loops, callbacks, the plan, ...) once (a collective); a whole module
        (after ``fit``) is Lightning's one file."""
        from het_strategy.fsdp.checkpoint import save_sharded

        if self.sharded is None:
            write(checkpoint, filepath)
            return
        if len(strategy.optimizers) > 1:
            raise field_error("configure_optimizers", f"{len(strategy.optimizers)} optimizers",
                              "return one optimizer under hetero_fsdp (one optimizer steps the shards)")
        extra = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        save_sharded(self.sharded, optimizer, Path(filepath), extra=extra)

    def read_checkpoint(self, strategy: Any, path: Any, read: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """A sharded checkpoint (a directory) read into this layout, its optimizer state too while fitting, and
        the rest of it returned; into a whole module (``trainer.validate(ckpt_path=...)``) through an even layout
        made for the read.  A file is Lightning's, loaded by Lightning into a whole module."""
        from het_strategy.fsdp import shard_model
        from het_strategy.fsdp.checkpoint import load_sharded

        self._read_itself = Path(path).is_dir()
        if not self._read_itself:
            if self.sharded is not None:
                raise field_error("ckpt_path", str(path), "be a hetero_fsdp checkpoint directory to resume a sharded "
                                  "fit (a single file holds a whole model: load it into the module before fit)")
            return read(path)
        if self.sharded is not None:
            optimizer = strategy.optimizers[0] if strategy.optimizers else None
            return dict(load_sharded(self.sharded, optimizer, Path(path)))
        module, world = strategy.lightning_module, strategy.world_size
        units = self.units if self.units is not None else default_units(module)
        reading = shard_model(module, units, [1.0 / world] * world, strategy.global_rank, world, prefetch=False)
        extra = dict(load_sharded(reading, None, Path(path)))
        reading.unshard()
        return extra

    def loaded_state_itself(self) -> bool:
        return self._read_itself

    def full_state_dict(self, strategy: Any) -> dict[str, torch.Tensor]:
        """The whole module's ``state_dict`` on rank 0 (``{}`` on the others; a collective while sharded)."""
        if self.sharded is not None:
            return self.sharded.full_state_dict(rank0_only=True)
        return strategy.lightning_module.state_dict() if strategy.global_rank == 0 else {}


def _check_one_micro_batch(plan: Plan, devices: list[str]) -> None:
    """Every rank runs its share in one forward: a plan that cuts a share into micro-batches is refused."""
    for i, replica in enumerate(plan.pipelines):
        if replica.samples > replica.micro_batch_size:
            device = replica.stages[0].devices[0]
            raise field_error(f"plan.pipelines[{i}].micro_batch_size", replica.micro_batch_size,
                              f"be >= the share of {device} (rank {devices.index(device)}: {replica.samples} "
                              "samples): the hetero_fsdp strategy runs a rank's share in one forward",
                              "give the devices more memory, a smaller global batch, or activation_checkpointing")
