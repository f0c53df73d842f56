"""het-train's settings as typed dataclasses: the structured schema ``configs/train.yaml`` extends.

``register_train_schema`` stores ``HetTrainConfig`` in Hydra's ConfigStore
(``cli/structured.py``) as ``het_train_schema``, the first entry of train.yaml's defaults list, so Hydra
checks every override and every group file against these types while it
composes (``train.lr=abc`` fails there, naming ``train.lr``).  ``typed_config``
turns the composed config into the dataclasses themselves, which check their
values on construction (``__post_init__``): the rest of het-train reads
``job.config.train.lr``, never ``cfg["train"]["lr"]``.

The sections without one fixed schema stay mappings: ``cluster`` (the cluster
YAML schema, checked by ``core.cluster``), ``compression`` (checked by
``compression.config``), ``strategy`` and ``logger`` (``_target_`` nodes that
``hydra.utils.instantiate`` builds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from het_strategy.cli.structured import store_schema, to_typed
from het_strategy.core.compute_model import AttentionKernel
from het_strategy.core.dtypes import PRECISION_DTYPES
from het_strategy.core.errors import alternatives, field_error, require_int, require_number, require_option
from het_strategy.core.train_settings import TP_DEGREES
from het_strategy.planning.experts import MoEPlacement
from het_strategy.planning.request import PlanRequest

__all__ = [
    "SCHEMA_NAME",
    "Accelerator",
    "WandbMode",
    "ModelConfig",
    "TrainConfig",
    "DataConfig",
    "WandbConfig",
    "OutputConfig",
    "CheckpointConfig",
    "FailureConfig",
    "StragglerConfig",
    "MoEConfig",
    "FSDPStrategyConfig",
    "HetTrainConfig",
    "register_train_schema",
    "typed_config",
]

SCHEMA_NAME = "het_train_schema"
_MAX_SEED = 2**32 - 1  # Lightning's seed_everything range


class Accelerator(StrEnum):
    """Where het-train's processes compute (``accelerator``; Lightning takes the same strings)."""

    cpu = "cpu"
    """CPU processes, gloo collectives."""
    cuda = "cuda"
    """One CUDA device per process, nccl collectives."""


class WandbMode(StrEnum):
    """How ``logger=wandb`` logs (``wandb.mode``; wandb's own mode strings)."""

    offline = "offline"
    """Logged to local files (``wandb sync`` uploads them later)."""
    online = "online"
    """Logged to the W&B server."""
    disabled = "disabled"
    """Nothing logged."""


def _require_seed(value: int, name: str) -> None:
    if not 0 <= value <= _MAX_SEED:
        raise field_error(name, value, f"be in [0, {_MAX_SEED}] (Lightning's seed range)")


