"""The options that are StrEnums (``Dtype``, ``InputDtype``, het-train's ``Accelerator``, ``MoEPlacement``,
``WandbMode``): one spelling per value, a bad value one clear error through the CLIs (exit 2, one line) and the
Python API (ConfigError naming the full field, the value and the allowed values), and a plan's JSON unchanged."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Callable

import pytest

from het_strategy.cli import plan_cli, train_cli
from het_strategy.cli.plan_config import ModelInputConfig
from het_strategy.cli.train_config import Accelerator, HetTrainConfig, MoEConfig, WandbConfig, WandbMode
from het_strategy.planning.experts import MoEPlacement
from het_strategy.core.cluster import load_cluster
from het_strategy.core.dtypes import DTYPE_BYTES, PRECISION_DTYPES, Dtype, InputDtype
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec, load_workload
from het_strategy.planning import PlanRequest, plan

_PLAN_ARGS = ["cluster=amp_v100_t4", "model=gpt2_amp", "settings.global_batch_size=32"]


def _one_line_error(prog: str, code: int, capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert code == 2, captured.err
    assert err.startswith(f"{prog}: error: ") and "\n" not in err, err
    assert "Traceback" not in captured.out + captured.err
    return err


@pytest.mark.parametrize("override, message", [
    ("settings.dtype=fp64", "`settings.dtype` is 'fp64'; it must be one of fp32, fp16, bf16, per_device"),
    ("settings.dtype=float32", "`settings.dtype` is 'float32'; it must be one of fp32, fp16, bf16, per_device"),
    ("settings.grad_dtype=int8", "`settings.grad_dtype` is 'int8'; it must be one of fp32, fp16, bf16, per_device or null"),
    ("model_input.dtype=float8",
     "`model_input.dtype` is 'float8'; it must be one of float32, float16, bfloat16, float64, int64"),
])
def test_het_plan_refuses_a_bad_option_in_one_line(override: str, message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    err = _one_line_error("het-plan", plan_cli.main([*_PLAN_ARGS, override]), capsys)
    assert err == f"het-plan: error: {message}"
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("override, message", [
    ("accelerator=tpu", "`accelerator` is 'tpu'; it must be one of cpu, cuda"),
    ("moe.placement=random", "`moe.placement` is 'random'; it must be one of planned, uniform"),
    ("wandb.mode=bogus", "`wandb.mode` is 'bogus'; it must be one of offline, online, disabled"),
])
def test_het_train_refuses_a_bad_option_in_one_line(override: str, message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    err = _one_line_error("het-train", train_cli.main(["cluster=local_cpu2", override]), capsys)
    assert err == f"het-train: error: {message}"


def _plan_of(dtype: Any) -> Plan:
    return Plan(cluster="c", cluster_devices=("d0",), model={"num_layers": 2}, global_batch_size=4,
                pipelines=(Pipeline((Stage(("d0",), (0, 2)),), micro_batch_size=4, samples=4),), dtype=dtype)


_LAYERS = load_workload("tiny_gpt").layers


@pytest.mark.parametrize("build, message", [
    (lambda: TrainSettings(8, dtype="fp64"), "`settings.dtype` is 'fp64'; it must be one of fp32, fp16, bf16, per_device"),
    (lambda: TrainSettings(8, dtype=["bf16"]), "`settings.dtype` is ['bf16']; it must be one of fp32, fp16, bf16, per_device"),
    (lambda: TrainSettings(8, grad_dtype="int8"),
     "`settings.grad_dtype` is 'int8'; it must be one of fp32, fp16, bf16 or null"),
    (lambda: _plan_of("float16"), "`plan.dtype` is 'float16'; it must be one of fp32, fp16, bf16, per_device"),
    (lambda: WorkloadSpec("m", _LAYERS, 8, dtype="fp8"), "`model.dtype` is 'fp8'; it must be one of fp32, fp16, bf16, per_device"),
    (lambda: load_workload("tiny_gpt", dtype="half"), "`model.dtype` is 'half'; it must be one of fp32, fp16, bf16, per_device"),
    (lambda: ModelInputConfig(dtype="float8"),
     "`model_input.dtype` is 'float8'; it must be one of float32, float16, bfloat16, float64, int64"),
    (lambda: HetTrainConfig(accelerator="tpu"), "`accelerator` is 'tpu'; it must be one of cpu, cuda"),
    (lambda: MoEConfig(placement="random"), "`moe.placement` is 'random'; it must be one of planned, uniform"),
    (lambda: WandbConfig(mode="bogus"), "`wandb.mode` is 'bogus'; it must be one of offline, online, disabled"),
])
def test_the_python_api_refuses_a_bad_option_naming_the_field(build: Callable[[], Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert str(info.value) == message


@pytest.mark.parametrize("build, attr, kind", [
    (lambda: TrainSettings(8, dtype="fp16"), "dtype", Dtype),
    (lambda: TrainSettings(8, grad_dtype="bf16"), "grad_dtype", Dtype),
    (lambda: _plan_of("fp32"), "dtype", Dtype),
    (lambda: load_workload("tiny_gpt", dtype="fp16"), "dtype", Dtype),
    (lambda: ModelInputConfig(dtype="int64"), "dtype", InputDtype),
    (lambda: HetTrainConfig(accelerator="cuda"), "accelerator", Accelerator),
    (lambda: MoEConfig(placement="uniform"), "placement", MoEPlacement),
    (lambda: WandbConfig(mode="disabled"), "mode", WandbMode),
])
def test_a_string_becomes_the_member_and_still_equals_the_string(build: Callable[[], Any], attr: str,
                                                                 kind: type[Enum]) -> None:
    value = getattr(build(), attr)
    assert type(value) is kind
    assert value == value.value and str(value) == value.value and f"{value}" == value.value


def test_every_option_enum_has_one_spelling_its_name() -> None:
    """Hydra matches an enum value by member name, and a member hashes as its name: name == value keeps a
    member and its string interchangeable as dict keys (``DTYPE_BYTES["fp32"]``)."""
    for kind in (Dtype, InputDtype, Accelerator, MoEPlacement, WandbMode):
        assert all(m.name == m.value for m in kind), kind
    assert DTYPE_BYTES["fp32"] == Dtype.fp32.bytes == 4 and DTYPE_BYTES["bf16"] == DTYPE_BYTES[Dtype.fp16] == 2
    assert set(PRECISION_DTYPES.values()) == set(Dtype) and all(type(v) is Dtype for v in PRECISION_DTYPES.values())


def _has_enum(value: Any) -> bool:
    if isinstance(value, Enum):
        return True
    if isinstance(value, dict):
        return any(_has_enum(k) or _has_enum(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_enum(v) for v in value)
    return False


def test_a_plan_on_disk_is_unchanged_and_round_trips(tmp_path: Path) -> None:
    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="fp16")
    made = plan(cluster, workload, TrainSettings(32, dtype="fp16", grad_dtype="bf16"), PlanRequest(mode="dp")).plan
    assert made.dtype is Dtype.fp16
    raw = made.to_dict()
    assert not _has_enum(raw)  # builtin types only: torch.load(weights_only=True) of a checkpoint holding it
    path = made.save(tmp_path / "plan.json")
    on_disk = json.loads(path.read_text())
    assert on_disk["dtype"] == "fp16" and on_disk["predicted"]["grad_dtype"] == "bf16"
    again = Plan.load(path)
    assert again.dtype is Dtype.fp16 and again.to_dict() == on_disk == json.loads(made.to_json())


def test_a_plan_file_written_before_the_enums_still_loads(tmp_path: Path) -> None:
    old = {"schema_version": 1, "cluster": "c", "cluster_devices": ["d0", "d1"], "model": {"num_layers": 2},
           "global_batch_size": 4, "mode": "dp", "dtype": "bf16", "zero_stage": 0,
           "pipelines": [{"micro_batch_size": 2, "num_micro_batches": 1, "samples": 2,
                          "stages": [{"devices": ["d0"], "layers": [0, 2], "tp": 1}]},
                         {"micro_batch_size": 2, "num_micro_batches": 1, "samples": 2,
                          "stages": [{"devices": ["d1"], "layers": [0, 2], "tp": 1}]}],
           "rank_shares": {"d0": 2, "d1": 2}, "predicted": {"step_time_s": 1.0, "grad_dtype": "fp32"}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old, indent=2) + "\n")
    loaded = Plan.load(path)
    assert loaded.dtype == "bf16" and loaded.dtype is Dtype.bf16
    assert loaded.to_dict() == old
    no_dtype = {k: v for k, v in old.items() if k != "dtype"}  # the field is optional: bf16
    assert Plan.from_dict(no_dtype).dtype is Dtype.bf16
