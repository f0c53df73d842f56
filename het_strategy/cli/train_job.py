"""``TrainJob``: a het-train config checked in the launching process, before any worker starts.

1. The composed config becomes ``HetTrainConfig`` (``train_config.typed_config``):
   types, ranges and unknown keys, each named by its full dotted field.
2. What needs more than one section or the machine is checked here: devices
   against the cluster, the batch against the devices, the strategy and logger
   ``_target_`` nodes, CUDA being there for ``accelerator=cuda``, the output
   folder, the resume checkpoint, the straggler callback's settings, MoE and
   DeepSpeed limits.  ``compression=planned`` plans here (placement and the
   inter-node compression together), so a plan that cannot run is refused too.
3. Every failure is a ``ConfigError`` (``het-train: error: ...``, exit 2): the
   Lightning launcher re-runs the command for ranks 1..n-1, so anything left to
   the run would fail once per rank, after the processes started.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from het_strategy.cli._common import cfg_to_dict, cluster_from_cfg
from het_strategy.cli.resume_check import check_checkpoint, check_checkpoint_model, check_pipeline_checkpoint
from het_strategy.cli.train_config import Accelerator, FSDPStrategyConfig, HetTrainConfig, WandbMode, typed_config
from het_strategy.core.errors import ConfigError, field_error, require_option
from het_strategy.core.plan import Plan
from het_strategy.planning.experts import MoEPlacement

if TYPE_CHECKING:
    from het_strategy.compression import CompressionConfig
    from het_strategy.planning.request import PlanRequest

__all__ = ["PLANNED", "STRATEGY_TARGETS", "TrainJob"]

PLANNED = "planned"
"""``compression.method`` of ``compression=planned``: the joint plan's inter-node choice (``_plan_compression``)."""

STRATEGY_TARGETS = {
    "het_strategy.HeteroStrategy": "hetero",
    "lightning.pytorch.strategies.DDPStrategy": "ddp",
    "het_strategy.HeteroDeepSpeedStrategy": "hetero_deepspeed",
    "het_strategy.HeteroDiLoCoStrategy": "hetero_diloco",
    "het_strategy.HeteroFSDPStrategy": "hetero_fsdp",
}
"""The strategy group's ``_target_`` -> het-train's name for it."""
_WANDB_TARGET = "lightning.pytorch.loggers.WandbLogger"


