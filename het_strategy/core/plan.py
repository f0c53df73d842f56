"""The Plan: who computes which layers on how many samples.

A Plan is a list of data-parallel replicas ("pipelines").  Pipelines may differ
in length and device types.  Each pipeline processes ``samples`` of every global
batch as ``num_micro_batches`` micro-batches of ``micro_batch_size`` (the last
one may be smaller), through ``stages``; a stage is a tensor-parallel group of
``tp`` devices holding layers ``[start, stop)``.  Pure data parallelism is the
special case of one single-device stage per pipeline, and then
``rank_shares()`` gives each device's share of the global batch.

JSON form (``SCHEMA_VERSION`` 1) is documented in docs/guide/plan-schema.md; ``Plan.load``
reads it back (through ``files.read_json_file``), ``Plan.check_cluster``
refuses a plan made for another cluster and ``Plan.check_against`` one made
for another cluster or model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from het_strategy.core.atomic_file import write_atomic
from het_strategy.core.dtypes import Dtype, as_dtype, as_element_dtype
from het_strategy.core.errors import ConfigError, alternatives, check_keys, field_error, require_int
from het_strategy.core.files import naming_file, read_json_file
from het_strategy.core.outer_sync import OuterSync
from het_strategy.core.plain_data import plain
from het_strategy.core.train_settings import ZERO_STAGES

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.workload import WorkloadSpec

__all__ = ["SCHEMA_VERSION", "Stage", "Pipeline", "Plan"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Stage:
    """A tensor-parallel group of devices holding a contiguous layer range."""

    devices: tuple[str, ...]
    """Device names; their count is the tensor-parallel degree."""
    layers: tuple[int, int]
    """Layer range ``[start, stop)``."""

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def to_dict(self) -> dict[str, Any]:
        return {"devices": list(self.devices), "layers": list(self.layers), "tp": self.tp}


@dataclass(frozen=True)
class Pipeline:
    """One data-parallel replica: stages in order, and its share of the global batch."""

    stages: tuple[Stage, ...]
    """Stages in execution order; their layer ranges tile ``[0, num_layers)``."""
    micro_batch_size: int
    """Samples per micro-batch."""
    samples: int
    """Samples of each global batch this pipeline processes."""

    @property
    def num_micro_batches(self) -> int:
        return math.ceil(self.samples / self.micro_batch_size)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for s in self.stages for d in s.devices)

    def boundaries(self) -> list[int]:
        """Stage boundaries ``[0, b1, ..., num_layers]``, as DeepSpeed's ``parts``."""
        return [self.stages[0].layers[0]] + [s.layers[1] for s in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "num_micro_batches": self.num_micro_batches,
                "samples": self.samples, "stages": [s.to_dict() for s in self.stages]}


