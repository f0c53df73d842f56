"""het-plan model=<python path>: the user's own nn.Module profiled, planned, and its plan accepted by the strategy's check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from het_strategy.cli.plan_cli import compose_plan_config, main, plan_or_score
from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Plan
from het_strategy.planning.strategy_plans import data_parallel_plan, estimate_workload
from het_strategy.profiling.model_factory import load_profile_file

_MODELS = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def make():
    return Net()


def make_with_input():
    return Net(), torch.randn(4, 8)


def not_a_model():
    return 3
'''

_CLUSTER = "local_cpu4_mixed"  # 4 CPU ranks rank0..rank3


@pytest.fixture()
def models(tmp_path: Path) -> Path:
    path = tmp_path / "my_models.py"
    path.write_text(_MODELS)
    return path


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [f"cluster={_CLUSTER}", "planner.mode=dp", "settings.global_batch_size=32", "settings.dtype=fp32",
            "model_input.repeats=1", f"output.dir={tmp_path / 'out'}", *extra]


def test_a_file_factory_is_profiled_planned_and_its_plan_passes_the_strategys_check(models: Path, tmp_path: Path):
    cfg = compose_plan_config(_args(tmp_path, f"model={models}:make", "model_input.shape=[4,8]"))
    plan, score = plan_or_score(cfg, echo=False)
    saved = load_profile_file(tmp_path / "out" / "plan.model.json")
    # embedding + 3 blocks + head, FLOPs counted by torch: 2 x in x out per sample for each Linear
    assert [layer.name for layer in saved.workload.layers] == ["embedding", "block0", "block1", "block2", "head"]
    assert saved.workload.layers[1].flops_per_sample == pytest.approx(2 * 16 * 16)
    assert saved.workload.total_params == 8 * 16 + 16 + 3 * (16 * 16 + 16) + 16 * 4 + 4
    loaded = Plan.load(tmp_path / "out" / "plan.json")
    assert loaded.model["num_layers"] == 5 and loaded.model["name"] == "make"
    assert sum(loaded.rank_shares().values()) == 32
    cluster = load_cluster(_CLUSTER)
    # what HeteroStrategy(plan=..., workload=<that workload>) runs at setup: accepted as it is
    checked = data_parallel_plan(cluster, saved.workload, 32, "fp32", given=tmp_path / "out" / "plan.json")
    assert checked.rank_shares() == loaded.rank_shares()
    # without the workload the strategy estimates a one-layer model and refuses the plan: hence plan.model.json
    with pytest.raises(ConfigError, match="plan.model.num_layers"):
        data_parallel_plan(cluster, estimate_workload("Net", 1000, 1, "fp32"), 32, "fp32", given=loaded)


def test_a_module_factory_returning_its_sample_input_needs_no_shape(models: Path, tmp_path: Path, monkeypatch,
                                                                    capsys):
    monkeypatch.syspath_prepend(str(models.parent))
    assert main(_args(tmp_path, "model=my_models:make_with_input")) == 0
    out = capsys.readouterr().out
    assert "model `make_with_input` (5 layers" in out and "plan.model.json" in out
    assert json.loads((tmp_path / "out" / "plan.model.json").read_text())["micro_batch"] == 4


@pytest.mark.parametrize("model,extra,expected", [
    ("{models}:make", [], "`model_input.shape` is null"),
    ("{models}:make", ["model_input.shape=[4,0]"], "`model_input.shape` is [4, 0]"),
    ("{models}:make", ["model_input.shape=[4,8]", "model_input.dtype=float8"], "`model_input.dtype` is 'float8'"),
    ("{models}:make", ["model_input.shape=[4,9]"], "`model_input` is"),
    ("{models}:not_a_model", [], "return an nn.Module or (nn.Module, sample_input)"),
    ("{models}:missing", [], "has no callable `missing`"),
    ("{tmp}/nowhere.py:make", [], "be an existing Python file (no such file)"),
    ("no_such_package_xyz.models:make", [], "be importable"),
])
def test_bad_model_factories_exit_2_with_one_line(model, extra, expected, models: Path, tmp_path: Path, capsys):
    spec = model.format(models=models, tmp=tmp_path)
    assert main(_args(tmp_path, f"model={spec}", *extra)) == 2
    err = capsys.readouterr().err
    assert err.startswith("het-plan: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert not (tmp_path / "out" / "plan.json").exists()


def test_a_saved_profile_plans_as_its_model_did(models: Path, tmp_path: Path, capsys):
    """``model=<file.model.json>`` (what het-plan writes beside a plan, and benchmarks/gpu_calibration.py per GPU):
    the saved layers and measured times give the plan the profiled model gave, without profiling again."""
    first = compose_plan_config(_args(tmp_path, f"model={models}:make", "model_input.shape=[4,8]",
                                      "model_input.measured_type=CPU"))
    plan, score = plan_or_score(first, echo=False)
    saved = tmp_path / "out" / "plan.model.json"
    again = tmp_path / "again"
    assert main([*_args(again, f"model={saved}")]) == 0
    out = capsys.readouterr().out
    assert "model `make` (5 layers" in out and "measured per-layer times of make for CPU tp 1" in out, out
    replanned = Plan.load(again / "out" / "plan.json")
    assert replanned.rank_shares() == plan.rank_shares() and replanned.model == plan.model
    assert replanned.predicted["step_time_s"] == pytest.approx(score.step_time_s, rel=1e-12)
    assert not (again / "out" / "plan.model.json").exists()  # nothing profiled here: nothing to write beside it


@pytest.mark.parametrize("extra,expected", [
    (["model={tmp}/missing.model.json"], "`model` is"),
    (["model={saved}", "settings.dtype=bf16"], "`settings.dtype` is 'bf16'; it must be fp32, the dtype"),
    (["model={saved}", "planner.profile=sailor"], "`planner.profile` is 'sailor'"),
    (["model={bad}"], "be a model.json written by het-plan"),
])
def test_bad_saved_profiles_exit_2_with_one_line(extra, expected, models: Path, tmp_path: Path, capsys):
    assert main(_args(tmp_path / "first", f"model={models}:make", "model_input.shape=[4,8]")) == 0
    saved, bad = tmp_path / "first" / "out" / "plan.model.json", tmp_path / "bad.model.json"
    bad.write_text('{"workload": {}}')
    capsys.readouterr()
    args = [a.format(tmp=tmp_path, saved=saved, bad=bad) for a in extra]
    assert main(_args(tmp_path / "second", *args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("het-plan: error: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert not (tmp_path / "second" / "out" / "plan.json").exists()