class TrainJob:
    """A checked ``het-train`` config: everything needed to build the run, no process group yet."""

    def __init__(self, cfg: DictConfig, auto_cluster: bool = False) -> None:
        from het_strategy.core.dtypes import precision_dtype
        from het_strategy.core.workload import transformer_config, transformer_workload

        self.cfg = cfg
        self.config: HetTrainConfig = typed_config(cfg)
        c = self.config
        self.train, self.data, self.wandb, self.output = c.train, c.data, c.wandb, c.output
        self.checkpoint, self.straggler, self.moe, self.planner = c.checkpoint, c.straggler, c.moe, c.planner
        self.failure, self.elastic = c.failure, c.elastic
        self.strategy = _strategy_name(cfg.strategy)
        self.diloco = _diloco_options(cfg.strategy) if self.strategy == "hetero_diloco" else None
        """``strategy=hetero_diloco``: its outer-loop options, checked (named ``strategy.<field>``)."""
        self.fsdp = _fsdp_options(cfg.strategy) if self.strategy == "hetero_fsdp" else None
        """``strategy=hetero_fsdp``: its sharding options, checked (named ``strategy.<field>``)."""
        self.loggers = _logger_nodes(cfg.logger)
        self.accelerator = c.accelerator
        self.auto_cluster = auto_cluster
        self.cluster = None if auto_cluster else cluster_from_cfg(cfg)
        self.num_nodes = 1
        """Lightning's ``num_nodes``: the world under torchrun's elastic agent (one process per agent), else 1."""
        if c.elastic.enabled:
            self.devices, self.num_nodes = self._check_elastic(c)
        else:
            self.devices = self._check_devices(c.devices)
        if self.accelerator == Accelerator.cuda:
            _check_cuda(self.devices)
        self.dtype = precision_dtype(c.train.precision)
        fields_ = c.model.transformer_fields()
        fields_["name"] = fields_["name"] or "model"
        self.model_cfg = transformer_config(fields_)
        self.workload = transformer_workload(self.model_cfg, self.dtype)
        self.global_batch_size = self._checked_global_batch(c.train.global_batch_size)
        _check_output(c.output.dir, c.output.summary)
        self._check_straggler()
        raw_compression = cfg_to_dict(cfg.compression, "compression")
        self.plan: Plan | None = None
        """``compression=planned``: the joint plan handed to the strategy; else None (the strategy plans)."""
        self.planned_note: str | None = None
        """``compression=planned``: the one line the run logs about the planned inter-node method."""
        planned = raw_compression.get("method") == PLANNED
        if planned:
            self._check_planned(raw_compression)
        self.compression = None if planned else self._checked_compression(raw_compression)
        if self.strategy == "hetero_diloco":
            self._check_diloco_job(c)
        self._check_strategy_options(c)
        if self.strategy == "hetero_fsdp":
            self._check_fsdp_job(c)
        _check_planner(c.planner)
        self.resume = c.resume
        state = None
        if self.strategy == "hetero_deepspeed":
            self._check_deepspeed_job()
        elif self.resume is not None and self.strategy != "hetero_fsdp":  # hetero_fsdp's: _check_fsdp_job
            state = check_checkpoint(self.resume)
        self._check_model()
        if state is not None:
            check_checkpoint_model(self.resume, state, self.model_cfg)
        if planned:
            self._plan_jointly()  # last: every other field is checked, and named, before the search

    def _checked_global_batch(self, gb: int) -> int:
        """``train.global_batch_size``: a sample for every rank, and divisible by the devices for plain ddp."""
        world = self.devices * self.num_nodes
        if gb < world:
            raise field_error("train.global_batch_size", gb, f"be an integer >= the ranks ({world}): every rank "
                              "needs a sample")
        if self.strategy == "ddp" and gb % self.devices:
            raise field_error("train.global_batch_size", gb, f"be divisible by devices ({self.devices}) for plain "
                              "ddp, which splits the batch evenly")
        return gb

    def _checked_compression(self, raw: dict[str, Any]) -> CompressionConfig:
        """The compression group as a config; a method other than none only with ``strategy=hetero``."""
        from het_strategy.compression import compression_config

        config = compression_config(raw)
        if config.method != "none" and self.strategy != "hetero":
            why = _NO_COMPRESSION.get(self.strategy, "DeepSpeed reduces the gradients itself")
            raise field_error("compression.method", config.method, f"be none with strategy={self.strategy} ({why})",
                              "use strategy=hetero, which registers them on every device")
        return config

    def _check_strategy_options(self, c: HetTrainConfig) -> None:
        """The planner mode, ``train.max_tp`` and ``per_device`` precision each go with the strategies that run them."""
        mode = c.planner.mode
        if mode == "fsdp" and self.strategy != "hetero_fsdp":
            raise field_error("planner.mode", mode, f"go with strategy=hetero_fsdp, not {self.strategy} (only "
                              "hetero_fsdp runs fully sharded plans)", "use strategy=hetero_fsdp")
        if self.strategy == "hetero_fsdp" and mode not in ("auto", "fsdp"):
            raise field_error("planner.mode", mode, "be auto or fsdp with strategy=hetero_fsdp (it plans fully "
                              "sharded data parallelism: auto is read as fsdp)",
                              "use strategy=hetero_deepspeed for pipeline or hybrid plans, strategy=hetero for dp")
        if self.strategy == "hetero_deepspeed" and mode == "low_communication":
            raise field_error("planner.mode", mode, "be auto, dp, pipeline or hybrid with strategy=hetero_deepspeed",
                              "use strategy=hetero_diloco for low-communication training")
        if self.strategy == "hetero" and mode not in ("auto", "dp"):
            raise field_error("planner.mode", mode, "be auto or dp with strategy=hetero (it plans data "
                              "parallelism)", "use strategy=hetero_deepspeed for pipeline or hybrid plans")
        if self.strategy != "hetero_deepspeed" and c.train.max_tp not in (None, 1):
            raise field_error("train.max_tp", c.train.max_tp, f"be 1 with strategy={self.strategy} (it runs data "
                              "parallelism)", "use strategy=hetero_deepspeed for tensor-parallel stages")
        if self.dtype == "per_device" and self.strategy not in ("hetero", "hetero_deepspeed"):
            raise field_error("train.precision", "per_device", f"go with strategy=hetero or hetero_deepspeed, not "
                              f"{self.strategy} (each rank takes its dtype from the plan)",
                              "use strategy=hetero or hetero_deepspeed, or bf16-mixed")

    def _check_planned(self, raw: dict[str, Any]) -> None:
        """What ``compression=planned`` goes with (the group file holds only its method and description)."""
        for key in raw:
            if key not in ("method", "description"):
                raise field_error(f"compression.{key}", raw[key], "not be there with compression=planned (the "
                                  "joint plan chooses the inter-node method)", "drop it, or pick another "
                                  "compression group option")
        if self.strategy != "hetero":
            why = ("plain DDP splits the batch evenly and runs no plan" if self.strategy == "ddp" else
                   _NO_COMPRESSION.get(self.strategy, "DeepSpeed reduces the gradients itself"))
            raise field_error("compression", PLANNED, f"go with strategy=hetero, not strategy={self.strategy} "
                              f"({why})", "use strategy=hetero")
        if self.cluster is None:
            raise field_error("compression", PLANNED, "go with a cluster file, not cluster=auto (the plan is made "
                              "from the cluster's figures before the workers start)",
                              "name a cluster, or use compression=hierarchical, which measures the link")

    def _plan_jointly(self) -> None:
        """``compression=planned``: placement and the inter-node compression planned together here, before any
        worker starts (``planning.plan`` with ``PlanRequest(compression="joint")``, as ``het-plan
        planner.compression=joint``), the plan handed to the
        hetero strategy with ``compression="planned"``, which runs the choice as the hierarchical exchange.

        Every rank re-runs this command (Lightning's launcher) and plans the same: the search is deterministic
        over the same cluster, model and batch, and rank 0 checks the given plan again at setup and broadcasts it.
        """
        from het_strategy.compression import compression_config
        from het_strategy.planning import PlanRequest, plan as make_plan
        from het_strategy.planning.strategy_plans import data_parallel_plan, data_parallel_settings
        from het_strategy.strategy.arguments import planned_compression
        from het_strategy.strategy.compression_run import ranks_per_node

        cluster = self.cluster
        assert cluster is not None  # _check_planned refused cluster=auto
        gb = self.config.train.global_batch_size  # planned as the strategy's own data-parallel plan is
        joint = make_plan(cluster, self.workload, data_parallel_settings(gb, self.dtype),
                          PlanRequest(compression="joint"))
        plan = data_parallel_plan(cluster, self.workload, gb, self.dtype, joint.plan)  # what setup checks
        token = plan.compression.get("inter_node", "none")
        if token != "none":
            try:
                ranks_per_node(cluster, self.devices)  # the hierarchical exchange's node groups
            except ConfigError:
                sizes = [len(node.devices) for node in cluster.nodes]
                raise field_error("compression", PLANNED, f"go with nodes of equal size for the planned {token} "
                                  f"exchange between nodes (cluster `{cluster.name}` has {sizes} devices per node; "
                                  "the hierarchical exchange sums each node first)",
                                  "use compression=none or compression=adaptive") from None
        self.plan, self.compression = plan, compression_config(planned_compression(PLANNED, plan))
        blind = joint.blind
        step_ms = plan.predicted["step_time_s"] * 1e3
        if len(cluster.nodes) < 2:
            self.planned_note = (f"compression=planned: cluster `{cluster.name}` has one node, so the plan has no "
                                 f"inter-node hop to compress; the gradient sync runs uncompressed "
                                 f"({step_ms:.1f} ms/step predicted)")
        elif token == "none":
            self.planned_note = (f"compression=planned: compressing the inter-node hop does not pay on cluster "
                                 f"`{cluster.name}`; the gradient sync runs uncompressed "
                                 f"({step_ms:.1f} ms/step predicted)")
        else:
            assert blind is not None
            blind_s = blind.predicted["step_time_s"]
            self.planned_note = (f"compression=planned: {token} between nodes (the hierarchical exchange), "
                                 f"{step_ms:.1f} ms/step predicted; compression-blind plan {blind_s * 1e3:.1f} "
                                 f"ms/step ({blind_s / plan.predicted['step_time_s']:.2f}x slower)")

    def _check_elastic(self, c: HetTrainConfig) -> tuple[int, int]:
        """``elastic.enabled``: (1 process here, the world of this (re)start); every rule in one line, before any
        worker starts training."""
        e = c.elastic
        if self.cluster is None:
            raise field_error("elastic.enabled", True, "go with a cluster file listing the devices that may take part "
                              "(not cluster=auto)")
        if e.min_devices is not None and e.min_devices > self.cluster.num_devices:
            raise field_error("elastic.min_devices", e.min_devices, f"be at most the {self.cluster.num_devices} "
                              f"devices of cluster `{self.cluster.name}`")
        if self.strategy not in ("hetero", "hetero_deepspeed"):
            raise field_error("elastic.enabled", True, f"go with strategy=hetero or hetero_deepspeed, not "
                              f"{self.strategy}")
        if c.checkpoint.every_n_steps is None:
            raise field_error("checkpoint.every_n_steps", None, "be set with elastic.enabled (a restart goes on from "
                              "the newest checkpoint)", "e.g. checkpoint.every_n_steps=10")
        if c.devices not in (None, 1):
            raise field_error("devices", c.devices, "be 1 or null with elastic.enabled (one process per agent)")
        if "TORCHELASTIC_RUN_ID" not in os.environ:
            raise field_error("elastic.enabled", True, "run under torchrun's elastic agent, one process per agent",
                              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 HET_STRATEGY_DEVICE=<device> torchrun "
                              "--nnodes=MIN:MAX --nproc-per-node=1 "
                              "--max-restarts=N --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT -m "
                              "het_strategy.cli.train_cli ... elastic.enabled=true")
        from het_strategy.strategy.elastic import check_agent_store

        check_agent_store()
        world = int(os.environ["WORLD_SIZE"])
        if world > self.cluster.num_devices:
            raise field_error("WORLD_SIZE", world, f"be at most the {self.cluster.num_devices} devices of cluster "
                              f"`{self.cluster.name}`")
        if e.min_devices is not None and world < e.min_devices:
            raise field_error("elastic.min_devices", e.min_devices, f"be at most the {world} devices this (re)start "
                              "has", "start more agents, or lower elastic.min_devices")
        return 1, world

    def _check_devices(self, devices: int | None) -> int:
        if devices is None:
            if self.cluster is None:
                raise field_error("devices", None, "be given with cluster=auto (how many processes to probe)")
            return self.cluster.num_devices
        if self.cluster is not None and self.cluster.num_devices != devices:
            raise field_error("devices", devices,
                              f"equal the device count of cluster `{self.cluster.name}` "
                              f"({self.cluster.num_devices}): rank r plays the cluster's r-th device",
                              f"pass devices={self.cluster.num_devices} or a cluster of {devices} devices")
        return devices

    def _check_straggler(self) -> None:
        """The straggler callback's own checks, run here and named ``straggler.<field>``."""
        s = self.straggler
        if not s.enabled:
            return
        if self.strategy != "hetero":
            raise field_error("straggler.enabled", True, "go with strategy=hetero (it rebalances the hetero "
                              "strategy's shares)")
        if s.min_share > 1 / self.devices:
            raise field_error("straggler.min_share", s.min_share, f"be <= 1/devices = {1 / self.devices:.4g} "
                              "(every rank keeps at least this share of one global batch)")
        from het_strategy.callbacks.straggler import StragglerMitigation

        try:
            StragglerMitigation(**s.mitigation_args())
        except ConfigError as exc:
            raise _prefixed(exc, "straggler") from None

    def _check_model(self) -> None:
        """What the char GPT (dense or MoE) that het-train builds can be, and what MoE runs with."""
        m, placement = self.model_cfg, self.moe.placement
        if m.ffn_hidden_size not in (None, 4 * m.hidden_size):
            raise field_error("model.ffn_hidden_size", m.ffn_hidden_size, f"be null or 4 * model.hidden_size = "
                              f"{4 * m.hidden_size}: het-train's char GPT has the 4h MLP",
                              "set model.expert_ffn_hidden_size for wider experts")
        if m.attention != "fused":
            raise field_error("model.attention", str(m.attention), "be fused: het-train's char GPT runs torch's "
                              "scaled_dot_product_attention (the cost model prices what runs)")
        experts = m.num_experts
        if not experts:
            return
        if self.strategy in ("hetero_deepspeed", "hetero_fsdp"):
            raise field_error("strategy", self.strategy, "be hetero or ddp for a model with experts "
                              f"(model.num_experts={experts}): HeteroMoE runs under DDP in this version")
        if self.resume is not None:
            raise field_error("resume", self.resume, "be null for a model with experts (each rank's optimizer "
                              "state covers only its own experts; resuming is not supported yet)")
        if experts < self.devices:
            raise field_error("model.num_experts", experts, f"be >= devices ({self.devices}) so every rank "
                              "holds an expert")
        if self.strategy == "hetero" and placement == MoEPlacement.uniform and experts % self.devices:
            raise field_error("moe.placement", "uniform", f"go with model.num_experts ({experts}) divisible "
                              f"by devices ({self.devices})", "use moe.placement=planned")

    def _check_diloco_job(self, c: HetTrainConfig) -> None:
        """What ``strategy=hetero_diloco`` runs in het-train: a cluster file whose devices split into groups, no
        gradient compression, no live rebalancing, one precision."""
        from het_strategy.planning.low_communication import resolve_groups

        assert self.diloco is not None
        if self.cluster is None:
            raise field_error("cluster", "auto", "be a cluster file with strategy=hetero_diloco (its nodes are "
                              "the groups)")
        try:
            resolve_groups(self.cluster, self.diloco.groups, "groups")
        except ConfigError as exc:
            raise _prefixed(exc, "strategy") from None
        if self.compression is not None and self.compression.method != "none":
            raise field_error("compression.method", self.compression.method, "be none with strategy=hetero_diloco "
                              "(the groups' gradients stay inside the group)", "set strategy.outer_codec for the "
                              "outer exchange")
        if c.planner.mode not in ("auto", "dp"):
            raise field_error("planner.mode", c.planner.mode, "be auto or dp with strategy=hetero_diloco (each group "
                              "runs uneven data parallelism)")
        if self.dtype == "per_device":
            raise field_error("train.precision", "per_device", "go with strategy=hetero, not hetero_diloco")
        if c.elastic.enabled:
            raise field_error("elastic.enabled", True, "go with strategy=hetero, not hetero_diloco")

    def _check_fsdp_job(self, c: HetTrainConfig) -> None:
        """What ``strategy=hetero_fsdp`` runs in het-train: a cluster file (the shards are planned from its memory
        figures), blocks of the model that ``strategy.units`` names, checkpoints that are directories written
        synchronously (``torch.distributed.checkpoint``), no gradient compression (``_checked_compression``), one
        precision (``_check_strategy_options``)."""
        assert self.fsdp is not None
        if self.cluster is None:
            raise field_error("cluster", "auto", "be a cluster file with strategy=hetero_fsdp (each rank's shard is "
                              "planned from its device's memory figure)", "name a cluster, e.g. cluster=local_cpu2")
        if self.checkpoint.async_save:
            raise field_error("checkpoint.async_save", True, "be false with strategy=hetero_fsdp (every rank writes "
                              "its chunks through torch.distributed.checkpoint itself, synchronously)")
        if self.fsdp.units is not None:
            _check_fsdp_units(self.fsdp.units, self.model_cfg)
        if c.resume is not None:
            folder = Path(c.resume)
            if not (folder / ".metadata").is_file():
                raise field_error("resume", c.resume, "be a checkpoint directory with strategy=hetero_fsdp, one "
                                  "torch.distributed.checkpoint finished writing (it holds `.metadata`: e.g. "
                                  "output.dir/checkpoints/step_N.ckpt/)")

    def _check_deepspeed_job(self) -> None:
        """What ``strategy=hetero_deepspeed`` runs in het-train (refused here, before any worker starts)."""
        if importlib.util.find_spec("deepspeed") is None:
            raise field_error("strategy", "hetero_deepspeed", "have DeepSpeed installed",
                              "pip install 'het_strategy[deepspeed]'")
        if self.cluster is None:
            raise field_error("cluster", "auto", "be a cluster file with strategy=hetero_deepspeed (it plans "
                              "from the cluster's figures)")
        from het_strategy.core.runtime_rules import DEEPSPEED_PRECISIONS

        if self.train.precision not in DEEPSPEED_PRECISIONS:
            raise field_error("train.precision", self.train.precision,
                              f"be one of {', '.join(DEEPSPEED_PRECISIONS)} with strategy=hetero_deepspeed "
                              "(DeepSpeed's bf16 and fp16 keep fp32 master weights)")
        if self.train.accumulate_grad_batches != 1:
            raise field_error("train.accumulate_grad_batches", self.train.accumulate_grad_batches,
                              "be 1 with strategy=hetero_deepspeed (the plan's micro-batches are the accumulation)")
        if self.checkpoint.async_save:
            raise field_error("checkpoint.async_save", True, "be false with strategy=hetero_deepspeed (DeepSpeed "
                              "writes every rank's checkpoint files itself, synchronously)")
        if self.accelerator == Accelerator.cpu:  # DeepSpeed would guess it, in a warning, here and in every rank
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if self.resume is not None:
            # any plan of the same model, global batch and dtype: the strategy reshards it layer by layer
            check_pipeline_checkpoint(self.resume, self.workload, self.train.global_batch_size, self.dtype)

    @property
    def out_dir(self) -> Path:
        return Path(self.output.dir)


