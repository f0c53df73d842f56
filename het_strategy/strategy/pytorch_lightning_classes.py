"""The strategies and the precision plugin on ``pytorch_lightning``, registered in its StrategyRegistry.

``pytorch_lightning`` is a second copy of Lightning with its own class tree: its Trainer takes only
subclasses of its own ``Strategy``.  These classes are ``lightning_classes.py``'s, written out on
``pytorch_lightning``'s bases, handing their hooks to the same package-neutral runs.  Importing this module
imports ``pytorch_lightning`` and registers the strategies' names there.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

from pytorch_lightning.plugins.precision import Precision
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from typing_extensions import override

from het_strategy.strategy.deepspeed_run import DeepSpeedRun
from het_strategy.strategy.diloco_run import diloco_run
from het_strategy.strategy.fsdp_run import fsdp_run
from het_strategy.strategy.hetero_run import HeteroRun
from het_strategy.strategy.per_device_scaling import PER_DEVICE, PerDeviceScaling
from het_strategy.strategy.registry import register_entries
from het_strategy.strategy.strategy_run import StrategyRun

__all__ = ["RunStrategyPL", "HeteroStrategyPL", "HeteroDeepSpeedStrategyPL", "HeteroDiLoCoStrategyPL",
           "HeteroFSDPStrategyPL", "PerDevicePrecisionPL"]


class RunStrategyPL(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose hooks are ``run``'s (a ``StrategyRun``, which calls Lightning's own)."""

    def __init__(self, run: StrategyRun) -> None:
        self.run = run
        """What the strategy does: the package-neutral run (its plan, cluster and parts)."""
        super().__init__(**run.lightning_kwargs())

    @property
    def plan(self) -> Any:
        """The plan being run (``run.plan``)."""
        return self.run.plan

    @property
    def cluster(self) -> Any:
        """The run's cluster (``run.cluster``)."""
        return self.run.cluster

    @property  # type: ignore[override]
    @override
    def precision_plugin(self) -> Precision:
        return DDPStrategy.precision_plugin.fget(self)  # type: ignore[attr-defined]

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        DDPStrategy.precision_plugin.fset(self, plugin)  # type: ignore[attr-defined]
        if plugin is not None:
            self.run.precision_attached(plugin)

    @property  # type: ignore[override]
    @override
    def checkpoint_io(self) -> Any:
        return DDPStrategy.checkpoint_io.fget(self)  # type: ignore[attr-defined]

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if io is not None:
            self.run.checkpoint_io_attached(io)
        DDPStrategy.checkpoint_io.fset(self, io)  # type: ignore[attr-defined]

    @override
    def setup_distributed(self) -> None:
        self.run.setup_distributed(self, super().setup_distributed)

    @override
    def setup_environment(self) -> None:
        self.run.setup_environment(self, super().setup_environment)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.run.on_exception(self, super().on_exception, exception)

    @override
    def teardown(self) -> None:
        self.run.teardown(self, super().teardown)

    @override
    def setup(self, trainer: Any) -> None:
        self.run.setup(self, super().setup, trainer)

    @override
    def configure_ddp(self) -> None:
        self.run.configure_ddp(self, super().configure_ddp)

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        self.run.setup_optimizers(self, super().setup_optimizers, trainer)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.run.distributed_sampler_kwargs(self, super().distributed_sampler_kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        return self.run.process_dataloader(self, super().process_dataloader, dataloader)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.training_step(self, super().training_step, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.validation_step(self, super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.run.test_step(self, super().test_step, *args, **kwargs)

    @override
    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        return self.run.backward(self, super().backward, closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        return self.run.optimizer_step(self, super().optimizer_step, optimizer, closure, model, **kwargs)

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.run.reduce(self, super().reduce, tensor, group, reduce_op)

    @override
    def on_train_end(self) -> None:
        self.run.on_train_end(self, super().on_train_end)

    @override
    def on_validation_start(self) -> None:
        self.run.on_validation_start(self, super().on_validation_start)

    @override
    def on_validation_end(self) -> None:
        self.run.on_validation_end(self, super().on_validation_end)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.run.lightning_module_state_dict(self, super().lightning_module_state_dict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.run.optimizer_state(self, super().optimizer_state, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.run.save_checkpoint(self, super().save_checkpoint, checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.run.load_checkpoint(self, super().load_checkpoint, checkpoint_path, *args, **kwargs)

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.run.load_model_state_dict(self, super().load_model_state_dict, checkpoint, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.run.load_optimizer_state_dict(self, super().load_optimizer_state_dict, checkpoint)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return self.run.restore_checkpoint_after_setup(super().restore_checkpoint_after_setup)

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return self.run.lightning_restore_optimizer(super().lightning_restore_optimizer)


class HeteroStrategyPL(RunStrategyPL):
    """``strategy="hetero"``: uneven data parallelism planned for a heterogeneous cluster.

    Takes ``HeteroRun``'s arguments (``cluster``, ``plan``, ``workload``, ``global_batch_size``, ``compression``,
    ``loss_weighting``, ...; the rest go to Lightning's ``DDPStrategy``).
    """

    strategy_name = "hetero"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(HeteroRun(*args, **kwargs))

    def planned_batch_size(self, global_batch_size: int | None = None) -> int:
        """This rank's share of the training plan, the batch size for its loader when you shard the data yourself
        (``HeteroRun.planned_batch_size``; a collective)."""
        return self.run.planned_batch_size(self, global_batch_size)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_entries(strategy_registry, cls)


class HeteroDeepSpeedStrategyPL(RunStrategyPL):
    """``strategy="hetero_deepspeed"``: heterogeneous pipelines, planned or given, on DeepSpeed.

    Takes ``DeepSpeedRun``'s arguments (``cluster``, ``plan``, ``zero_stage``, ``gradient_clipping``, ...).
    """

    strategy_name = "hetero_deepspeed"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(DeepSpeedRun(*args, **kwargs))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_entries(strategy_registry, cls)


class HeteroDiLoCoStrategyPL(RunStrategyPL):
    """``strategy="hetero_diloco"``: DiLoCo across groups of uneven data parallelism.

    Takes ``diloco_run``'s arguments (``DiLoCoOptions``' and ``HeteroRun``'s, ``loss_weighting`` among them).
    """

    strategy_name = "hetero_diloco"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(diloco_run(*args, **kwargs))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_entries(strategy_registry, cls)


class HeteroFSDPStrategyPL(RunStrategyPL):
    """``strategy="hetero_fsdp"``: fully sharded data parallelism, shards sized by each device's memory and shares
    by its speed.

    Takes ``fsdp_run``'s arguments (``units``, ``prefetch``, ``activation_checkpointing``, and ``HeteroRun``'s:
    ``cluster``, ``plan``, ``global_batch_size``, ``loss_weighting``, ...).
    """

    strategy_name = "hetero_fsdp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(fsdp_run(*args, **kwargs))

    def full_state_dict(self) -> dict[str, Any]:
        """The whole module's ``state_dict`` on rank 0 (``{}`` on the others; a collective): for export."""
        return self.run.extension.full_state_dict(self)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        register_entries(strategy_registry, cls)


class PerDevicePrecisionPL(Precision):
    """Each rank computes in its device's fast 16-bit dtype (``PerDeviceScaling``: autocast, fp16 loss scaling,
    one overflow decision), with fp32 master weights.

    Args:
        init_scale: the fp16 ranks' first loss scale (a power of two).
        growth_interval: clean steps after which the fp16 ranks double their scale.
    """

    precision = PER_DEVICE  # type: ignore[assignment]  # Lightning types it as its own strings

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scaling = PerDeviceScaling(init_scale, growth_interval)
        """This rank's dtype, loss scale and overflow notes."""

    @override
    def forward_context(self) -> ContextManager:
        return self.scaling.forward_context()

    @override
    def train_step_context(self) -> ContextManager:
        return self.scaling.train_step_context()

    @override
    def pre_backward(self, tensor: Any, module: Any) -> Any:
        return super().pre_backward(self.scaling.scaled(tensor), module)

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        return self.scaling.optimizer_step(super().optimizer_step, optimizer, model, closure, **kwargs)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaling.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scaling.load_state_dict(state_dict)


for _strategy in (HeteroStrategyPL, HeteroDeepSpeedStrategyPL, HeteroDiLoCoStrategyPL,
                  HeteroFSDPStrategyPL):
    _strategy.register_strategies(StrategyRegistry)
