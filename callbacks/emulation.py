"""Emulated devices under a strategy other than ``hetero`` (plain ``ddp``, for comparison).

``EmulatedDeviceCallback(cluster, workload)``: rank r plays the cluster's r-th
device; a batch's samples are its first tensor's length.  As under ``hetero``,
a batch is padded to its emulated time when the last gradient bucket is ready,
through the same comm-hook wrapper (``emulation/padding.py``) around DDP's
allreduce; where the model already has a hook, it pads before backward
instead, estimating the backward still to come.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from het_strategy.callbacks.runtime import runtime_of
from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import field_error
from het_strategy.core.log import logger
from het_strategy.core.workload import load_workload
from het_strategy.emulation.padding import BatchPadding, padded_comm_hook
from het_strategy.emulation.speeds import emulation_summary
from het_strategy.profiling.batch_contents import batch_length

__all__ = ["EmulatedDeviceCallback"]


class EmulatedDeviceCallback(pl.Callback):
    """Pads every batch of this rank to the time the cluster's device of the same rank would take.

    Args:
        cluster: the cluster (shipped name, YAML path, mapping or ``ClusterSpec``); one device per rank.
        workload: the model's costs (shipped model name, YAML path, mapping or ``WorkloadSpec``).
        dtype: the training dtype the devices are priced in.
    """

    def __init__(self, cluster: Any, workload: Any, dtype: str = "fp32") -> None:
        self._cluster = load_cluster(cluster)
        self._workload_source, self._dtype = workload, dtype
        self._padding: BatchPadding | None = None
        self._in_hook = False

    @override
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if runtime_of(trainer.strategy) is not None:
            raise field_error("callbacks", type(self).__name__, "not be used with the hetero strategy",
                              "it emulates the cluster's devices by itself")
        if self._cluster.num_devices != trainer.world_size:
            raise field_error("cluster", self._cluster.name, f"describe {trainer.world_size} devices (the world "
                              f"size); it has {self._cluster.num_devices}")
        workload = load_workload(self._workload_source, self._dtype)
        device = self._cluster.devices[trainer.global_rank].name
        self._padding = BatchPadding.for_device(self._cluster, device, workload, self._dtype)
        if trainer.global_rank == 0:
            logger.info("%s", emulation_summary(self._cluster, workload, self._dtype))

    @override
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel) or self._padding is None:
            return
        try:
            model.register_comm_hook(state=None, hook=padded_comm_hook(allreduce_hook, self._padding.finish))
            self._in_hook = True
        except RuntimeError:  # the model has a hook already: pad before backward
            self._in_hook = False

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        assert self._padding is not None
        self._padding.begin(batch_length(batch), trainer.global_step)

    @override
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if trainer.training and not self._in_hook and self._padding is not None:
            self._padding.finish_before_backward()

    @override
    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        if trainer.training and self._padding is not None:
            self._padding.finish()  # a backward without sync (gradient accumulation) ran no hook

