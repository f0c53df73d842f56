"""``het-plan``: cluster + model + global batch -> a Plan (table, plan.json, options).

Usage (every field of ``configs/plan.yaml`` can be overridden Hydra-style)::

    het-plan                                               # shipped defaults
    het-plan cluster=sailor_a100_v100_32_96 model=opt350 train.global_batch_size=256
    het-plan cluster=./my_cluster.yaml cluster.inter_node_bandwidth_gbs=5 planner.mode=dp
    het-plan planner.profile=sailor output.ds_config=true output.plot=true
    het-plan score=plan.json                               # score a given plan, no search
    het-plan --cfg                                         # print the composed config and stop

Steps of one run:

1. compose the config (Hydra compose API: no output folders, no change of cwd);
2. build ClusterSpec, WorkloadSpec (activations in ``train.dtype``), TrainSettings;
3. plan with ``het_strategy.planning.plan`` — or, with ``score=<file>``, load that
   plan, check it belongs to this cluster and model, and score it with the same
   CostModel;
4. print the table; write ``output.dir/output.plan`` atomically, and, when asked,
   the DeepSpeed files and a PNG picture.

Bad input (cluster, model, batch, overrides, plan file) prints one line
``het-plan: error: ...`` on stderr and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from omegaconf import DictConfig, OmegaConf

from het_strategy.cli._common import (
    compose_config,
    cluster_from_cfg,
    cfg_to_dict,
    run_cli,
    train_settings_from_cfg,
    workload_from_cfg,
)
from het_strategy.core.errors import ConfigError, check_keys, field_error
from het_strategy.core.shipped import shipped_names

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.cost_model import PlanScore, TrainSettings
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["PROG", "CONFIG_NAME", "compose_plan_config", "run_plan", "main"]

PROG = "het-plan"
CONFIG_NAME = "plan"
_PROFILES = (None, "sailor")
_OUTPUT_KEYS = {"dir", "plan", "ds_config", "plot"}
_PLANNER_KEYS = {"mode", "profile", "runtime"}

_USAGE = f"""usage: {PROG} [--cfg] [key=value ...]

Plan training of a model on a heterogeneous cluster; print a table and write plan.json.

overrides (Hydra syntax; see configs/plan.yaml for every field):
  cluster=<name|file.yaml>      shipped: {{clusters}}
  model=<name|file.yaml>        shipped: {{models}}
  train.global_batch_size=N     train.dtype=bf16|fp16|fp32   train.zero_stage=0..3
  train.max_tp=1|2|4|8          train.micro_batch_sizes=[1,2,4,8]   train.activation_checkpointing=true
  planner.mode=auto|dp|pipeline|hybrid   planner.profile=null|sailor   planner.runtime=any|deepspeed
  score=<plan.json>             score this plan with the same cost model instead of searching
                                (written as <name>.scored.json when output.plan would overwrite it)
  output.dir=.  output.plan=plan.json  output.ds_config=true  output.plot=true

options:
  --cfg       print the composed config and exit
  -h, --help  show this help and exit

Bad input exits with code 2 and one line naming the field, the value and the rule.
"""


def compose_plan_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed ``plan`` config with ``overrides`` (``cluster=<file.yaml>`` accepted)."""
    return compose_config(CONFIG_NAME, overrides)


def run_plan(cfg: DictConfig, *, echo: bool = True) -> "tuple[Plan, PlanScore]":
    """Plan (or score ``cfg.score``), print the table when ``echo``, write the requested files.

    Paths in ``cfg.output`` and ``cfg.score`` are relative to the current directory.
    Raises ``ConfigError`` for every bad input.
    """
    from het_strategy.core.cost_model import CostModel
    from het_strategy.report.table import plan_table

    output = _output_settings(cfg)
    planner = cfg_to_dict(cfg.get("planner") or {}, "planner")
    check_keys(planner, _PLANNER_KEYS, "planner")
    settings = train_settings_from_cfg(cfg)
    cluster = cluster_from_cfg(cfg)
    workload = workload_from_cfg(cfg, dtype=settings.dtype)
    profile = _load_profile(planner.get("profile"), workload)

    score_path = cfg.get("score")
    runtime_line = None
    if score_path is not None:
        plan, settings = _load_plan_to_score(str(score_path), cluster, workload, settings)
        score = CostModel(cluster, workload, settings, profile).score(plan)
        plan.predicted = score.to_dict()
        if output["plan"] is not None and (output["dir"] / output["plan"]).resolve() == Path(score_path).resolve():
            output["plan"] = f"{Path(output['plan']).stem}.scored.json"  # the scored plan never overwrites its input
    else:
        from het_strategy.planning.runtimes import plan_for_runtime

        mode = planner.get("mode", "auto")
        if not isinstance(mode, str):
            raise field_error("planner.mode", mode, "be a planner name (auto, dp, pipeline, hybrid)")
        choice = plan_for_runtime(cluster, workload, settings, mode=mode, profile=profile,
                                  runtime=planner.get("runtime", "any"))
        plan = choice.plan
        runtime_line = choice.summary() if choice.runtime != "any" else None
        score = CostModel(cluster, workload, settings, profile).score(plan)
        if not plan.predicted:
            plan.predicted = score.to_dict()

    # files first: a closed stdout (``het-plan | head``) must not cost the user the plan
    written = _write_outputs(plan, score, cluster, settings, output)
    if echo:
        print(plan_table(plan, score, cluster))
        if runtime_line:
            print(runtime_line)
        if written:
            print("\nwrote " + ", ".join(str(p) for p in written))
    return plan, score


