"""``het-plan``: cluster + model + global batch -> a Plan (table, plan.json, options).

Usage (every field of ``configs/plan.yaml`` can be overridden Hydra-style; docs/guide/het-plan.md has more)::

    het-plan cluster=sailor_a100_v100_32_96 model=opt350 settings.global_batch_size=256
    het-plan cluster=./my_cluster.yaml planner.mode=dp output.ds_config=true output.plot=true
    het-plan planner.objective=cost planner.min_throughput=200   # least $/iteration at >= 200 samples/s
    het-plan score=plan.json                               # score a given plan, no search
    het-plan model=my_models.py:make_net model_input.shape=[4,1,28,28]   # your own nn.Module
    het-plan model=./Meta-Llama-3-8B/config.json model.seq_len=4096   # a Hugging Face config (or its directory)
    het-plan --cfg                                         # print the composed config and stop

Steps of one run:

1. compose the config (Hydra's compose API: no output folders, no change of cwd) against the structured schema
   ``cli/plan_config.HetPlanConfig``, checked while Hydra composes and on construction;
2. build the ClusterSpec and the WorkloadSpec (``model=<python path>``: that model's profile, written next to the
   plan as ``<plan>.model.json``; ``model=<config.json or directory>``: a Hugging Face config at ``model.seq_len``
   tokens, ``hf_fields.DEFAULT_SEQ_LEN`` when not given), and the measured profile ``planner.profile`` names;
3. ``planning.plan`` — or, with ``score=<file>``, that plan checked against this cluster and model and
   ``planning.rescore``d with the same cost model;
4. print the table; write ``output.dir/output.plan`` atomically and, when asked, the DeepSpeed files and the picture.

Bad input (cluster, model, batch, overrides, plan file) prints one line ``het-plan: error: ...`` on stderr and
exits with code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from het_strategy.cli._common import (
    compose_config,
    cluster_from_cfg,
    run_cli,
    workload_from_cfg,
)
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.shipped import shipped_names

if TYPE_CHECKING:
    from het_strategy.cli.plan_config import ModelInputConfig, PlanOutputConfig
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan_score import PlanScore
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
    from het_strategy.planning.request import PlanRequest
    from het_strategy.profiling.model_factory import SavedProfile
    from het_strategy.profiling.module_profile import ProfileResult

__all__ = ["PROG", "CONFIG_NAME", "compose_plan_config", "plan_or_score", "main"]

PROG = "het-plan"
CONFIG_NAME = "plan"
PROFILE_SUFFIX = ".model.json"
"""``model=<file>`` with this suffix names a saved profile (``ProfileResult.to_dict``)."""
_PYTHON_PATH = re.compile(r"^(?:[A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)*|.+\.py):[A-Za-z_]\w*$")

_USAGE = f"""usage: {PROG} [--cfg] [key=value ...]

Plan training of a model on a heterogeneous cluster; print a table and write plan.json.