@dataclass
class ModelConfig:
    """The ``model`` group: the fields of ``core.workload.TransformerConfig`` the demo GPT builds (GPT blocks; the
    keys of modern blocks, such as ``num_kv_heads`` or ``gated_mlp``, are for planning only), each settable plainly."""

    num_layers: int = MISSING
    """Transformer blocks."""
    hidden_size: int = MISSING
    """Model width h."""
    num_heads: int = MISSING
    """Attention heads (divide hidden_size)."""
    seq_len: int = MISSING
    """Tokens (characters) per sample."""
    vocab_size: int = MISSING
    """Vocabulary size (256: bytes)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; null: 4h."""
    num_experts: int = 0
    """Experts per MoE block; 0: a dense model."""
    top_k: int = 2
    """Experts each token is routed to."""
    moe_every: int = 1
    """Every n-th block is MoE."""
    expert_ffn_hidden_size: Optional[int] = None
    """Width of one expert's MLP; null: the MLP width."""
    attention: AttentionKernel = AttentionKernel.fused
    """How attention runs, for the cost model's roofline (the demo model runs torch's fused attention)."""
    name: Optional[str] = None
    """Model name; null: the group option's name."""
    kind: str = "transformer"
    """Only ``transformer`` trains in het-train."""
    description: Optional[str] = None
    """Free text (ignored)."""

    def transformer_fields(self) -> dict[str, Any]:
        """The fields ``TransformerConfig`` takes (description dropped)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "description"}


@dataclass
class TrainConfig:
    """The ``train`` section: the optimisation loop."""

    global_batch_size: int = 32
    """Samples (sequences) per optimizer step over all ranks."""
    max_steps: int = 100
    """Optimizer steps."""
    lr: float = 3.0e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    precision: str = "32-true"
    """Lightning precision: 32-true | bf16-mixed | 16-mixed (CUDA) | ... (``core.dtypes.PRECISION_DTYPES``), or
    per_device (strategy=hetero or hetero_deepspeed): each rank in its device type's fast 16-bit dtype
    (``PerDevicePrecision``)."""
    accumulate_grad_batches: int = 1
    """Batches accumulated per optimizer step."""
    val_every_n_steps: int = 50
    """Validation period during training."""
    val_batches: int = 4
    """Batches per validation during training."""
    seed: int = 0
    """Seed of weights, shuffling and dropout."""
    max_tp: Optional[int] = None
    """Largest tensor-parallel degree the planner may use (one of ``core.train_settings.TP_DEGREES``; > 1 with
    strategy=hetero_deepspeed only);
    None: the strategy's default (hetero_deepspeed: 8, within a node; hetero: 1)."""

    def __post_init__(self) -> None:
        require_int(self.global_batch_size, "train.global_batch_size", minimum=1)
        if self.max_tp is not None and (isinstance(self.max_tp, bool) or self.max_tp not in TP_DEGREES):
            raise field_error("train.max_tp", self.max_tp, f"be {alternatives([*TP_DEGREES, 'null'])}")
        for name in ("max_steps", "accumulate_grad_batches", "val_every_n_steps", "val_batches"):
            require_int(getattr(self, name), f"train.{name}", minimum=1)
        require_number(self.lr, "train.lr")
        require_number(self.weight_decay, "train.weight_decay", allow_zero=True)
        if self.precision not in PRECISION_DTYPES:
            raise field_error("train.precision", self.precision, f"be one of {', '.join(PRECISION_DTYPES)} "
                              "(Lightning's precision strings)")
        _require_seed(self.seed, "train.seed")


@dataclass
class DataConfig:
    """The ``data`` section: which standard-library source is read."""

    max_bytes: int = 2_000_000
    """Bytes of standard-library source used (train + validation)."""
    val_fraction: float = 0.1
    """Share of source files held out for validation."""
    seed: int = 0
    """Which files are held out (apart from train.seed)."""

    def __post_init__(self) -> None:
        require_int(self.max_bytes, "data.max_bytes", minimum=1)
        if not (math.isfinite(self.val_fraction) and 0 < self.val_fraction < 1):
            raise field_error("data.val_fraction", self.val_fraction, "be in (0, 1) (a share of the files)")
        _require_seed(self.seed, "data.seed")


@dataclass
class WandbConfig:
    """The ``wandb`` section, read by ``logger=wandb``."""

    project: str = "het_strategy"
    """W&B project."""
    mode: WandbMode = WandbMode.offline
    """offline | online | disabled."""

    def __post_init__(self) -> None:
        self.mode = require_option(WandbMode, self.mode, "wandb.mode")


@dataclass
class OutputConfig:
    """The ``output`` section: where a run writes."""

    dir: str = "het_train_runs"
    """Run folder (relative to where het-train started; ``.``: that directory)."""
    summary: Optional[str] = "summary.json"
    """Summary file inside ``dir``; null: not written."""