@dataclass
class Plan:
    """A complete parallel plan for one cluster, model and global batch."""

    cluster: str
    """Cluster name the plan was made for."""
    cluster_devices: tuple[str, ...]
    """Every device name of that cluster, in rank order (the plan may leave some idle)."""
    model: dict[str, Any]
    """The workload's fingerprint (name, layers, params, seq_len)."""
    global_batch_size: int
    """Samples per optimizer step."""
    pipelines: tuple[Pipeline, ...]
    """The data-parallel replicas."""
    zero_stage: int = 0
    """ZeRO stage the memory figures assume."""
    dtype: Dtype = Dtype.bf16
    """Training dtype (a name is converted to the member; JSON holds the name)."""
    device_dtypes: dict[str, Dtype] = field(default_factory=dict)
    """With ``dtype=per_device``: the dtype each device computes in (device name -> bf16, fp16 or fp32), every
    used device named; empty for any other dtype."""
    mode: str = "hybrid"
    """Planner that made it (dp, pipeline, hybrid, manual)."""
    experts: dict[int, dict[str, list[int]]] = field(default_factory=dict)
    """MoE expert placement: ``{layer: {device: [expert ids]}}``."""
    predicted: dict[str, Any] = field(default_factory=dict)
    """Cost-model figures: step_time_s, samples_per_s, memory_gb per device, ..."""
    idle_reasons: dict[str, str] = field(default_factory=dict)
    """Why each device of ``cluster_devices`` the plan leaves idle is idle (optional; absent in older plans)."""
    compression: dict[str, str] = field(default_factory=dict)
    """Gradient compression per link class the plan was priced with: ``{"inter_node": "q4"}`` runs the
    hierarchical exchange (``compression.scope=inter_node``); empty: uncompressed (optional)."""
    outer_sync: OuterSync | None = None
    """Low-communication training (``strategy="hetero_diloco"``): the groups, the inner steps between outer
    steps and the outer exchange's codec; None for a plan synchronised every step (optional)."""
    shards: dict[str, float] = field(default_factory=dict)
    """Fully sharded data parallelism (``strategy="hetero_fsdp"``, mode ``fsdp``): each used device's fraction of
    every flat parameter (``core/shard_sizes.py`` cuts the pieces), summing to 1; empty for other plans
    (optional)."""

    def __post_init__(self) -> None:
        self.pipelines = tuple(self.pipelines)
        self.cluster_devices = tuple(self.cluster_devices)
        self._check_shape()

    # -- structure ---------------------------------------------------------------------------
    def _check_shape(self) -> None:
        require_int(self.global_batch_size, "plan.global_batch_size", minimum=1)
        if not self.pipelines:
            raise field_error("plan.pipelines", [], "list at least one pipeline")
        num_layers = int(self.model.get("num_layers", 0))
        seen: set[str] = set()
        for p, pipe in enumerate(self.pipelines):
            where = f"plan.pipelines[{p}]"
            require_int(pipe.micro_batch_size, f"{where}.micro_batch_size", minimum=1)
            require_int(pipe.samples, f"{where}.samples", minimum=1)
            if not pipe.stages:
                raise field_error(f"{where}.stages", [], "list at least one stage")
            expected_start = 0
            for s, stage in enumerate(pipe.stages):
                sw = f"{where}.stages[{s}]"
                start, stop = stage.layers
                if start != expected_start or stop <= start:
                    raise field_error(f"{sw}.layers", list(stage.layers),
                                      f"start at {expected_start} and be non-empty (stages tile the layers in order)")
                expected_start = stop
                if not stage.devices:
                    raise field_error(f"{sw}.devices", [], "list at least one device")
                for d in stage.devices:
                    if d in seen:
                        raise field_error(f"{sw}.devices", d, "not repeat a device used elsewhere in the plan")
                    seen.add(d)
            if num_layers and expected_start != num_layers:
                raise field_error(f"{where}.stages[-1].layers", list(pipe.stages[-1].layers),
                                  f"end at the model's last layer ({num_layers})")
        total = sum(p.samples for p in self.pipelines)
        if total != self.global_batch_size:
            raise field_error("plan.pipelines[*].samples", [p.samples for p in self.pipelines],
                              f"sum to global_batch_size ({self.global_batch_size}); they sum to {total}")
        self.dtype = as_dtype(self.dtype, "plan.dtype")
        self._check_device_dtypes()
        if self.zero_stage not in ZERO_STAGES:
            raise field_error("plan.zero_stage", self.zero_stage, f"be {alternatives(ZERO_STAGES)}")
        if self.outer_sync is not None:
            self.outer_sync.check_covers(self.used_devices)
        self._check_shards()

    def _check_shards(self) -> None:
        """``shards``: a fraction in [0, 1] per used device of a pure data-parallel plan, summing to 1."""
        raw = plain(self.shards)
        if not isinstance(raw, Mapping):
            raise field_error("plan.shards", raw, "be a mapping device name -> fraction of every flat parameter")
        shards: dict[str, float] = {}
        for name, value in raw.items():
            where = f"plan.shards.{name}"
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not 0.0 <= value <= 1.0:
                raise field_error(where, value, "be a fraction in [0, 1] (of every flat parameter)")
            shards[str(name)] = float(value)
        self.shards = shards
        if not shards:
            return
        if not self.is_pure_dp:
            raise field_error("plan.shards", _few(list(shards)), "be empty for a plan with pipeline stages "
                              "(sharded data parallelism runs one single-device stage per rank)")
        used = self.used_devices
        missing = [d for d in used if d not in shards]
        if missing:
            raise field_error(f"plan.shards.{missing[0]}", None, "be given: every used device keeps a fraction of "
                              "every flat parameter (0 for none)")
        extra = [d for d in shards if d not in set(used)]
        if extra:
            raise field_error(f"plan.shards.{extra[0]}", shards[extra[0]], "name a device the plan uses")
        total = math.fsum(shards.values())
        if abs(total - 1.0) > 1e-9:
            raise field_error("plan.shards", {d: round(v, 6) for d, v in shards.items()},
                              f"sum to 1 (within 1e-9); it sums to {total!r}")

    def _check_device_dtypes(self) -> None:
        self.device_dtypes = {str(k): as_element_dtype(v, f"plan.device_dtypes.{k}")
                              for k, v in dict(self.device_dtypes).items()}
        if self.dtype != Dtype.per_device:
            if self.device_dtypes:
                raise field_error("plan.device_dtypes", self._named_dtypes(), "be empty unless plan.dtype is "
                                  "per_device")
            return
        missing = [d for d in self.used_devices if d not in self.device_dtypes]
        if missing:
            raise field_error("plan.device_dtypes", self._named_dtypes(), f"name the dtype of every used "
                              f"device (per_device plan); it lacks {_few(missing)}")

    def _named_dtypes(self) -> dict[str, str]:
        return {d: str(v) for d, v in self.device_dtypes.items()}

    def compute_dtype(self, device: str) -> Dtype:
        """The dtype ``device`` computes in: its ``device_dtypes`` entry under ``per_device``, else the plan's
        dtype (ConfigError for a ``per_device`` plan that does not name the device)."""
        if self.dtype != Dtype.per_device:
            return self.dtype
        if device not in self.device_dtypes:
            raise field_error("plan.device_dtypes", self._named_dtypes(), f"name the dtype of `{device}`")
        return self.device_dtypes[device]

    @property
    def num_pipelines(self) -> int:
        return len(self.pipelines)

    @property
    def used_devices(self) -> tuple[str, ...]:
        return tuple(d for p in self.pipelines for d in p.devices)

    @property
    def is_pure_dp(self) -> bool:
        return all(len(p.stages) == 1 and p.stages[0].tp == 1 for p in self.pipelines)

    def rank_shares(self) -> dict[str, int]:
        """Samples per device for a pure data-parallel plan (0 for idle devices)."""
        if not self.is_pure_dp:
            raise ConfigError("rank_shares() needs a pure data-parallel plan (one single-device stage per pipeline)")
        shares = {d: 0 for d in self.cluster_devices}
        for p in self.pipelines:
            shares[p.stages[0].devices[0]] = p.samples
        return shares

    def check_cluster(self, cluster: "ClusterSpec") -> None:
        """Refuse a plan made for another cluster: every device it uses must be one of ``cluster``'s, the
        plan's ``cluster_devices`` (when recorded) must be the cluster's devices in rank order, and each
        tensor-parallel stage must lie in one node."""
        names = [d.name for d in cluster.devices]
        known = set(names)
        fix = (f"the plan was made for cluster `{self.cluster}`; re-plan for `{cluster.name}` or pass the cluster "
               "it was made for")
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                for k, d in enumerate(stage.devices):
                    if d not in known:
                        raise field_error(f"plan.pipelines[{p}].stages[{s}].devices[{k}]", d,
                                          f"name a device of cluster `{cluster.name}`", fix)
        if self.cluster_devices and list(self.cluster_devices) != names:
            raise field_error("plan.cluster_devices", _few(list(self.cluster_devices)),
                              f"equal the devices of cluster `{cluster.name}` in rank order "
                              f"({_device_difference(list(self.cluster_devices), names)})", fix)
        for p, pipe in enumerate(self.pipelines):
            for s, stage in enumerate(pipe.stages):
                nodes = {cluster.device(d).node for d in stage.devices}
                if len(nodes) > 1:
                    raise field_error(f"plan.pipelines[{p}].stages[{s}].devices", list(stage.devices),
                                      "lie in one node (a tensor-parallel group needs the node's fast link)")

    def check_against(self, cluster: "ClusterSpec", workload: "WorkloadSpec") -> None:
        """Refuse a plan made for another cluster (``check_cluster``, first) or model."""
        self.check_cluster(cluster)
        if int(self.model.get("num_layers", -1)) != workload.num_layers:
            raise field_error("plan.model.num_layers", self.model.get("num_layers"),
                              f"equal the model's {workload.num_layers} layers (`{workload.name}`)",
                              "the plan was made for another model")

    # -- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "cluster": self.cluster,
            "cluster_devices": list(self.cluster_devices),
            "model": dict(self.model),
            "global_batch_size": self.global_batch_size,
            "mode": self.mode,
            "dtype": self.dtype.value,
            **({"device_dtypes": {d: v.value for d, v in self.device_dtypes.items()}} if self.device_dtypes else {}),
            "zero_stage": self.zero_stage,
            "pipelines": [p.to_dict() for p in self.pipelines],
        }
        if self.is_pure_dp:
            out["rank_shares"] = self.rank_shares()
        if self.experts:
            out["experts"] = {str(layer): {d: list(ids) for d, ids in m.items()} for layer, m in self.experts.items()}
        if self.predicted:
            out["predicted"] = _builtin(self.predicted)
        if self.idle_reasons:
            out["idle_reasons"] = dict(self.idle_reasons)
        if self.compression:
            out["compression"] = dict(self.compression)
        if self.outer_sync is not None:
            out["outer_sync"] = self.outer_sync.to_dict()
        if self.shards:
            out["shards"] = dict(self.shards)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "Plan":
        raw = plain(raw)  # an inline plan in a Hydra config
        if not isinstance(raw, Mapping):
            raise field_error("plan", type(raw).__name__, "be a JSON object")
        version = raw.get("schema_version")
        if version != SCHEMA_VERSION:
            raise field_error("plan.schema_version", version, f"be {SCHEMA_VERSION}")
        _check_plan_keys(raw)
        _check_plan_fields(raw)
        try:
            pipelines = tuple(
                Pipeline(
                    stages=tuple(Stage(tuple(str(d) for d in s["devices"]), (int(s["layers"][0]), int(s["layers"][1])))
                                 for s in p["stages"]),
                    micro_batch_size=p["micro_batch_size"],
                    samples=p["samples"],
                )
                for p in raw["pipelines"]
            )
            experts = {int(k): {str(d): [int(i) for i in ids] for d, ids in v.items()}
                       for k, v in (raw.get("experts") or {}).items()}
            return cls(
                cluster=str(raw["cluster"]),
                cluster_devices=tuple(raw.get("cluster_devices", ())),
                model=dict(raw["model"]),
                global_batch_size=raw["global_batch_size"],
                pipelines=pipelines,
                zero_stage=raw.get("zero_stage", 0),
                dtype=raw.get("dtype", Dtype.bf16),
                device_dtypes=dict(raw.get("device_dtypes") or {}),
                mode=raw.get("mode", "manual"),
                experts=experts,
                predicted=dict(raw.get("predicted") or {}),
                idle_reasons=_idle_reasons(raw.get("idle_reasons")),
                compression=_compression(raw.get("compression")),
                outer_sync=None if raw.get("outer_sync") is None else OuterSync.from_dict(raw["outer_sync"]),
                shards=raw.get("shards") or {},
            )
        except (KeyError, TypeError, IndexError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"`plan` does not follow the plan schema ({type(exc).__name__}: {exc}); see the "
                              "plan schema in the docs", field="plan") from None

    def save(self, path: str | Path) -> Path:
        """Write JSON atomically (a crash never leaves a half-written plan)."""
        return write_atomic(Path(path), self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path, field: str = "plan") -> "Plan":
        """The plan in a JSON file; ConfigError naming ``field`` (the option the path was given for) when
        the file cannot be read or parsed, and naming the file when its content is not a plan."""
        path, raw = read_json_file(path, field, "plan JSON file")
        with naming_file(path, "plan file"):
            return cls.from_dict(raw)