def _prefixed(exc: ConfigError, section: str) -> ConfigError:
    """``exc`` with its field named from the config's top (``threshold`` -> ``straggler.threshold``)."""
    name = exc.field or ""
    if not name or name.startswith(f"{section}."):
        return exc
    message = str(exc).replace(f"`{name}`", f"`{section}.{name}`", 1)
    return ConfigError(message, field=f"{section}.{name}", value=exc.value)


_NO_COMPRESSION = {
    "ddp": "Lightning's DDP registers comm hooks on CUDA only",
    "hetero_fsdp": "its gradients are reduce-scattered by its own uneven collectives, not through DDP's comm hook",
}
"""Why ``compression`` must be none with a strategy other than ``hetero`` (default: DeepSpeed's reason)."""

DILOCO_FIELDS = ("inner_steps", "outer_codec", "groups", "split", "max_inner_steps", "max_sync_overhead",
                 "outer_codecs", "outer_lr", "outer_momentum")
"""The ``strategy=hetero_diloco`` node's own keys (``DiLoCoOptions``'s fields)."""


def _diloco_options(node: DictConfig) -> Any:
    """The hetero_diloco node's options, checked; an error names ``strategy.<field>``."""
    from het_strategy.strategy.diloco_options import DiLoCoOptions

    raw = {k: v for k, v in cfg_to_dict(node, "strategy").items() if k != "_target_"}
    if "outer_codecs" in raw and isinstance(raw["outer_codecs"], list):
        raw["outer_codecs"] = tuple(raw["outer_codecs"])
    try:
        return DiLoCoOptions(**raw)
    except ConfigError as exc:
        raise _prefixed(exc, "strategy") from None


