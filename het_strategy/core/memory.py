"""The memory model: what one device of a pipeline stage holds at its peak, and what the framework takes besides.

One device of a stage holding layers ``[start, stop)`` at tensor-parallel degree
``tp``, micro-batch ``m``, keeping ``in_flight`` micro-batches' activations (1F1B:
the later stages' count plus its own) among ``dp`` replicas, holds:

1. **Model state**: its parameters / tp x ``TrainSettings.state_bytes_per_param(dp)``:
   weights, gradients and Adam's state, each split as ZeRO splits it, plus the
   runtime's two 4-byte buffers per parameter (in fp32 24 B per parameter, Sailor's
   figure for Adam, validated on its runs);
2. **Activations**: per layer and sample the bytes kept for backward, divided by tp
   except what every tp rank keeps whole, times ``m x in_flight``; with activation
   checkpointing, the layer outputs in flight plus one layer's whole activations;
3. **Framework overhead** outside the allocator (``overhead_bytes``): on an
   accelerator 2e9 bytes at tp 1 and 3e9 at tp > 1; none on a CPU device;
4. **Headroom**: ``settings.memory_reserve_gb``, kept free beyond 1-3.  It is 0 by
   default: 1-3 alone is never below Sailor's fit check (which Sailor validated
   against its runs) on any configuration Sailor profiled; raise it for margin
   against the caching allocator's fragmentation in long runs.

``MemoryModel.stage_bytes`` is 1 + 2 + 4 (the details of each there); a stage fits
a device when 1 + 2 + 3 + 4 is at most the device's memory (``MemoryModel.fits``,
the planner's own comparison).  Pure Python and numpy: no torch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from het_strategy.core.catalog import device_catalog
from het_strategy.core.device_spec import DeviceSpec
from het_strategy.core.dtypes import DTYPE_BYTES
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec

__all__ = ["GiB", "OVERHEAD_TP1_BYTES", "OVERHEAD_TP_BYTES", "MemoryModel", "overhead_bytes"]

GiB = 2**30
OVERHEAD_TP1_BYTES = 2.0e9
"""An accelerator's memory outside the allocator at tp 1 (context, communication buffers, workspaces)."""
OVERHEAD_TP_BYTES = 3.0e9
"""The same at tp > 1 (the tensor-parallel group's communicators add theirs)."""


def overhead_bytes(device: DeviceSpec, tp: int) -> float:
    """The framework's memory outside the allocator on ``device`` at tensor-parallel degree ``tp`` (item 3).

    On an accelerator: the CUDA or ROCm context, NCCL's buffers, cuBLAS workspaces, Megatron's memory outside
    PyTorch's allocator as Sailor measured it in nvidia-smi (``OVERHEAD_TP1_BYTES``, ``OVERHEAD_TP_BYTES``).
    None on a CPU device.
    """
    entry = device_catalog().get(device.type)
    if entry is not None and entry.vendor == "cpu":
        return 0.0
    return OVERHEAD_TP1_BYTES if tp == 1 else OVERHEAD_TP_BYTES


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