@dataclass
class CheckpointConfig:
    """The ``checkpoint`` section."""

    every_n_steps: Optional[int] = None
    """Save a checkpoint every n steps into output.dir/checkpoints; null: none."""
    async_save: bool = False
    """Write checkpoints in a background thread (Lightning's ``AsyncCheckpointIO``): training waits only for the
    tensors' copy (benchmarks/checkpoint_stall.py measures the stall)."""
    on_sigterm: bool = True
    """SIGTERM (a preemption notice) saves output.dir/checkpoints/preempted.ckpt at the next step and exits 0."""
    sigterm_grace_s: float = 30.0
    """Seconds the platform leaves after SIGTERM; a save that takes longer is reported."""

    def __post_init__(self) -> None:
        if self.every_n_steps is not None:
            require_int(self.every_n_steps, "checkpoint.every_n_steps", minimum=1)
        require_number(self.sigterm_grace_s, "checkpoint.sigterm_grace_s")


@dataclass
class FailureConfig:
    """The ``failure`` section: how soon a lost or frozen rank ends the run (``strategy/liveness.py``)."""

    heartbeat_timeout_s: Optional[float] = 30.0
    """A rank without a heartbeat for this long is gone: the others end, naming it; null: off."""
    collective_timeout_s: float = 300.0
    """Each collective's timeout: the bound on a rank that is alive but never reaches it."""

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s is not None:
            require_number(self.heartbeat_timeout_s, "failure.heartbeat_timeout_s")
        require_number(self.collective_timeout_s, "failure.collective_timeout_s")

    def strategy_args(self) -> dict[str, Any]:
        """The strategy's keyword arguments: Lightning's ``timeout``, and the heartbeat's bound."""
        from datetime import timedelta

        return {"timeout": timedelta(seconds=self.collective_timeout_s),
                "heartbeat_timeout_s": self.heartbeat_timeout_s}


@dataclass
class ElasticConfig:
    """The ``elastic`` section: run under torchrun's elastic agent (``strategy/elastic.py``)."""

    enabled: bool = False
    """One process per agent (``torchrun --nproc-per-node=1``), each naming its device in HET_STRATEGY_DEVICE; every
    (re)start plans for the devices present and goes on from the newest checkpoint in output.dir/checkpoints."""
    min_devices: Optional[int] = None
    """The fewest devices a (re)start may run on (torchrun's ``--nnodes=MIN:MAX`` MIN); null: 1."""

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise field_error("elastic.enabled", self.enabled, "be true or false")
        if self.min_devices is not None:
            require_int(self.min_devices, "elastic.min_devices", minimum=1)


@dataclass
class StragglerConfig:
    """The ``straggler`` section: online mitigation (hetero only); the callback checks the values."""

    enabled: bool = False
    """Turn telemetry, detection and live rebalancing on."""
    every_n_steps: int = 2
    """Telemetry exchange period."""
    threshold: float = 0.25
    """Relative shift of a rank's per-sample time that counts."""
    consecutive: int = 4
    """... when this many consecutive exchanges show it."""
    warmup: int = 8
    """Steps before the first detection."""
    min_share: float = 0.0
    """Least fraction of the global batch a rank keeps (<= 1/devices)."""
    evict_ratio: Optional[float] = None
    """A rank slower than this x the median keeps only min_share; null: off."""
    stop_ratio: Optional[float] = None
    """A rank slower than this x the median: checkpoint and stop; null: off."""

    def mitigation_args(self) -> dict[str, Any]:
        """The keyword arguments of ``StragglerMitigation``."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "enabled"}


@dataclass
class MoEConfig:
    """The ``moe`` section: where experts live and how tokens route (models with experts)."""

    placement: MoEPlacement = MoEPlacement.planned
    """planned (by device speed and memory) | uniform (the same count per rank)."""
    capacity_factor: float = 1.25
    """Tokens one expert takes per rank: k x tokens / experts x this."""
    drop_tokens: bool = True
    """Drop the choices beyond capacity."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss."""

    def __post_init__(self) -> None:
        self.placement = require_option(MoEPlacement, self.placement, "moe.placement")
        require_number(self.capacity_factor, "moe.capacity_factor")
        require_number(self.aux_loss_coef, "moe.aux_loss_coef", allow_zero=True)

    def routing(self) -> dict[str, Any]:
        """The MoE layer's routing arguments."""
        return {"capacity_factor": self.capacity_factor, "drop_tokens": self.drop_tokens,
                "aux_loss_coef": self.aux_loss_coef}


