"""het-plan's settings as typed dataclasses: the structured schema ``configs/plan.yaml`` extends.

``register_plan_schema`` stores ``HetPlanConfig`` in Hydra's ConfigStore as
``het_plan_schema`` (``cli/structured.py``), the first entry of plan.yaml's
defaults list, so Hydra checks every override against these types while it
composes (``planner.mode=fast`` or ``settings.zero_stage=x`` fail there, named
in full).  ``typed_plan_config`` turns the composed config into the
dataclasses, which check their values on construction: ``settings`` is the
planning core's ``TrainSettings``, ``planner`` its ``PlanRequest``.

``cluster`` (the cluster YAML schema, checked by ``core.cluster``) and
``model`` (a model YAML, or ``{name, factory}`` for ``model=<python path>``)
stay mappings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from het_strategy.cli.structured import store_schema, to_typed
from het_strategy.core.dtypes import InputDtype
from het_strategy.core.errors import field_error, require_int, require_option
from het_strategy.core.train_settings import TrainSettings
from het_strategy.planning.request import PlanRequest

__all__ = ["SCHEMA_NAME", "ModelInputConfig", "PlanOutputConfig", "HetPlanConfig", "register_plan_schema",
           "typed_plan_config"]

SCHEMA_NAME = "het_plan_schema"


@dataclass
class ModelInputConfig:
    """The ``model_input`` section: the sample input of ``model=<python path>`` and how it is profiled."""

    shape: Optional[list[int]] = None
    """The sample input's shape when the factory returns only a module, e.g. [4,1,28,28]."""
    dtype: InputDtype = InputDtype.float32
    """float32 | float16 | bfloat16 | float64 | int64 (token ids: zeros)."""
    blocks: Optional[list[str]] = None
    """Dotted names of the blocks; null: the first ModuleList / Sequential found."""
    repeats: int = 3
    """Timed passes of the profile."""
    measured_type: Optional[str] = None
    """File the times measured here under this cluster device type; null: the counted FLOPs and the figures."""

    def __post_init__(self) -> None:
        self.dtype = require_option(InputDtype, self.dtype, "model_input.dtype")
        require_int(self.repeats, "model_input.repeats", minimum=1)


@dataclass
class PlanOutputConfig:
    """The ``output`` section: what het-plan writes, relative to where it started."""

    dir: str = "."
    """Folder of the written files (created when missing)."""
    plan: Optional[str] = "plan.json"
    """The plan's file name; null: not written."""
    ds_config: bool = False
    """Also write DeepSpeed files (ds_config.json, ...)."""
    plot: bool = False
    """Also write a PNG picture of the plan."""

    def __post_init__(self) -> None:
        if not isinstance(self.dir, str) or not self.dir.strip():
            raise field_error("output.dir", self.dir, "be a folder path")
        if self.plan is not None and (not isinstance(self.plan, str) or not self.plan.strip()):
            raise field_error("output.plan", self.plan, "be a file name (or null to not write the plan)")


@dataclass
class HetPlanConfig:
    """The whole het-plan config (``configs/plan.yaml`` and its groups)."""

    cluster: Any = MISSING
    """The cluster group (cluster YAML schema)."""
    model: Any = MISSING
    """The model group (model YAML schema), or ``{name, factory}`` for ``model=<python path>``."""
    settings: TrainSettings = field(default_factory=lambda: TrainSettings(global_batch_size=64))
    """How the model is trained: batch, dtype, ZeRO stage and the planner's search bounds."""
    planner: PlanRequest = field(default_factory=PlanRequest)
    """What the planner is asked: modes, runtime, objective, budget, floor, joint compression, profile, and the
    low-communication budget (``planner.outer_sync``)."""
    model_input: ModelInputConfig = field(default_factory=ModelInputConfig)
    score: Optional[str] = None
    """A plan JSON to score with the same cost model instead of searching; null: search."""
    output: PlanOutputConfig = field(default_factory=PlanOutputConfig)


def register_plan_schema() -> None:
    """Store ``HetPlanConfig`` as ``het_plan_schema`` (idempotent)."""
    store_schema(SCHEMA_NAME, HetPlanConfig)


def typed_plan_config(cfg: DictConfig) -> HetPlanConfig:
    """The composed config as ``HetPlanConfig``; keys the schema lacks and bad values raise ConfigError."""
    return to_typed(cfg, HetPlanConfig)
