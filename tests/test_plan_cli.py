"""het-plan: Hydra composition, plan.json round trip, scoring a given plan, exit code 2 on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from het_strategy.cli._common import cluster_from_cfg, workload_from_cfg
from het_strategy.cli.plan_cli import compose_plan_config, main, plan_or_score
from het_strategy.cli.plan_config import register_plan_schema, typed_plan_config
from het_strategy.core.cluster import load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest

SHIPPED = ["cluster=local_cpu4_mixed", "model=tiny_gpt"]  # 4 CPU ranks (rank0..rank3), 6 layers


def _hand_plan(cluster_name: str = "local_cpu4_mixed", shares=(24, 24, 12, 4)) -> Plan:
    """A pure-DP plan over the shipped 4-rank cluster, made by hand."""
    cluster, workload = load_cluster(cluster_name), load_workload("tiny_gpt")
    pipes = [Pipeline((Stage((d.name,), (0, workload.num_layers)),), 4, n)
             for d, n in zip(cluster.devices, shares) if n]
    return Plan(cluster=cluster.name, cluster_devices=[d.name for d in cluster.devices], model=workload.fingerprint(),
                global_batch_size=sum(shares), pipelines=pipes, mode="manual")


def _write_cluster(path: Path, devices: str) -> Path:
    path.write_text(f"inter_node_bandwidth_gbs: 10\nnodes:\n  - name: n\n    devices: {devices}\n")
    return path


def test_compose_api_plans_writes_plan_json_and_scores_it_back(tmp_path: Path):
    register_plan_schema()  # the schema plan.yaml's defaults list names (het-plan registers it itself)
    with initialize_config_module(version_base="1.3", config_module="het_strategy.configs"):
        cfg = compose("plan", overrides=[*SHIPPED, "settings.global_batch_size=32", f"output.dir={tmp_path}"])
    plan, score = plan_or_score(cfg, echo=False)
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.to_dict() == json.loads((tmp_path / "plan.json").read_text())
    assert loaded.global_batch_size == 32 and sum(p.samples for p in loaded.pipelines) == 32
    assert loaded.predicted["step_time_s"] == pytest.approx(score.step_time_s, rel=1e-12)

    with initialize_config_module(version_base="1.3", config_module="het_strategy.configs"):
        cfg2 = compose("plan", overrides=[*SHIPPED, f"score={tmp_path / 'plan.json'}", f"output.dir={tmp_path}",
                                          "output.plan=scored.json"])
    rescored, score2 = plan_or_score(cfg2, echo=False)
    assert score2.step_time_s == pytest.approx(score.step_time_s, rel=1e-12)
    assert Plan.load(tmp_path / "scored.json").pipelines == loaded.pipelines


def test_score_option_uses_the_same_cost_model(tmp_path: Path):
    hand = _hand_plan()
    hand.save(tmp_path / "hand.json")
    cfg = compose_plan_config([*SHIPPED, f"score={tmp_path / 'hand.json'}", f"output.dir={tmp_path}",
                               "output.plan=out.json", "output.ds_config=true"])
    plan, score = plan_or_score(cfg, echo=False)
    expected = CostModel(load_cluster("local_cpu4_mixed"), load_workload("tiny_gpt"),
                         TrainSettings(global_batch_size=64)).score(hand)
    assert score.step_time_s == pytest.approx(expected.step_time_s, rel=1e-12)
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["rank_shares"] == {"rank0": 24, "rank1": 24, "rank2": 12, "rank3": 4}
    assert written["predicted"]["step_time_s"] == pytest.approx(expected.step_time_s, rel=1e-12)
    assert isinstance(json.loads((tmp_path / "ds_config.json").read_text()), dict)


def test_overrides_reach_the_specs():
    cfg = compose_plan_config([*SHIPPED, "cluster.inter_node_bandwidth_gbs=5", "model.num_layers=2",
                               "settings.zero_stage=1", "settings.micro_batch_sizes=[2,4]"])
    cluster = cluster_from_cfg(cfg)
    assert cluster.name == "local_cpu4_mixed" and cluster.inter_node_bandwidth_gbs == 5
    typed = typed_plan_config(cfg)
    settings = typed.settings
    assert typed.planner == PlanRequest() and isinstance(settings, TrainSettings)
    assert (settings.zero_stage, settings.micro_batch_sizes, settings.global_batch_size) == (1, (2, 4), 64)
    workload = workload_from_cfg(cfg, settings.dtype)
    assert workload.name == "tiny_gpt" and workload.num_layers == 4  # embedding + 2 blocks + head


def test_cluster_given_as_a_yaml_path_takes_further_overrides(tmp_path: Path):
    path = _write_cluster(tmp_path / "my_box.yaml", "[{type: T4, count: 3}]")
    cfg = compose_plan_config([f"cluster={path}", "cluster.inter_node_bandwidth_gbs=3", "model=tiny_gpt"])
    cluster = cluster_from_cfg(cfg)
    assert cluster.name == "my_box" and cluster.inter_node_bandwidth_gbs == 3
    assert [d.type for d in cluster.devices] == ["T4"] * 3


def _bad_cases():
    def typ(tmp):
        return [f"cluster={_write_cluster(tmp / 'c.yaml', '[{type: B9000}]')}"], ["nodes[0].devices[0].type", "B9000"]

    def neg(tmp):
        return [f"cluster={_write_cluster(tmp / 'c.yaml', '[{type: T4, memory_gb: -4}]')}"], ["memory_gb` is -4", "> 0"]

    def dup(tmp):
        devs = "[{type: T4, name: gpu}, {type: T4, name: gpu}]"
        return [f"cluster={_write_cluster(tmp / 'c.yaml', devs)}"], ["devices[1].name` is 'gpu'", "unique"]

    def wrong_type(tmp):
        devs = '[{type: T4, memory_gb: "lots"}]'
        return [f"cluster={_write_cluster(tmp / 'c.yaml', devs)}"], ["memory_gb` is 'lots'", "be a number"]

    def unknown_key(tmp):
        return ["settings.global_bach_size=3"], ["`settings.global_bach_size`", "unknown key", "global_batch_size"]

    def unknown_cluster(tmp):
        return ["cluster=no_such_cluster"], ["`cluster` is 'no_such_cluster'", "local_cpu4_mixed"]

    def other_cluster_plan(tmp):
        _hand_plan("local_cpu4_mixed").save(tmp / "p.json")
        return ["cluster=local_cpu2", f"score={tmp / 'p.json'}"], ["rank2", "name a device of cluster `local_cpu2`"]

    def batch_below_ranks(tmp):
        return (["cluster=local_cpu4_mixed", "settings.global_batch_size=2", "planner.mode=dp"],
                ["`settings.global_batch_size` is 2", "rank"])

    def unknown_runtime(tmp):
        return ["planner.runtime=fast"], ["`planner.runtime` is 'fast'", "any, deepspeed"]

    return [
        pytest.param(unknown_runtime, id="unknown-runtime"),
        pytest.param(typ, id="unknown-device-type"),
        pytest.param(neg, id="negative-memory"),
        pytest.param(dup, id="duplicate-device-names"),
        pytest.param(wrong_type, id="wrong-yaml-type"),
        pytest.param(unknown_key, id="unknown-override-key"),
        pytest.param(unknown_cluster, id="unknown-cluster-name"),
        pytest.param(other_cluster_plan, id="plan-for-another-cluster"),
        pytest.param(batch_below_ranks, id="batch-below-ranks"),
    ]


@pytest.mark.parametrize("case", _bad_cases())
def test_bad_input_exits_2_with_one_line(case, tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides, expected = case(tmp_path)
    code = main(["model=tiny_gpt", *overrides])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("het-plan: error: ") and err.count("\n") == 1, err
    for piece in expected:
        assert piece in err
    assert "Traceback" not in out + err
    assert not (tmp_path / "plan.json").exists()


def test_plan_or_score_raises_config_error_for_bad_train_values():
    with pytest.raises(ConfigError, match="`settings.activation_checkpointing` is 'maybe'; it must be true or false"):
        compose_plan_config([*SHIPPED, "settings.activation_checkpointing=maybe"])
    with pytest.raises(ConfigError, match="`planner.mode` is 'fast'; it must be one of auto, dp, pipeline, hybrid"):
        compose_plan_config([*SHIPPED, "planner.mode=fast"])
    with pytest.raises(ConfigError, match="`planner.profile` is 'mine'; it must be one of sailor, measured or null"):
        compose_plan_config([*SHIPPED, "planner.profile=mine"])
    with pytest.raises(ConfigError, match=r"`train[.\w]*` is .*; it must not be there: .*settings"):
        compose_plan_config([*SHIPPED, "train.dtype=fp32"])  # the section is `settings`
    with pytest.raises(ConfigError, match="`planner.budget_per_hour` is -1.0; it must be null or a number > 0"):
        plan_or_score(compose_plan_config([*SHIPPED, "planner.budget_per_hour=-1"]), echo=False)


def test_help_and_cfg_print_without_planning(capsys):
    assert main(["--help"]) == 0
    assert "local_cpu4_mixed" in capsys.readouterr().out  # shipped clusters are listed
    assert main(["--cfg", *SHIPPED, "settings.global_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "global_batch_size: 8" in out and "emulated_speed: 0.25" in out


def _het_plan_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("het-plan")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("het-plan")
    return [found] if found else [sys.executable, "-m", "het_strategy.cli.plan_cli"]


def test_console_script_scores_a_file_and_writes_only_plan_json(tmp_path: Path):
    (tmp_path / "in").mkdir()
    _hand_plan().save(tmp_path / "in" / "hand.json")
    cluster = tmp_path / "in" / "box.yaml"
    shutil.copy(_shipped_cluster_file("local_cpu4_mixed"), cluster)
    run = subprocess.run([*_het_plan_cmd(), f"cluster={cluster}", "model=tiny_gpt", "score=in/hand.json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "predicted step time" in run.stdout and "rank0" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "plan.json"]  # no outputs/ or .hydra/
    assert "plan for cluster `box` (4 devices, 4 used)" in run.stdout  # named after the file
    assert Plan.load(tmp_path / "plan.json").rank_shares() == {"rank0": 24, "rank1": 24, "rank2": 12, "rank3": 4}


def test_console_script_bad_cluster_exits_2_without_traceback(tmp_path: Path):
    bad = _write_cluster(tmp_path / "bad.yaml", "[{type: T4, memory_gb: -4}]")
    run = subprocess.run([*_het_plan_cmd(), f"cluster={bad}"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("het-plan: error: `cluster.nodes[0].devices[0].memory_gb` is -4")
    assert "Traceback" not in run.stderr + run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def _shipped_cluster_file(name: str) -> Path:
    from het_strategy.core.shipped import shipped_path

    return shipped_path("cluster", name)


def test_score_never_overwrites_its_input_and_unknown_plan_keys_are_refused(tmp_path: Path):
    hand = _hand_plan()
    hand.save(tmp_path / "plan.json")
    before = (tmp_path / "plan.json").read_text()
    cfg = compose_plan_config([*SHIPPED, f"score={tmp_path / 'plan.json'}", f"output.dir={tmp_path}"])
    plan_or_score(cfg, echo=False)
    assert (tmp_path / "plan.json").read_text() == before  # the input is untouched
    assert Plan.load(tmp_path / "plan.scored.json").predicted["step_time_s"] > 0

    raw = json.loads(before)
    raw["pipelines"][0]["micro_batchsize"] = 2
    (tmp_path / "typo.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"`plan.pipelines\[0\].micro_batchsize` is 2; it must not be there"):
        Plan.load(tmp_path / "typo.json")
    raw = json.loads(before)
    raw["pipelines"][0]["stages"][0]["tp"] = 2
    (tmp_path / "tp.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"plan.pipelines\[0\].stages\[0\].tp"):
        Plan.load(tmp_path / "tp.json")