def _output_settings(cfg: DictConfig) -> dict[str, Any]:
    out = cfg_to_dict(cfg.get("output") or {}, "output")
    check_keys(out, _OUTPUT_KEYS, "output")
    for key in ("ds_config", "plot"):
        if not isinstance(out.get(key, False), bool):
            raise field_error(f"output.{key}", out[key], "be true or false")
    if not isinstance(out.get("dir", "."), str) or not str(out.get("dir", ".")).strip():
        raise field_error("output.dir", out.get("dir"), "be a folder path")
    plan_name = out.get("plan", "plan.json")
    if plan_name is not None and (not isinstance(plan_name, str) or not plan_name.strip()):
        raise field_error("output.plan", plan_name, "be a file name (or null to not write the plan)")
    return {"dir": Path(out.get("dir", ".")).expanduser(), "plan": plan_name,
            "ds_config": out.get("ds_config", False), "plot": out.get("plot", False)}


def _load_profile(name: Any, workload: "WorkloadSpec") -> "MeasuredProfile | None":
    if name is None:
        return None
    if name not in _PROFILES:
        raise field_error("planner.profile", name, "be null or `sailor` (Sailor's measured per-layer times)")
    from het_strategy.core.reference_profiles import load_sailor_profile, sailor_models

    profiled = {_normalized(m): m for m in sailor_models()}
    sailor_name = profiled.get(_normalized(workload.name))
    if sailor_name is None:
        raise field_error("planner.profile", name, f"be used with a model Sailor profiled ({', '.join(profiled.values())})",
                          f"model `{workload.name}` has no Sailor profile; use planner.profile=null")
    return load_sailor_profile(model=sailor_name, workload=workload)


def _normalized(model_name: str) -> str:
    """``OPT-350`` and ``opt350`` name the same model."""
    return re.sub(r"[^a-z0-9]", "", model_name.lower())


def _load_plan_to_score(path: str, cluster: "ClusterSpec", workload: "WorkloadSpec",
                        settings: "TrainSettings") -> "tuple[Plan, TrainSettings]":
    """Load a plan file, check it matches cluster and model; its batch, dtype and ZeRO stage take over."""
    from het_strategy.core.plan import Plan

    if not Path(path).expanduser().is_file():
        raise field_error("score", path, "be the path of an existing plan JSON file")
    plan = Plan.load(Path(path).expanduser())
    plan.check_against(cluster, workload)
    taken = {"global_batch_size": plan.global_batch_size, "dtype": plan.dtype, "zero_stage": plan.zero_stage}
    differing = {k: v for k, v in taken.items() if getattr(settings, k) != v}
    for key, value in differing.items():
        print(f"{PROG}: note: scoring uses the plan's {key}={value} (train.{key}={getattr(settings, key)} "
              f"does not apply to a given plan)", file=sys.stderr)
    return plan, dataclasses.replace(settings, **taken) if differing else settings


def _write_outputs(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec", settings: "TrainSettings",
                   output: dict[str, Any]) -> list[Path]:
    written: list[Path] = []
    out_dir: Path = output["dir"]
    if output["plan"] is not None:
        written.append(plan.save(out_dir / output["plan"]))
    if output["ds_config"]:
        from het_strategy.ds_runtime.config import write_deepspeed_files

        written.extend(write_deepspeed_files(plan, settings, score, out_dir))
    if output["plot"]:
        from het_strategy.report.picture import plot_plan

        stem = Path(output["plan"]).stem if output["plan"] else "plan"
        written.append(plot_plan(plan, cluster, out_dir / f"{stem}.png"))
    return written


def _usage() -> str:
    return _USAGE.format(clusters=", ".join(shipped_names("cluster")) or "-",
                         models=", ".join(shipped_names("model")) or "-")


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of ``het-plan``; returns the exit code (2 for bad input)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(_usage())
        return 0
    show_cfg = "--cfg" in args
    args = [a for a in args if a != "--cfg"]
    unknown = [a for a in args if a.startswith("-")]

    def body() -> int:
        if unknown:
            raise ConfigError(f"option {unknown[0]!r} is not known; {PROG} takes --cfg, --help and "
                              "key=value overrides", field="argv", value=unknown[0])
        cfg = compose_plan_config(args)
        if show_cfg:
            print(OmegaConf.to_yaml(cfg), end="")
            return 0
        run_plan(cfg)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