FSDP_FIELDS = ("units", "prefetch", "activation_checkpointing")
"""The ``strategy=hetero_fsdp`` node's own keys (``FSDPStrategyConfig``'s fields)."""


def _fsdp_options(node: DictConfig) -> FSDPStrategyConfig:
    """The hetero_fsdp node's options, checked; an error names ``strategy.<field>``."""
    raw = {k: v for k, v in cfg_to_dict(node, "strategy").items() if k != "_target_"}
    return FSDPStrategyConfig(**raw)


def _check_fsdp_units(units: tuple[str, ...], cfg: Any) -> None:
    """``strategy.units`` must name distinct, non-nested submodules with parameters of the char GPT ``model.*``
    describes (built on the meta device: nothing is allocated)."""
    import torch

    from het_strategy.demo.moe_gpt import build_char_model

    with torch.device("meta"):
        model = build_char_model(cfg)
    blocks = [f"blocks.{i}" for i in range(len(model.blocks))]
    for i, name in enumerate(units):
        try:
            sub = model.get_submodule(name)
        except AttributeError:
            sub = None
        if sub is None or sub is model or not any(True for _ in sub.parameters()):
            raise field_error(f"strategy.units[{i}]", name, "name a submodule with parameters of het-train's char "
                              f"GPT (its blocks: {', '.join(blocks)})", "or strategy.units=null for its blocks")
        for other in units[:i]:
            if name == other or name.startswith(other + ".") or other.startswith(name + "."):
                raise field_error(f"strategy.units[{i}]", name, f"be distinct from and not nested in `{other}`")


