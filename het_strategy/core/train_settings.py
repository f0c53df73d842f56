"""How the model is trained: batch, precision, ZeRO stage and the planner's search bounds.

``TrainSettings`` is the ``settings`` section of het-plan (``configs/plan.yaml``).  It also owns the one
rule of ZeRO sharding (``zero_shards``): which training state is split over
the data-parallel replicas at each stage, and so what one replica holds
(``state_bytes_per_param``).  The cost model, the expert placement and the
DeepSpeed config all ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from het_strategy.core.compressed_sync import check_token
from het_strategy.core.dtypes import DTYPE_BYTES, Dtype, as_dtype
from het_strategy.core.errors import field_error, require_int, require_number

__all__ = ["ZeroShards", "TrainSettings"]


class ZeroShards(NamedTuple):
    """Over how many data-parallel replicas each kind of training state is split (1: every replica holds all)."""

    weights: int
    """ZeRO-3 shards the weights."""
    gradients: int
    """ZeRO-2 and -3 shard the gradients."""
    optimizer: int
    """ZeRO-1, -2 and -3 shard the optimizer state (and so the optimizer update's work)."""


@dataclass(frozen=True)
class TrainSettings:
    """How the model is trained: batch, precision, memory-saving options, search bounds."""

    global_batch_size: int
    """Samples per optimizer step."""
    dtype: Dtype = Dtype.bf16
    """Training dtype: bf16, fp16 (mixed precision) or fp32 (a name is converted to the member)."""
    zero_stage: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (keeps only layer inputs)."""
    max_tp: int = 8
    """Largest tensor-parallel degree the planner may use (within a node: never above its device count); the
    runtime filter (``planner.runtime``) keeps what a runtime runs (``hetero``: tp 1; ``deepspeed``: tp stages at
    ZeRO 0)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes the planner tries."""
    memory_reserve_gb: float = 1.0
    """GiB per device kept for the framework, CUDA context and fragmentation."""
    max_stages: int = 16
    """Most pipeline stages the planner considers."""
    equal_shares: bool = False
    """Give every pipeline the same share of the batch (for runtimes that cannot run uneven batches,
    e.g. Sailor's or Megatron's); the default lets the planner split it unevenly by speed."""
    grad_dtype: Dtype | None = None
    """Dtype gradients are reduced in.  None: fp32 — mixed precision (torch autocast, Lightning's
    ``*-mixed``, DeepSpeed's bf16 optimizer) keeps fp32 gradients and reduces them so.  Set fp16/bf16
    where the runtime reduces in half precision (DeepSpeed fp16 or its ``communication_data_type``,
    parameters held in bf16)."""

    idle_devices: bool = True
    """dp plans may leave a device out when the step is faster without it.  False for a runtime whose every
    launched rank takes part in every step (the ``hetero`` strategy: a rank with no share still runs a
    weight-0 filler sample and the gradient sync, so idling it saves nothing): every device gets a share."""
    inter_node_compression: str = "none"
    """The method token the gradient sync between nodes runs in: ``none``, or a compressed hierarchical exchange
    (node sums uncompressed, the node leaders' exchange in ``fp16``/``bf16``/``q2``...``q8``;
    ``core/compressed_sync.py`` prices it).  The joint planner chooses it; plans carry it in ``compression``."""

    def __post_init__(self) -> None:
        require_int(self.global_batch_size, "settings.global_batch_size", minimum=1)
        check_token(self.inter_node_compression, "settings.inter_node_compression")
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "settings.dtype"))
        if self.zero_stage not in (0, 1, 2, 3):
            raise field_error("settings.zero_stage", self.zero_stage, "be 0, 1, 2 or 3")
        if self.max_tp not in (1, 2, 4, 8):
            raise field_error("settings.max_tp", self.max_tp, "be 1, 2, 4 or 8")
        sizes = tuple(self.micro_batch_sizes)
        if not sizes:
            raise field_error("settings.micro_batch_sizes", list(sizes), "list at least one size")
        for i, m in enumerate(sizes):
            require_int(m, f"settings.micro_batch_sizes[{i}]", minimum=1)
        object.__setattr__(self, "micro_batch_sizes", tuple(sorted(set(sizes))))
        require_number(self.memory_reserve_gb, "settings.memory_reserve_gb", allow_zero=True)
        require_int(self.max_stages, "settings.max_stages", minimum=1)
        if not isinstance(self.equal_shares, bool):
            raise field_error("settings.equal_shares", self.equal_shares, "be true or false")
        if not isinstance(self.idle_devices, bool):
            raise field_error("settings.idle_devices", self.idle_devices, "be true or false")
        if self.grad_dtype is not None:
            if self.grad_dtype not in tuple(Dtype):
                raise field_error("settings.grad_dtype", self.grad_dtype, f"be one of {', '.join(Dtype)} or null")
            object.__setattr__(self, "grad_dtype", Dtype(self.grad_dtype))

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def grad_reduce_dtype(self) -> Dtype:
        """The dtype gradients cross the network in (``grad_dtype``, else fp32)."""
        return self.grad_dtype or Dtype.fp32

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element on the wire."""
        return DTYPE_BYTES[self.grad_reduce_dtype]

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Adam: m and v in fp32, plus an fp32 master copy under mixed precision."""
        return 8 if self.dtype == Dtype.fp32 else 12

    def zero_shards(self, dp: int) -> ZeroShards:
        """How ``zero_stage`` splits weights, gradients and optimizer state over ``dp`` data-parallel replicas."""
        z = self.zero_stage
        return ZeroShards(weights=dp if z >= 3 else 1, gradients=dp if z >= 2 else 1, optimizer=dp if z >= 1 else 1)

    def state_bytes_per_param(self, dp: int) -> float:
        """Bytes of weights + gradients + optimizer state one of ``dp`` replicas holds per parameter."""
        shards = self.zero_shards(dp)
        return (self.param_bytes / shards.weights + self.param_bytes / shards.gradients
                + self.optimizer_bytes_per_param / shards.optimizer)
