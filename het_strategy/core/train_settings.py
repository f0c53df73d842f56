"""How the model is trained: batch, precision, ZeRO stage and the planner's search bounds.

``TrainSettings`` is the ``settings`` section of het-plan (``configs/plan.yaml``).  It also owns the one
rule of ZeRO sharding (``zero_shards``): which training state is split over
the data-parallel replicas at each stage, and so what one replica holds
(``state_bytes_per_param``).  The cost model, the expert placement and the
DeepSpeed config all ask it.  ``TP_DEGREES`` and ``ZERO_STAGES`` are the values
``max_tp`` and ``zero_stage`` may take (a plan's ``zero_stage`` too); every check
and message elsewhere reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple

from het_strategy.core.catalog import device_catalog, lookup_device_type
from het_strategy.core.compressed_sync import check_token
from het_strategy.core.compute_model import ComputeModel
from het_strategy.core.dtypes import (DTYPE_BYTES, ELEMENT_DTYPES, Dtype, Float32MatmulPrecision, as_dtype,
                                     as_element_dtype)
from het_strategy.core.errors import (ConfigError, alternatives, field_error, require_int, require_number,
                                     require_option)

if TYPE_CHECKING:
    from het_strategy.core.device_spec import DeviceSpec

__all__ = ["TP_DEGREES", "ZERO_STAGES", "ZeroShards", "TrainSettings", "REDUCE_BUFFER_BYTES", "ENGINE_COPY_BYTES",
           "SyncModel"]

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
"""The tensor-parallel degrees the planners try, and ``max_tp``'s choices (powers of two, so every degree divides
the largest: the deepspeed runtime reduces a gradient in units of the finest shard, ``core.runtime_rules``)."""
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
"""ZeRO stages: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded over the replicas
(``zero_shards``)."""

REDUCE_BUFFER_BYTES = 4
"""Bytes per parameter of the fp32 buffer the gradient reduction runs in (DDP's buckets, DeepSpeed's)."""
ENGINE_COPY_BYTES = 4
"""Bytes per parameter of the copy of the weights DeepSpeed makes when it builds its engine (Sailor's count)."""


class SyncModel(StrEnum):
    """How the cost model prices the gradient sync of a plan whose replicas differ (``settings.sync_model``)."""

    holder_sets = "holder_sets"
    """As the runtime runs it: each part's holder set, in the shared order, over the links it crosses
    (``core/holder_sync.py``).  Replicas alike are priced by their stages' rings either way."""
    stage_rings = "stage_rings"
    """Every stage as one ring among the replicas of its relative position (``network.routes``): a price each
    pipeline's stages set alone, which a brute force can decompose (``benchmarks/plan_optimality.py``)."""


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
    """Training dtype: bf16, fp16 (mixed precision), fp32, or per_device: each device type in its own fast
    16-bit dtype (``device_dtypes`` overrides the choice per type); a name is converted to the member."""
    zero_stage: int = 0
    """ZeRO stage: 0 none, 1 optimizer state, 2 + gradients, 3 + parameters sharded."""
    activation_checkpointing: bool = False
    """Recompute activations in backward (keeps only layer inputs)."""
    max_tp: int = 8
    """Largest tensor-parallel degree the planner may use (within a node: never above its device count); the
    runtime filter (``planner.runtime``) keeps what a runtime runs (``hetero``: tp 1; ``deepspeed``: tp stages at
    ZeRO 0)."""
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Micro-batch sizes the planner tries (a search list of its own, not ``TP_DEGREES``)."""
    memory_reserve_gb: float = 0.0
    """Headroom: GiB per device kept free beyond the memory model (``core/memory.py``), which counts the framework's
    overhead outside the allocator and is never below Sailor's validated fit check on the configurations Sailor
    profiled; 0 by default, raise it for margin (fragmentation in long runs)."""
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
    device_dtypes: dict[str, Dtype] = field(default_factory=dict)
    """With ``dtype=per_device``: the dtype a device type computes in, where it is not the type's own fast
    16-bit dtype (``{"T4": "fp32"}``); keys are catalog types (aliases become the catalog name)."""
    compute_model: ComputeModel = ComputeModel.flops
    """How a layer without a measured profile is priced: ``flops`` (FLOPs at the datasheet rate x the device's
    efficiency) or ``roofline`` (``core/compute_model.py``: matmuls and memory passes from the datasheet,
    calibrated on measured GPUs; far closer to measured fp32 layers, its 16-bit tensor-core rate not yet
    calibrated; planning by cost is slower with it)."""
    float32_matmul_precision: Float32MatmulPrecision = Float32MatmulPrecision.highest
    """torch's ``set_float32_matmul_precision`` in the training run: ``highest`` (torch's default) prices fp32
    matmuls at the fp32 rate, ``high`` or ``medium`` at the TF32 tensor-core rate where the device has one."""
    sync_model: SyncModel = SyncModel.holder_sets
    """How the gradient sync of replicas that differ (boundaries, tp) is priced: ``holder_sets``, as the runtime
    runs it, or ``stage_rings`` (``SyncModel``)."""
    inter_node_compression: str = "none"
    """The method token the gradient sync between nodes runs in: ``none``, or a compressed hierarchical exchange
    (node sums uncompressed, the node leaders' exchange in ``fp16``/``bf16``/``q2``...``q8``;
    ``core/compressed_sync.py`` prices it).  The joint planner chooses it; plans carry it in ``compression``."""

    def __post_init__(self) -> None:
        require_int(self.global_batch_size, "settings.global_batch_size", minimum=1)
        check_token(self.inter_node_compression, "settings.inter_node_compression")
        object.__setattr__(self, "dtype", as_dtype(self.dtype, "settings.dtype"))
        object.__setattr__(self, "compute_model", require_option(ComputeModel, self.compute_model,
                                                                 "settings.compute_model"))
        object.__setattr__(self, "sync_model", require_option(SyncModel, self.sync_model, "settings.sync_model"))
        object.__setattr__(self, "float32_matmul_precision", require_option(
            Float32MatmulPrecision, self.float32_matmul_precision, "settings.float32_matmul_precision"))
        if self.zero_stage not in ZERO_STAGES:
            raise field_error("settings.zero_stage", self.zero_stage, f"be {alternatives(ZERO_STAGES)}")
        if self.max_tp not in TP_DEGREES:
            raise field_error("settings.max_tp", self.max_tp, f"be {alternatives(TP_DEGREES)}")
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
            if self.grad_dtype not in ELEMENT_DTYPES:
                raise field_error("settings.grad_dtype", self.grad_dtype,
                                  f"be one of {', '.join(ELEMENT_DTYPES)} or null")
            object.__setattr__(self, "grad_dtype", Dtype(self.grad_dtype))
        object.__setattr__(self, "device_dtypes", _device_dtypes(self.device_dtypes, self.dtype))

    def compute_dtype(self, device: DeviceSpec) -> Dtype:
        """The dtype ``device`` computes in: its ``device_dtypes`` entry, else ``device.compute_dtype(dtype)``
        (``per_device``: the device's fast 16-bit dtype; any other dtype: that dtype)."""
        return self.device_dtypes.get(device.type) or device.compute_dtype(self.dtype)

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
        """Adam: m and v in fp32, plus an fp32 master copy under mixed precision, and in fp32 under ZeRO: the
        sharded optimizer steps on an fp32 copy of its slice (DeepSpeed's ``single_partition_of_fp32_groups``,
        ``ds_runtime.holder_sharding``'s chunks)."""
        return 8 if self.dtype == Dtype.fp32 and self.zero_stage == 0 else 12

    def zero_shards(self, dp: int) -> ZeroShards:
        """How ``zero_stage`` splits weights, gradients and optimizer state over ``dp`` data-parallel replicas."""
        z = self.zero_stage
        return ZeroShards(weights=dp if z >= 3 else 1, gradients=dp if z >= 2 else 1, optimizer=dp if z >= 1 else 1)

    def state_bytes_per_param(self, dp: int) -> float:
        """Bytes of weights + gradients + optimizer state one of ``dp`` replicas holds per parameter, with the
        runtime's buffers: the fp32 buffer the gradient reduction runs in (split as the gradients are) and the
        weight copy DeepSpeed makes when it builds its engine (split as the weights are): ``core/memory.py``."""
        shards = self.zero_shards(dp)
        return (self.param_bytes / shards.weights + self.param_bytes / shards.gradients
                + self.optimizer_bytes_per_param / shards.optimizer
                + REDUCE_BUFFER_BYTES / shards.gradients + ENGINE_COPY_BYTES / shards.weights)


def _device_dtypes(raw: Any, dtype: Dtype) -> dict[str, Dtype]:
    """``settings.device_dtypes`` checked: a mapping catalog type -> a dtype that type has a rate for, given only
    with ``dtype=per_device``; the keys become the catalog names."""
    if not isinstance(raw, Mapping):
        raise field_error("settings.device_dtypes", raw, "be a mapping device type -> dtype")
    if raw and dtype != Dtype.per_device:
        raise field_error("settings.device_dtypes", dict(raw), "be empty unless settings.dtype is per_device",
                          "set settings.dtype=per_device, or drop settings.device_dtypes")
    out: dict[str, Dtype] = {}
    for key, value in raw.items():
        where = f"settings.device_dtypes.{key}"
        try:
            entry = lookup_device_type(str(key), where)
        except ConfigError:
            raise field_error("settings.device_dtypes", str(key), f"name device types of the catalog "
                              f"({', '.join(device_catalog())})") from None
        chosen = as_element_dtype(value, where)
        if chosen not in entry.tflops:
            raise field_error(where, str(value), f"be a dtype {entry.name} has a rate for "
                              f"({', '.join(entry.tflops)}); the catalog gives it no {chosen} figure")
        out[entry.name] = chosen
    return out