def _strategy_name(node: Any) -> str:
    """het-train's name for the strategy group's node (it builds the strategy itself, from the plan's inputs)."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise field_error("strategy", node if not isinstance(node, DictConfig) else OmegaConf.to_container(node),
                          "be a strategy group option", "strategy=hetero, ddp, hetero_deepspeed, hetero_diloco or "
                          "hetero_fsdp")
    target = str(node["_target_"])
    if target not in STRATEGY_TARGETS:
        raise field_error("strategy._target_", target, f"be one of {', '.join(STRATEGY_TARGETS)}",
                          "strategy=hetero, ddp, hetero_deepspeed, hetero_diloco or hetero_fsdp")
    own = {"hetero_diloco": DILOCO_FIELDS, "hetero_fsdp": FSDP_FIELDS}.get(STRATEGY_TARGETS[target], ())
    extra = sorted(str(k) for k in node.keys() if k != "_target_" and k not in own)
    if extra:
        raise field_error(f"strategy.{extra[0]}", OmegaConf.select(node, extra[0]), "not be there: het-train "
                          "builds the strategy from cluster, model and train", "set those sections instead")
    return STRATEGY_TARGETS[target]


def _logger_nodes(node: Any) -> dict[str, DictConfig]:
    """The logger group's entries (name -> ``_target_`` node), each class found and wandb's mode checked."""
    from hydra.utils import get_class

    if node is None:
        return {}
    if not isinstance(node, DictConfig):
        raise field_error("logger", node, "be a logger group option", "logger=wandb, logger=csv or logger=none")
    out: dict[str, DictConfig] = {}
    for name in node.keys():
        entry = node[name]
        where = f"logger.{name}"
        if not isinstance(entry, DictConfig) or "_target_" not in entry:
            raise field_error(where, entry, "be a mapping with a `_target_` (a Lightning logger class)")
        target = str(entry["_target_"])
        if target == _WANDB_TARGET:
            if importlib.util.find_spec("wandb") is None:
                raise field_error("logger", "wandb", "name an installed logger (wandb is an optional dependency)",
                                  "pip install 'het_strategy[wandb]', or logger=csv")
            mode = OmegaConf.select(entry, "mode", default="offline")
            require_option(WandbMode, mode, f"{where}.mode")
        try:
            get_class(target)
        except Exception as exc:  # ImportError, AttributeError, ValueError: all mean a wrong path
            raise field_error(f"{where}._target_", target, f"name an importable logger class "
                              f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
        out[str(name)] = entry
    return out


def _check_cuda(devices: int) -> None:
    import torch

    if not torch.cuda.is_available():
        raise field_error("accelerator", "cuda", "name an accelerator this machine has (torch sees no CUDA "
                          "device)", "accelerator=cpu")
    count = torch.cuda.device_count()
    if devices > count:
        raise field_error("devices", devices, f"be <= the {count} CUDA device(s) this machine has")


def _check_output(out_dir: str, summary: str | None) -> None:
    """``output.dir`` must be (or become) a writable folder; ``output.summary`` a file name inside it."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise field_error("output.dir", out_dir, "be a folder (it names an existing file)",
                          "choose another output.dir")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise field_error("output.dir", out_dir, f"be creatable ({ancestor} is a file, not a folder)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise field_error("output.dir", out_dir, f"be writable ({ancestor} is not writable by this user)")
    if summary is not None and (path / summary).is_dir():
        raise field_error("output.summary", summary, "be a file name (it names a folder inside output.dir)")


def _check_planner(request: "PlanRequest") -> None:
    """het-train's strategies plan by step time (``planner.mode`` chooses the planners): every other
    ``planner`` field keeps its default."""
    from dataclasses import fields

    from het_strategy.compression import CompressionConfig
    from het_strategy.planning.request import PlanRequest

    default = PlanRequest()
    for f in fields(PlanRequest):
        value = getattr(request, f.name)
        if f.name != "mode" and value != getattr(default, f.name):
            raise field_error(f"planner.{f.name}", value, f"stay {_yaml(getattr(default, f.name))} with het-train "
                              "(its strategies plan the fastest plan they run; het-train reads planner.mode only)",
                              "plan with het-plan and train its plan, or use compression=planned for the inter-node "
                              "compression planned with the placement")


def _yaml(value: object) -> str:
    """A default as the user writes it in YAML (``null`` for None)."""
    return "null" if value is None else str(value)
