"""``StrategyRun``: a strategy's behaviour, written once for both Lightning packages.

``lightning.pytorch`` and ``pytorch_lightning`` are two class trees: a Trainer takes only strategies of its
own package.  Each of our strategies is therefore one package-neutral run (``HeteroRun``, ``DeepSpeedRun``)
and, per package, a thin written-out subclass of that package's ``DDPStrategy`` (``lightning_classes.py``,
``pytorch_lightning_classes.py``) whose every overridden hook hands itself to the run:

    def setup_environment(self):
        self.run.setup_environment(self, super().setup_environment)

A run's hook gets the Lightning strategy (for Lightning's public API: the module, the ranks, the device,
``model``) and ``parent``, the package's own implementation, which it calls, or replaces when it does not.
The defaults below call ``parent`` unchanged, so a run writes only the hooks it changes, except the process's
lifecycle (``RunLifecycle``: heartbeat, elastic restart, end of process), which every run has and the defaults
drive.  A run imports no Lightning package: it works with whichever one its strategy class belongs to.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.plan import Plan
from het_strategy.strategy.constructor_args import RECORDING
from het_strategy.strategy.lifecycle import RunLifecycle

__all__ = ["StrategyRun", "LightningStrategy"]


class LightningStrategy(Protocol):
    """What a run uses of the Lightning strategy it drives (public API of Lightning's ``DDPStrategy``)."""

    model: Any
    lightning_module: Any
    root_device: Any
    global_rank: int
    world_size: int
    precision_plugin: Any
    optimizers: list[Any]

    def determine_ddp_device_ids(self) -> list[int] | None: ...

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any: ...


Parent = Callable[..., Any]
"""The Lightning package's own implementation of the hook being run (a bound ``super()`` method)."""


class StrategyRun:
    """A strategy's behaviour behind Lightning's hooks; each default calls ``parent`` as Lightning would.

    Args:
        heartbeat_timeout_s: the lifecycle's heartbeat bound (None: no heartbeat).
        lightning_kwargs: what the strategy class passes to its package's ``DDPStrategy.__init__``; its
            ``timeout`` (each collective's) and ``process_group_backend`` are the lifecycle's too.
    """

    def __init__(self, heartbeat_timeout_s: float | None, lightning_kwargs: dict[str, Any]) -> None:
        self.lifecycle = RunLifecycle(heartbeat_timeout_s, lightning_kwargs.get("timeout"),
                                      lightning_kwargs.get("process_group_backend"))
        """This rank's heartbeat, elastic restart and end of process."""
        self._lightning_kwargs = {**lightning_kwargs, "timeout": self.lifecycle.timeout}

    @property
    def plan(self) -> Plan | None:
        """The plan being run (None until the run has one)."""
        return None

    @property
    def cluster(self) -> ClusterSpec | None:
        """The run's cluster (None until the run has one)."""
        return None

    def lightning_kwargs(self) -> dict[str, Any]:
        """The keyword arguments the strategy class passes to its package's ``DDPStrategy.__init__``."""
        return dict(self._lightning_kwargs)

    # -- environment and setup ------------------------------------------------------------------------
    def setup_distributed(self, strategy: Any, parent: Parent) -> None:
        """Lightning's, after joining this restart's own process group under torchrun's agent store."""
        strategy.set_world_ranks()
        self.lifecycle.join_process_group(strategy.global_rank, strategy.world_size)
        parent()

    def setup_environment(self, strategy: Any, parent: Parent) -> None:
        parent()

    def on_exception(self, strategy: Any, parent: Parent, exception: BaseException) -> None:
        """A collective that failed because a rank is gone ends with the watchdog's one line (``RunLifecycle``)."""
        parent(exception)
        self.lifecycle.failed(exception)

    def teardown(self, strategy: Any, parent: Parent) -> None:
        """Lightning's, after the lifecycle stops (and any constructor recording a failed rebuild left open)."""
        RECORDING.close()
        self.lifecycle.stop()
        parent()

    def setup(self, strategy: Any, parent: Parent, trainer: Any) -> None:
        parent(trainer)

    def configure_ddp(self, strategy: Any, parent: Parent) -> None:
        parent()

    def setup_optimizers(self, strategy: Any, parent: Parent, trainer: Any) -> None:
        parent(trainer)

    def precision_attached(self, plugin: Any) -> None:
        """Lightning attached the Trainer's precision plugin (in ``Trainer(...)``, before any rank starts)."""

    def checkpoint_io_attached(self, io: Any) -> None:
        """Lightning attached a ``CheckpointIO`` (in ``Trainer(...)``)."""

    # -- data and steps -------------------------------------------------------------------------------
    def distributed_sampler_kwargs(self, strategy: Any, parent: dict[str, Any]) -> dict[str, Any]:
        """``parent``: the package's own sampler arguments."""
        return parent

    def process_dataloader(self, strategy: Any, parent: Parent, dataloader: Any) -> Any:
        return parent(dataloader)

    def training_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        return parent(*args, **kwargs)

    def validation_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        return parent(*args, **kwargs)

    def test_step(self, strategy: Any, parent: Parent, *args: Any, **kwargs: Any) -> Any:
        return parent(*args, **kwargs)

    def backward(self, strategy: Any, parent: Parent, closure_loss: Any, optimizer: Any, *args: Any,
                 **kwargs: Any) -> Any:
        return parent(closure_loss, optimizer, *args, **kwargs)

    def optimizer_step(self, strategy: Any, parent: Parent, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        return parent(optimizer, closure, model, **kwargs)

    def reduce(self, strategy: Any, parent: Parent, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return parent(tensor, group=group, reduce_op=reduce_op)

    def on_train_end(self, strategy: Any, parent: Parent) -> None:
        parent()

    def on_validation_start(self, strategy: Any, parent: Parent) -> None:
        parent()

    def on_validation_end(self, strategy: Any, parent: Parent) -> None:
        parent()

    # -- checkpoints ----------------------------------------------------------------------------------
    def lightning_module_state_dict(self, strategy: Any, parent: Parent) -> dict[str, Any]:
        return parent()

    def optimizer_state(self, strategy: Any, parent: Parent, optimizer: Any) -> dict[str, Any]:
        return parent(optimizer)

    def save_checkpoint(self, strategy: Any, parent: Parent, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        parent(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, strategy: Any, parent: Parent, checkpoint_path: Any, *args: Any,
                        **kwargs: Any) -> dict[str, Any]:
        return parent(checkpoint_path, *args, **kwargs)

    def load_model_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any, strict: bool = True) -> None:
        parent(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, strategy: Any, parent: Parent, checkpoint: Any) -> None:
        parent(checkpoint)

    def restore_checkpoint_after_setup(self, parent: bool) -> bool:
        """``parent``: the package's own answer."""
        return parent

    def lightning_restore_optimizer(self, parent: bool) -> bool:
        """``parent``: the package's own answer."""
        return parent
