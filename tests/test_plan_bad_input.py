"""Cluster files and het-plan options that could hang, overflow or crash: each one clear error.

het-plan: exit code 2, one line ``het-plan: error: ...``, no traceback, quickly.
API (``load_cluster`` / ``cluster_from_dict``): ``ConfigError`` naming the field.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from het_strategy.cli.plan_cli import main
from het_strategy.core.cluster import cluster_from_dict, load_cluster
from het_strategy.core.cluster_limits import MAX_DEVICES, check_count
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.workload import load_workload

_CASES = {
    "device-count": ("nodes:\n  - name: n\n    devices: [{type: A100-80GB, count: 100000000}]\n",
                     ["`cluster.nodes[0].devices[0].count` is 100000000", f"within {MAX_DEVICES} devices"]),
    "node-count": ("nodes:\n  - name: n\n    count: 100000000\n    devices: [A100-80GB]\n",
                   ["`cluster.nodes[0].count` is 100000000", f"within {MAX_DEVICES} devices"]),
    "counts-multiply": ("nodes:\n  - name: n\n    count: 400000\n    devices: [{type: T4, count: 3}]\n",
                        ["`cluster.nodes[0].count` is 400000", "it would make 1200000"]),
    "alias-loop": ("nodes: &n [{name: n0, devices: *n}]\n",
                   ["YAML alias loop", "`cluster.nodes[0].devices` is `cluster.nodes` again"]),
    "list-node-name": ("nodes:\n  - name: [a, b]\n    devices: [A100-80GB]\n",
                       ["`cluster.nodes[0].name` is ['a', 'b']", "non-empty string"]),
    "list-device-name": ("nodes:\n  - name: n\n    devices: [{type: T4, name: [x]}]\n",
                         ["`cluster.nodes[0].devices[0].name` is ['x']", "non-empty string"]),
    "huge-tflops": ("nodes:\n  - name: n\n    devices: [{type: A100-80GB, tflops: 1.0e+308}]\n",
                    ["`cluster.nodes[0].devices[0].tflops` is 1e+308", "lie in [1e-09, 100000] TFLOPS"]),
    "huge-memory": ("nodes:\n  - name: n\n    devices: [{type: A100-80GB, memory_gb: 1.0e+300}]\n",
                    ["`cluster.nodes[0].devices[0].memory_gb` is 1e+300", "GiB"]),
    "huge-bandwidth": ("inter_node_bandwidth_gbs: 1.0e+200\nnodes:\n  - name: n\n    devices: [T4]\n",
                       ["`cluster.inter_node_bandwidth_gbs` is 1e+200", "GB/s"]),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_cluster_file_exits_2_with_one_line_quickly(case: str, tmp_path: Path, capsys, monkeypatch):
    text, expected = _CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    code = main([f"cluster={path}", "model=tiny_gpt"])
    assert time.perf_counter() - start < 30  # a hang or an endless recursion would fail here
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("het-plan: error: ") and err.count("\n") == 1, err
    for piece in expected:
        assert piece in err, err
    assert str(path) in err  # the message names the file the field is in
    assert "Traceback" not in out + err and "recursion" not in err
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("case", sorted(_CASES))
def test_bad_cluster_file_raises_config_error_through_the_api(case: str, tmp_path: Path):
    text, expected = _CASES[case]
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_cluster(path)
    assert expected[0].split(" is ")[0] in str(info.value) or "alias loop" in str(info.value)
    assert str(path) in str(info.value)


def test_the_device_bound_is_exact():
    assert check_count(MAX_DEVICES // 4, "cluster.nodes[0].count", 0, per_unit=4) == MAX_DEVICES // 4
    with pytest.raises(ConfigError, match=f"it would make {MAX_DEVICES + 4}"):
        check_count(MAX_DEVICES // 4 + 1, "cluster.nodes[0].count", 0, per_unit=4)
    at_bound = cluster_from_dict({"nodes": [{"name": "n", "count": 1024, "devices": [{"type": "T4", "count": 4}]}]})
    assert at_bound.num_devices == 4096
    with pytest.raises(ConfigError, match=f"it would make {MAX_DEVICES + 4}"):
        cluster_from_dict({"nodes": [{"name": "n", "count": MAX_DEVICES // 4 + 1, "devices": [
            {"type": "T4", "count": 4}]}]})


def test_figures_of_a_device_built_in_code_are_bounded_too():
    from het_strategy.core.device_spec import DeviceSpec

    with pytest.raises(ConfigError, match=r"`device `d`.tflops.fp32` is 1e\+300"):
        DeviceSpec("d", "x", "n", {"fp32": 1e300}, 16.0, 900.0, 1.0)


def test_output_dir_that_is_an_existing_file_exits_2(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    for target in ("afile", "afile/sub"):
        assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", f"output.dir={target}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("het-plan: error: `output.dir` is ") and err.count("\n") == 1, err
        assert "is an existing file" in err


def _other_cluster(tmp_path: Path) -> Path:
    """Same device names as local_cpu4_mixed (rank0..rank3) plus one more: another cluster whose names overlap."""
    path = tmp_path / "bigger.yaml"
    devices = "\n".join(f"      - {{name: rank{i}, type: CPU}}" for i in range(5))
    path.write_text(f"nodes:\n  - name: local\n    devices:\n{devices}\n")
    return path


def _plan_for(cluster_name: str, shares=(8, 8, 8, 8)) -> Plan:
    cluster, workload = load_cluster(cluster_name), load_workload("tiny_gpt")
    pipes = [Pipeline((Stage((d.name,), (0, workload.num_layers)),), 4, n) for d, n in zip(cluster.devices, shares)]
    return Plan(cluster=cluster.name, cluster_devices=[d.name for d in cluster.devices], model=workload.fingerprint(),
                global_batch_size=sum(shares), pipelines=pipes, mode="manual")


def test_score_refuses_another_clusters_plan_whose_device_names_overlap(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _plan_for("local_cpu4_mixed").save(tmp_path / "p.json")
    code = main([f"cluster={_other_cluster(tmp_path)}", "model=tiny_gpt", f"score={tmp_path / 'p.json'}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "`plan.cluster_devices` is" in err and "the plan was made for cluster `local_cpu4_mixed`" in err
    # the same device list under another cluster name (a renamed copy of the file) is scored, with a note
    renamed = _plan_for("local_cpu4_mixed")
    renamed.cluster = "someone_else"
    renamed.save(tmp_path / "q.json")
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", f"score={tmp_path / 'q.json'}", "output.plan=null"]) == 0
    assert "the plan was made for cluster `someone_else`" in capsys.readouterr().err
    # and the plan's own cluster is scored (into p.scored.json, never over its input)
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", f"score={tmp_path / 'p.json'}",
                 f"output.dir={tmp_path}", "output.plan=p.json"]) == 0
    assert (tmp_path / "p.scored.json").is_file()


@pytest.mark.parametrize("override, message", [
    ("model_input.shape=x", "`model_input.shape` is 'x'; it must be a list of integers or null"),
    ("model_input.shape=[4,a]", "`model_input.shape[1]` is 'a'; it must be an integer"),
    ("model_input.blocks=3", "`model_input.blocks` is '3'; it must be a list of strings or null"),
    ("model_input.repeats=0", "`model_input.repeats` is 0; it must be >= 1"),
    ("settings.micro_batch_sizes=x", "`settings.micro_batch_sizes` is 'x'; it must be a list of integers"),
    ("settings.micro_batch_sizes=[1,x]", "`settings.micro_batch_sizes[1]` is 'x'; it must be an integer"),
    ("output.dir=''", "`output.dir` is ''; it must be a folder path"),
    ("output.plan=' '", "`output.plan` is ' '; it must be a file name (or null to not write the plan)"),
    ("output.plot=maybe", "`output.plot` is 'maybe'; it must be true or false"),
])
def test_a_bad_typed_section_value_names_the_field_and_its_type(override: str, message: str, tmp_path: Path,
                                                                  capsys, monkeypatch) -> None:
    """The schema's field types are the rules: a list field says so, an item of one is named with its index."""
    monkeypatch.chdir(tmp_path)
    assert main(["cluster=local_cpu4_mixed", "model=tiny_gpt", override]) == 2
    err = capsys.readouterr().err
    assert err == f"het-plan: error: {message}\n"
    assert not (tmp_path / "plan.json").exists()