def _builtin(value: Any) -> Any:
    """``value`` with every option enum member (a ``Dtype`` the cost model recorded, ...) as its plain string, in
    nested dicts and lists: a plan's dict must load where only builtin types may (``torch.load(weights_only=True)``
    of a checkpoint that holds it, a YAML dump)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {_builtin(k): _builtin(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_builtin(v) for v in value)
    return value


def _few(names: list[str], limit: int = 6) -> str:
    """A list of names, the middle left out when it is long."""
    shown = names if len(names) <= limit else names[:limit // 2] + ["..."] + names[-(limit // 2):]
    return f"[{', '.join(shown)}] ({len(names)} devices)"


def _device_difference(planned: list[str], actual: list[str]) -> str:
    """Where a plan's device list and a cluster's differ, in a few words."""
    missing = [d for d in actual if d not in set(planned)]
    extra = [d for d in planned if d not in set(actual)]
    if missing or extra:
        return "; ".join(part for part in (f"the plan lacks {_few(missing)}" if missing else "",
                                           f"the cluster lacks {_few(extra)}" if extra else "") if part)
    rank = next(i for i, (a, b) in enumerate(zip(planned, actual)) if a != b)
    return f"the same devices in another order: rank {rank} is `{actual[rank]}` in the cluster, `{planned[rank]}` " \
           "in the plan"


_PLAN_KEYS = {"schema_version", "cluster", "cluster_devices", "model", "global_batch_size", "mode", "dtype",
              "device_dtypes", "zero_stage", "pipelines", "rank_shares", "experts", "predicted", "idle_reasons",
              "compression", "outer_sync", "shards"}
_PIPELINE_KEYS = {"micro_batch_size", "num_micro_batches", "samples", "stages"}
_STAGE_KEYS = {"devices", "layers", "tp"}


def _compression(raw: Any) -> dict[str, str]:
    """``compression`` of a plan file: link class -> method token (optional; only ``inter_node`` in this version)."""
    if raw is None:
        return {}
    from het_strategy.core.compressed_sync import check_token

    if not isinstance(raw, Mapping):
        raise field_error("plan.compression", raw, "be a mapping link class -> method token")
    check_keys(raw, {"inter_node"}, "plan.compression")
    return {"inter_node": check_token(raw["inter_node"], "plan.compression.inter_node")} if raw else {}


def _idle_reasons(raw: Any) -> dict[str, str]:
    """``idle_reasons`` of a plan file: device name -> why it is idle (an optional field)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(v, str) for v in raw.values()):
        raise field_error("plan.idle_reasons", raw, "be a mapping device name -> reason (text)")
    return {str(k): v for k, v in raw.items()}