class MemoryModel:
    """Peak bytes per device of a stage of ``workload`` trained with ``settings`` (items 1, 2 and 4 above; the
    overhead, which depends on the device, is ``overhead_bytes``)."""

    def __init__(self, workload: WorkloadSpec, settings: TrainSettings) -> None:
        self.settings = settings
        layers = workload.layers
        scale = settings.param_bytes / DTYPE_BYTES[workload.dtype]  # activations in the training dtype
        self._params = _prefix([layer.total_params for layer in layers])
        self._tied = workload.tied_prefix
        self._act = _prefix([layer.activation_bytes_per_sample * scale for layer in layers])
        self._whole = _prefix([layer.tp_replicated_activation_bytes * scale for layer in layers])
        self._ckpt = _prefix([layer.output_bytes_per_sample * scale for layer in layers])
        self._max_act = [layer.activation_bytes_per_sample * scale for layer in layers]

    def _activations(self, act: float, whole: float, tp: int) -> float:
        return (act - whole) / tp + whole

    def stage_bytes(self, params: float, start: int, stop: int, tp: int, micro_batch: int, in_flight: int,
                    dp: int) -> float:
        """Model state of ``params`` parameters + activations of layers ``[start, stop)`` + headroom, per device.

        1. Model state: ``params / tp x TrainSettings.state_bytes_per_param(dp)``: weights, gradients and Adam's
           state in the training dtype, each split as ZeRO splits it, plus the runtime's two 4-byte buffers per
           parameter: the fp32 buffer the gradient reduction runs in (DDP's buckets, DeepSpeed's flat reduce
           buffer) and the weight copy DeepSpeed makes when it builds its engine.
        2. Activations: per layer and sample the bytes kept for backward
           (``LayerCost.activation_bytes_per_sample``), divided by tp except
           ``LayerCost.tp_replicated_activation_bytes`` (without sequence parallelism the layer norms' inputs and
           the dropout masks of a block, 10·s·h bytes, stay whole on every tp rank: Korthikanti et al. 2022,
           eq. 2), times ``micro_batch x in_flight``.  A block's figure counts the attention scores only where
           they reach memory (``transformer_workload``: ``attention: materialized``, not ``fused``).  With
           activation checkpointing: the layer outputs of the micro-batches in flight plus one layer's whole
           activations (its recomputation).
        3. Headroom: ``settings.memory_reserve_gb``.
        """
        s = self.settings
        state = params / tp * s.state_bytes_per_param(dp)
        if s.activation_checkpointing:
            acts = (self._ckpt[stop] - self._ckpt[start]) / tp * micro_batch * in_flight
            acts += max(self._max_act[start:stop]) / tp * micro_batch
        else:
            acts = self._activations(self._act[stop] - self._act[start], self._whole[stop] - self._whole[start],
                                     tp) * micro_batch * in_flight
        return state + acts + s.memory_reserve_gb * GiB

    def matrix(self, tp: int, micro_batch: int, in_flight: int, dp: int) -> np.ndarray:
        """``stage_bytes`` of every range ``[i, j)`` at once (every expert held), as an (L+1)^2 array."""
        s = self.settings
        P = np.asarray(self._params)
        held = P[None, :] - P[:, None]
        held[0] -= self._tied  # a stage holding the embedding and a tied head keeps the matrix once
        state = held / tp * s.state_bytes_per_param(dp)
        if s.activation_checkpointing:
            C = np.asarray(self._ckpt)
            acts = (C[None, :] - C[:, None]) / tp * micro_batch * in_flight
            L = len(self._max_act)
            peak = np.zeros((L + 1, L + 1))
            for i in range(L):
                peak[i, i + 1:] = np.maximum.accumulate(np.asarray(self._max_act[i:]))
            acts = acts + peak / tp * micro_batch
        else:
            A, W = np.asarray(self._act), np.asarray(self._whole)
            acts = self._activations(A[None, :] - A[:, None], W[None, :] - W[:, None], tp) * micro_batch * in_flight
        return state + acts + s.memory_reserve_gb * GiB

    @staticmethod
    def fits(need_bytes: float, device: DeviceSpec, tp: int) -> bool:
        """``need_bytes`` (``stage_bytes``) plus the framework's overhead fit ``device``'s memory: the planner's own
        comparison with ``budget_bytes``, so a brute force that calls this agrees with it to the last byte."""
        return need_bytes <= MemoryModel.budget_bytes(device, tp)

    @staticmethod
    def budget_bytes(device: DeviceSpec, tp: int) -> float:
        """What ``stage_bytes`` may reach on ``device`` at ``tp``: its memory less the framework's overhead."""
        return device.memory_bytes - overhead_bytes(device, tp)