@dataclass(frozen=True)
class FSDPStrategyConfig:
    """``strategy=hetero_fsdp``'s own keys (``HeteroFSDPStrategy``'s arguments of the same names), checked here and
    named ``strategy.<field>``; what het-train passes besides (cluster, workload, batch) it takes from the other
    sections."""

    units: Optional[tuple[str, ...]] = None
    """The blocks sharded one at a time, by dotted name in the char GPT (``blocks.0``); None: its ``blocks``."""
    prefetch: bool = True
    """Start the next unit's all-gather while the current one computes."""
    activation_checkpointing: bool = False
    """Recompute each unit's forward in its backward."""

    def __post_init__(self) -> None:
        units = self.units
        if units is not None:
            if isinstance(units, str) or not isinstance(units, (list, tuple)) or not units:
                raise field_error("strategy.units", units, "be a non-empty list of the model's block names (dotted "
                                  "paths, e.g. [blocks.0, blocks.1]) or null (the char GPT's blocks)")
            for i, name in enumerate(units):
                if not isinstance(name, str) or not name:
                    raise field_error(f"strategy.units[{i}]", name, "be a block's dotted name (e.g. blocks.0)")
            object.__setattr__(self, "units", tuple(units))
        for name in ("prefetch", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise field_error(f"strategy.{name}", getattr(self, name), "be true or false")

    def strategy_args(self) -> dict[str, Any]:
        """``HeteroFSDPStrategy``'s keyword arguments of these options."""
        return {"units": None if self.units is None else list(self.units), "prefetch": self.prefetch,
                "activation_checkpointing": self.activation_checkpointing}


@dataclass
class HetTrainConfig:
    """The whole het-train config (``configs/train.yaml`` and its groups)."""

    cluster: Any = MISSING
    """The cluster group (cluster YAML schema)."""
    model: ModelConfig = MISSING
    """The model group."""
    strategy: Any = MISSING
    """The strategy group: a ``_target_`` node (hetero | ddp | hetero_deepspeed | hetero_diloco | hetero_fsdp)."""
    logger: Any = MISSING
    """The logger group: logger name -> ``_target_`` node (wandb | csv | none)."""
    compression: Any = MISSING
    """The compression group (CompressionConfig fields)."""
    accelerator: Accelerator = Accelerator.cpu
    """cpu (gloo) | cuda (nccl)."""
    devices: Optional[int] = None
    """Processes on this node; null: the cluster's device count."""
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure: FailureConfig = field(default_factory=FailureConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    resume: Optional[str] = None
    """A checkpoint to resume from."""
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    planner: PlanRequest = field(default_factory=PlanRequest)
    """The planning request (het-plan's ``planner`` section); het-train reads ``mode``, the rest stays default."""

    def __post_init__(self) -> None:
        self.accelerator = require_option(Accelerator, self.accelerator, "accelerator")
        if self.devices is not None:
            require_int(self.devices, "devices", minimum=1)


def register_train_schema() -> None:
    """Store ``HetTrainConfig`` as ``het_train_schema`` (idempotent: the store replaces its entry)."""
    store_schema(SCHEMA_NAME, HetTrainConfig)


def typed_config(cfg: DictConfig) -> HetTrainConfig:
    """The composed config as ``HetTrainConfig``; keys the schema lacks and bad values raise ConfigError."""
    return to_typed(cfg, HetTrainConfig)