def _check_plan_fields(raw: Mapping[str, Any]) -> None:
    """Every required field of a plan mapping is there with the right shape, each error naming its full path."""
    for key in ("cluster", "model", "global_batch_size", "pipelines"):
        if key not in raw:
            raise field_error(f"plan.{key}", None, "be given (see the plan schema)")
    if not isinstance(raw["model"], Mapping):
        raise field_error("plan.model", raw["model"], "be a mapping (the model's fingerprint)")
    if not isinstance(raw["pipelines"], list):
        raise field_error("plan.pipelines", raw["pipelines"], "be a list of pipelines")
    if not isinstance(raw.get("cluster_devices", []), list):
        raise field_error("plan.cluster_devices", raw["cluster_devices"], "be a list of device names")
    for key, rule in (("experts", "a mapping layer -> {device: [expert ids]}"), ("predicted", "a mapping"),
                      ("device_dtypes", "a mapping device -> dtype")):
        if not isinstance(raw.get(key) or {}, Mapping):
            raise field_error(f"plan.{key}", raw[key], f"be {rule}")
    for layer, placement in (raw.get("experts") or {}).items():
        if not isinstance(placement, Mapping):
            raise field_error(f"plan.experts.{layer}", placement, "be a mapping device -> [expert ids]")
    for p, pipe in enumerate(raw["pipelines"]):
        where = f"plan.pipelines[{p}]"
        if not isinstance(pipe, Mapping):
            raise field_error(where, pipe, "be a mapping with stages, micro_batch_size and samples")
        for key in ("stages", "micro_batch_size", "samples"):
            if key not in pipe:
                raise field_error(f"{where}.{key}", None, "be given")
        if not isinstance(pipe["stages"], list):
            raise field_error(f"{where}.stages", pipe["stages"], "be a list of stages")
        for s, stage in enumerate(pipe["stages"]):
            sw = f"{where}.stages[{s}]"
            if not isinstance(stage, Mapping):
                raise field_error(sw, stage, "be a mapping with devices and layers")
            devices, layers = stage.get("devices"), stage.get("layers")
            if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
                raise field_error(f"{sw}.devices", devices, "be a list of device names")
            if not (isinstance(layers, list) and len(layers) == 2 and all(
                    isinstance(x, int) and not isinstance(x, bool) for x in layers)):
                raise field_error(f"{sw}.layers", layers, "be [start, stop], two layer indices")


def _check_plan_keys(raw: Mapping[str, Any]) -> None:
    """Refuse keys the plan schema does not know (a typo must not be silently ignored), and a stage's ``tp``
    other than its device count (``tp`` is written for readers; the devices define it)."""
    check_keys(raw, _PLAN_KEYS, "plan")
    for p, pipe in enumerate(raw.get("pipelines") or []):
        if not isinstance(pipe, Mapping):
            continue  # the parser below reports the shape
        check_keys(pipe, _PIPELINE_KEYS, f"plan.pipelines[{p}]")
        for s, stage in enumerate(pipe.get("stages") or []):
            if not isinstance(stage, Mapping):
                continue
            check_keys(stage, _STAGE_KEYS, f"plan.pipelines[{p}].stages[{s}]")
            devices = stage.get("devices")
            if "tp" in stage and isinstance(devices, list) and stage["tp"] != len(devices):
                raise field_error(f"plan.pipelines[{p}].stages[{s}].tp", stage["tp"],
                                  f"equal the stage's device count ({len(devices)})")