overrides (Hydra syntax; see configs/plan.yaml for every field):
  cluster=<name|file.yaml>      shipped: {{clusters}}
  model=<name|file.yaml>        shipped: {{models}}
  model=<module:function>       your own nn.Module (package.module:function or file.py:function), profiled;
                                model_input.shape=[4,1,28,28] model_input.dtype=float32 unless the
                                function returns (module, sample_input)
  model=<config.json|model dir> a Hugging Face causal LM's config (llama, mistral, qwen2, qwen3, mixtral,
                                qwen2_moe, qwen3_moe, gpt2), read as JSON; model.seq_len=N tokens per sample
                                (default {{seq_len}}, at most the model's max_position_embeddings)
                                planner.profile=measured: built from the config (random init) and timed per
                                layer here at settings.micro_batch_sizes (model_input.repeats passes)
  model=<file.model.json>       a model profiled before (written beside a plan, or by
                                benchmarks/gpu_calibration.py): its layers, and its measured times for the
                                device type it was measured on
  settings.global_batch_size=N  settings.dtype=bf16|fp16|fp32   settings.zero_stage=0..3
  settings.max_tp=1|2|4|8       settings.micro_batch_sizes=[1,2,4,8]   settings.activation_checkpointing=true
  planner.mode=auto|dp|pipeline|hybrid|fsdp|low_communication   planner.profile=null|sailor|measured
  planner.runtime=any|deepspeed|hetero|hetero_diloco|hetero_fsdp
  planner.mode=fsdp             fully sharded data parallelism (hetero_fsdp): shares by speed, each rank's shard
                                of every parameter by its free memory (the table shows both)
  planner.objective=time|cost   planner.budget_per_hour=USD   planner.min_throughput=samples/s
                                cost: least $/iteration (idle devices not rented); budget: cap on the used
                                devices' $/hour; min_throughput: floor on samples/s
  planner.compression=none|joint  joint: placement and inter-node compression planned together (dp)
  planner.mode=low_communication  groups (nodes) exchanging every H steps (hetero_diloco), printed beside the
                                synchronous plan with a recommendation; budget: planner.outer_sync.max_inner_steps=500
                                planner.outer_sync.max_sync_overhead=0.05 planner.outer_sync.codecs=[none,fp16,q8,q4]
                                planner.outer_sync.groups=node|device|[[a0,a1],[b0,b1]]
                                planner.outer_sync.split=planned|even
  score=<plan.json>             score this plan with the same cost model instead of searching
                                (written as <name>.scored.json when output.plan would overwrite it)
  output.dir=.  output.plan=plan.json  output.ds_config=true  output.plot=true

options:
  --cfg       print the composed config and exit
  -h, --help  show this help and exit

Bad input exits with code 2 and one line naming the field, the value and the rule.
"""


def compose_plan_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed ``plan`` config with ``overrides`` (``cluster=<file.yaml>``, ``model=<python path>`` accepted).

    ``model=<python path>`` becomes ``cfg.model = {name, factory}`` and ``model=<file.model.json>``
    ``cfg.model = {name, profile_file}`` (Hydra would look for a group option).
    """
    overrides = [str(o) for o in overrides]
    special = [o for o in overrides if _is_model_factory(o) or _is_profile_file(o) or _is_hf_config(o)]
    rest = [o for o in overrides if o not in special]
    hf = special and _is_hf_config(special[-1])  # the last model= given wins, as with any override
    seq_len = _hf_seq_len(rest) if hf else None
    if hf:
        rest = [o for o in rest if o.partition("=")[0].lstrip("+~") != "model.seq_len"]
    from het_strategy.cli.plan_config import register_plan_schema

    register_plan_schema()  # the structured schema plan.yaml's defaults list starts with
    cfg = compose_config(CONFIG_NAME, rest)
    if special:
        value = special[-1].partition("=")[2]
        with open_dict(cfg):
            if hf:
                cfg["model"] = {"name": None, "hf_config": value, "seq_len": seq_len}
            elif value.endswith(PROFILE_SUFFIX):
                cfg["model"] = {"name": Path(value).name[:-len(PROFILE_SUFFIX)], "profile_file": value}
            else:
                cfg["model"] = {"name": value.rpartition(":")[2], "factory": value}
    return cfg


def _is_hf_config(override: str) -> bool:
    """``model=<config.json>`` or ``model=<directory>`` (a Hugging Face model's config or its directory)."""
    from het_strategy.core.hf_fields import hf_config_path

    key, sep, value = override.partition("=")
    return bool(sep) and key == "model" and (os.path.isdir(Path(value).expanduser())
                                             or hf_config_path(value) is not None)


def _hf_seq_len(overrides: Sequence[str]) -> int | None:
    """``model.seq_len=N`` among ``overrides`` (the last one), for ``model=<config.json>``; any other
    ``model.<key>`` is refused: the config's own fields describe the model."""
    seq_len = None
    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        if key == "model.seq_len":
            if not re.fullmatch(r"\d+", value.strip()):
                raise field_error("model.seq_len", value, "be a whole number of tokens per sample")
            seq_len = int(value)
        elif key.startswith("model."):
            raise field_error(key, value, "not be set with model=<config.json>: the config's own fields describe "
                              "the model", "only model.seq_len is set here; edit the config for the rest")
    return seq_len


def _is_profile_file(override: str) -> bool:
    key, sep, value = override.partition("=")
    return bool(sep) and key == "model" and value.endswith(PROFILE_SUFFIX)


def _is_model_factory(override: str) -> bool:
    key, sep, value = override.partition("=")
    return bool(sep) and key == "model" and not value.lower().endswith((".yaml", ".yml")) \
        and bool(_PYTHON_PATH.match(value))


def _requested_profile(request: "PlanRequest", workload: "WorkloadSpec",
                       measured: "MeasuredProfile | None") -> "MeasuredProfile | None":
    """The profile the planner prices with: ``planner.profile=sailor`` loads Sailor's (the planning core reads no
    reference data), else the model's own or the one measured here (``planner.profile=measured``), if any."""
    if request.profile is None or request.profile == "measured":
        return measured
    from het_strategy.reference.sailor_profiles import request_profile

    return request_profile(request, workload, measured)


def plan_or_score(cfg: DictConfig, *, echo: bool = True) -> "tuple[Plan, PlanScore]":
    """Plan (or score ``cfg.score``), print the table when ``echo``, write the requested files.

    Paths in ``cfg.output`` and ``cfg.score`` are relative to the current directory.
    Raises ``ConfigError`` for every bad input.
    """
    from het_strategy.cli.plan_config import typed_plan_config
    from het_strategy.planning import plan, rescore
    from het_strategy.report.table import plan_table

    typed = typed_plan_config(cfg)
    output = _output_settings(typed.output)
    request, settings = typed.planner, typed.settings
    cluster = cluster_from_cfg(cfg)
    made = _factory_model(cfg, typed.model_input)
    factory = made[0] if made is not None else None
    saved = _saved_profile(cfg, settings)
    if made is None and saved is None:
        workload, measured = workload_from_cfg(cfg, dtype=settings.dtype), None
        if request.profile == "measured":
            measured = _hf_measured_profile(cfg, workload, settings, typed.model_input)
    else:
        if request.profile is not None:
            raise field_error("planner.profile", str(request.profile), "be null with model=<python path> or "
                              "model=<file.model.json> (the model's own profile prices it; planner.profile names "
                              "Sailor's profiles of shipped models, or measured: a Hugging Face config timed here)")
        if saved is not None:
            workload, measured = saved.workload, saved.profile
        else:
            workload, measured = made[0].workload, made[0].profile if made[1] else None

    score_path = cfg.get("score")
    if request.mode == "low_communication" and output["ds_config"]:
        raise field_error("output.ds_config", True, "be false with planner.mode=low_communication (DeepSpeed does "
                          "not run low-communication plans; strategy=hetero_diloco runs plan.json)")
    if score_path is not None:
        if request.searches_sub_clusters:
            key = next(k for k in ("budget_per_hour", "min_throughput") if getattr(request, k) is not None) \
                if request.objective == "time" else "objective"
            raise field_error(f"planner.{key}", getattr(request, key), "stay at its default (objective time, no budget_per_hour or min_throughput) when score= "
                              "is given (a given plan is scored, not searched)")
        given, settings = _load_plan_to_score(str(score_path), cluster, workload, settings)
        result = rescore(given, cluster, workload, settings, _requested_profile(request, workload, measured))
        if output["plan"] is not None and (output["dir"] / output["plan"]).resolve() == Path(score_path).resolve():
            output["plan"] = f"{Path(output['plan']).stem}.scored.json"  # the scored plan never overwrites its input
    else:
        result = plan(cluster, workload, settings, request, _requested_profile(request, workload, measured))
    chosen, score, line = result.plan, result.score, result.summary()

    # files first: a closed stdout (``het-plan | head``) must not cost the user the plan
    written = _write_outputs(chosen, score, cluster, settings, output)
    if factory is not None and output["plan"] is not None:
        from het_strategy.core.atomic_file import write_atomic

        target = output["dir"] / f"{Path(output['plan']).stem}.model.json"
        written.append(write_atomic(target, json.dumps(factory.to_dict(), indent=2) + "\n"))
    if echo:
        if result.low_communication is not None:
            from het_strategy.report.low_communication_report import low_communication_report

            print(low_communication_report(result, cluster))
        else:
            hf_line = _hf_model_line(cfg, workload)
            if hf_line:
                print(hf_line)
            print(plan_table(chosen, score, cluster))
            if line:
                print(line)
        if written:
            print("\nwrote " + ", ".join(str(p) for p in written))
    return chosen, score


def _hf_model_line(cfg: DictConfig, workload: "WorkloadSpec") -> str | None:
    """One line above the table for ``model=<config.json>``: the config, its parameters and the sequence length
    planned (None for another model)."""
    node = cfg.get("model")
    source = node.get("hf_config") if isinstance(node, (DictConfig, dict)) else None
    if source is None:
        return None
    active = f", {workload.active_params_per_token / 1e9:.2f} B active per token" if workload.is_moe else ""
    given = "model.seq_len" if node.get("seq_len") is not None else "the default; set model.seq_len=N"
    return (f"model: {workload.name} from {source}: {workload.total_params / 1e9:.2f} B parameters{active}, "
            f"{workload.num_layers - 2} decoder layers; seq_len {workload.seq_len} tokens ({given})")


def _hf_measured_profile(cfg: DictConfig, workload: "WorkloadSpec", settings: "TrainSettings",
                         model_input: "ModelInputConfig") -> "MeasuredProfile":
    """``planner.profile=measured``: the Hugging Face model of ``model=<config.json>`` built here and timed per
    layer at ``settings.micro_batch_sizes`` and the workload's seq_len (``hf.layer_profile``), filed under this
    machine's device type (or ``model_input.measured_type``); ``model_input.repeats`` timed passes."""
    node = cfg.get("model")
    source = node.get("hf_config") if isinstance(node, (DictConfig, dict)) else None
    if source is None:
        raise field_error("planner.profile", "measured", "go with model=<config.json or model directory> (the "
                          "Hugging Face model it builds is timed here)", "model=<file.py:function> is always "
                          "profiled; for a model YAML use planner.profile=null or sailor")
    if str(settings.dtype) not in ("fp32", "fp16", "bf16"):
        raise field_error("settings.dtype", str(settings.dtype), "be fp32, fp16 or bf16 with planner.profile="
                          "measured (the dtype the model is built and timed in)")
    from het_strategy.hf.layer_profile import profile_hf_model

    return profile_hf_model(str(source), workload.seq_len, settings.micro_batch_sizes, dtype=str(settings.dtype),
                            repeats=model_input.repeats, device_type=model_input.measured_type,
                            field="model").profile


def _output_settings(out: "PlanOutputConfig") -> dict[str, Any]:
    """The ``output`` section with its folder resolved; a folder path through an existing file is refused."""
    folder = Path(out.dir).expanduser()
    for above in (folder, *folder.parents):
        if above.exists() and not above.is_dir():
            raise field_error("output.dir", out.dir, f"be a folder path; {above} is an existing file",
                              "name a folder (it is created when missing)")
    return {"dir": folder, "plan": out.plan, "ds_config": out.ds_config, "plot": out.plot}


def _load_plan_to_score(path: str, cluster: "ClusterSpec", workload: "WorkloadSpec",
                        settings: "TrainSettings") -> "tuple[Plan, TrainSettings]":
    """Load a plan file, check it matches cluster and model; its batch, dtype and ZeRO stage take over."""
    from het_strategy.core.plan import Plan

    plan = Plan.load(path, field="score")
    plan.check_against(cluster, workload)  # the plan's cluster first (its devices in rank order), then its model
    if plan.cluster != cluster.name:  # same devices in the same order (a renamed copy of the file): say so only
        print(f"{PROG}: note: the plan was made for cluster `{plan.cluster}`; scoring it on `{cluster.name}`, "
              "which has the same device names in the same order", file=sys.stderr)
    taken = {"global_batch_size": plan.global_batch_size, "dtype": plan.dtype, "zero_stage": plan.zero_stage}
    differing = {k: v for k, v in taken.items() if getattr(settings, k) != v}
    for key, value in differing.items():
        print(f"{PROG}: note: scoring uses the plan's {key}={value} (settings.{key}={getattr(settings, key)} "
              f"does not apply to a given plan)", file=sys.stderr)
    return plan, dataclasses.replace(settings, **taken) if differing else settings


def _saved_profile(cfg: DictConfig, settings: "TrainSettings") -> "SavedProfile | None":
    """The profile ``model=<file.model.json>`` names (None otherwise); its times were measured in its model's
    dtype, so ``settings.dtype`` must be that dtype."""
    node = cfg.get("model")
    path = node.get("profile_file") if isinstance(node, (DictConfig, dict)) else None
    if path is None:
        return None
    from het_strategy.profiling.model_factory import load_profile_file

    saved = load_profile_file(str(path), field="model")
    if str(settings.dtype) != str(saved.workload.dtype):
        raise field_error("settings.dtype", str(settings.dtype), f"be {saved.workload.dtype}, the dtype {path} "
                          "was measured in", f"set settings.dtype={saved.workload.dtype}")
    return saved


def _factory_model(cfg: DictConfig, model_input: "ModelInputConfig") -> "tuple[ProfileResult, bool] | None":
    """The profile of ``model=<python path>`` (None for a model YAML), and whether its measured times price a
    device type of the cluster (``model_input.measured_type``); ``model_input`` describes its input."""
    node = cfg.get("model")
    factory = node.get("factory") if isinstance(node, (DictConfig, dict)) else None
    if factory is None:
        return None
    from het_strategy.core.errors import fields_under
    from het_strategy.profiling.model_factory import profile_factory

    with fields_under("model_input", "blocks"):
        result = profile_factory(str(factory), model_input.shape, str(model_input.dtype), blocks=model_input.blocks,
                                 repeats=model_input.repeats, device_type=model_input.measured_type)
    return result, model_input.measured_type is not None  # else: the counted FLOPs and the cluster's figures


def _write_outputs(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec", settings: "TrainSettings",
                   output: dict[str, Any]) -> list[Path]:
    written: list[Path] = []
    out_dir: Path = output["dir"]
    if output["plan"] is not None:
        try:
            written.append(plan.save(out_dir / output["plan"]))
        except OSError as exc:
            raise field_error("output.dir", str(out_dir), f"be a folder het-plan can write into ({exc.strerror})") \
                from None
    if output["ds_config"]:
        from het_strategy.ds_runtime.ds_config import write_deepspeed_files

        written.extend(write_deepspeed_files(plan, settings, score, out_dir))
    if output["plot"]:
        from het_strategy.report.picture import plot_plan

        stem = Path(output["plan"]).stem if output["plan"] else "plan"
        written.append(plot_plan(plan, cluster, out_dir / f"{stem}.png", figures=score))
    return written


def _usage() -> str:
    from het_strategy.core.hf_fields import DEFAULT_SEQ_LEN

    return _USAGE.format(clusters=", ".join(shipped_names("cluster")) or "-",
                         models=", ".join(shipped_names("model")) or "-", seq_len=DEFAULT_SEQ_LEN)


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
        plan_or_score(cfg)
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
