"""Every file a user names is read one way (``core.files``): a path that is not a regular file, cannot be read,
is empty or does not parse is one ``ConfigError`` naming the field and the file, at construction for the API and
as one line with exit code 2 for the CLIs; nothing blocks on a named pipe.  Messages name fields by their full
dotted path, and the fixes they suggest work."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.core.cluster import cluster_from_dict, load_cluster
from het_strategy.core.errors import ConfigError, field_error, fields_under
from het_strategy.core.files import check_readable_file, naming_file, read_json_file, read_yaml_file
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.workload import MODEL_KEYS, load_workload

_WORKER = Path(__file__).with_name("_file_input_worker.py")
_REPO = Path(__file__).resolve().parents[1]
_CLUSTER_YAML = "nodes:\n  - name: local\n    devices: [{type: CPU, count: 2}]\n"


def _plan_for(cluster_name: str) -> Plan:
    cluster, workload = load_cluster(cluster_name), load_workload("tiny_gpt")
    pipes = [Pipeline((Stage((d.name,), (0, workload.num_layers)),), 4, 8) for d in cluster.devices]
    return Plan(cluster=cluster.name, cluster_devices=[d.name for d in cluster.devices], model=workload.fingerprint(),
                global_batch_size=8 * cluster.num_devices, pipelines=pipes, mode="manual")


def _run_worker(cases: list, *, prefix: list[str] = (), timeout: float = 240) -> list[dict]:
    """The worker's result per case (a hang fails the test through ``timeout``)."""
    env = dict(os.environ, PYTHONPATH=str(_REPO), HOME=os.environ.get("HOME", "/tmp"))
    run = subprocess.run([*prefix, sys.executable, str(_WORKER), json.dumps(cases)], capture_output=True, text=True,
                         timeout=timeout, cwd=str(_REPO), env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), run.stdout + run.stderr[-3000:]
    return results


def _without_file_capabilities() -> list[str]:
    """A command prefix under which this user cannot read a mode-000 file (root loses CAP_DAC_*)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot drop the capabilities that read any file")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]


def _assert_one_line(result: dict, *pieces: str) -> None:
    assert result["code"] == 2, result
    err = result["error"]
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for piece in pieces:
        assert piece in err, err


# -- the reader itself ------------------------------------------------------------------------------------

def test_each_kind_of_unreadable_path_is_one_error_naming_field_and_file(tmp_path: Path) -> None:
    folder = tmp_path / "folder.yaml"
    folder.mkdir()
    cases = {
        tmp_path / "missing.yaml": "must be an existing cluster file",
        folder: "must be a regular cluster file; it is a directory",
        tmp_path / "empty.yaml": "must be a cluster file with content; it is empty",
        tmp_path / "comments.yaml": "holds only comments or blank lines",
        tmp_path / "broken.yaml": "must be valid YAML (",
        tmp_path / "binary.yaml": "must be a UTF-8 text cluster file",
        tmp_path / "list.yaml": "hold a mapping (key: value) at the top level; it holds a list",
    }
    (tmp_path / "empty.yaml").write_text("")
    (tmp_path / "comments.yaml").write_text("# nothing yet\n\n")
    (tmp_path / "broken.yaml").write_text("nodes: [a, b\nname: x\n")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    for path, rule in cases.items():
        with pytest.raises(ConfigError) as info:
            read_yaml_file(path, "cluster", "cluster file")
        msg = str(info.value)
        assert msg.startswith(f"`cluster` is '{path}'") and rule in msg and "\n" not in msg, msg
        assert info.value.field == "cluster"
    with pytest.raises(ConfigError, match=r"must be valid YAML \(.*at line 2, column 5\)"):
        read_yaml_file(tmp_path / "broken.yaml", "cluster")


def test_json_errors_give_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{\n  "a": 1,\n  "b": \n}\n')
    with pytest.raises(ConfigError, match=r"`plan` is '.*p.json'; it must be valid JSON \(Expecting value at line 4"):
        read_json_file(bad, "plan")


def test_a_named_pipe_is_refused_without_being_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.yaml"
    os.mkfifo(fifo)
    # opening a pipe for reading would block here until a writer came: the reader must only stat it
    for read in (lambda: read_yaml_file(fifo, "cluster"), lambda: check_readable_file(fifo, "resume"),
                 lambda: read_json_file(fifo, "plan")):
        with pytest.raises(ConfigError, match="it is a named pipe"):
            read()


def test_content_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("inter_node_bandwidth_gbs: -1\n" + _CLUSTER_YAML)
    with pytest.raises(ConfigError, match=rf"^`cluster.inter_node_bandwidth_gbs` is -1; it must be > 0 "
                                          rf"\(in cluster file {path}\)$"):
        load_cluster(path)
    model = tmp_path / "m.yaml"
    model.write_text("num_layers: 2\nhidden_size: 64\nnum_heads: 4\nseq_len: 32\nvocab_size: 256\nrope_scale: 0.1\n")
    with pytest.raises(ConfigError, match=rf"`model.rope_scale` is 0.1; .*\(in model file {model}\)$"):
        load_workload(model)
    with pytest.raises(ConfigError, match=r"`x` is 1; it must be > 2 \(in plan file p.json\)"):
        with naming_file("p.json", "plan file"):
            raise field_error("x", 1, "be > 2")


# -- full dotted paths ----------------------------------------------------------------------------------

def test_cluster_fields_carry_their_section_and_index() -> None:
    two = {"nodes": [{"name": "a", "devices": ["CPU"]}, {"name": "a", "devices": ["CPU"]}]}
    with pytest.raises(ConfigError, match=r"`cluster.nodes\[1\].name` is 'a'; it must be unique "
                                          r"\(`cluster.nodes\[0\].name` has the same name\)"):
        cluster_from_dict(two)
    devs = {"nodes": [{"devices": [{"type": "CPU", "name": "g"}, {"type": "CPU", "name": "g"}]}]}
    with pytest.raises(ConfigError, match=r"`cluster.nodes\[0\].devices\[1\].name` is 'g'"):
        cluster_from_dict(devs)
    with pytest.raises(ConfigError, match=r"`cluster.slowdowns\[0\].factor` is null; it must be given"):
        cluster_from_dict({"nodes": [{"devices": ["CPU"]}], "slowdowns": [{"device": "x", "start_step": 0}]})
    from het_strategy.core.train_settings import TrainSettings

    with pytest.raises(ConfigError, match=r"`[a-z_]+\.micro_batch_sizes\[1\]` is 0"):  # its section, its index
        TrainSettings(global_batch_size=8, micro_batch_sizes=(1, 0))


def test_plan_file_fields_are_named_by_full_path_and_file(tmp_path: Path) -> None:
    raw = _plan_for("local_cpu2").to_dict()
    raw["pipelines"][1]["stages"][0]["layers"] = [0]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"^`plan.pipelines\[1\].stages\[0\].layers` is \[0\]; it must be "
                                          rf"\[start, stop\], two layer indices \(in plan file {path}\)$"):
        Plan.load(path)
    del raw["cluster"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"^`plan.cluster` is null; it must be given"):
        Plan.load(path)


def test_fields_under_gives_a_relative_field_its_place() -> None:
    with pytest.raises(ConfigError, match=r"^`model_input.blocks\[2\]` is 'x'; it must name a submodule$") as info:
        with fields_under("model_input", "blocks"):
            raise field_error("blocks[2]", "x", "name a submodule")
    assert info.value.field == "model_input.blocks[2]"
    with pytest.raises(ConfigError, match=r"^`blocksize` is"):  # another field is left as it is
        with fields_under("model_input", "blocks"):
            raise field_error("blocksize", 1, "be 2")


# -- the CLIs -------------------------------------------------------------------------------------------

def test_cli_refuses_a_directory_and_an_empty_file_in_one_line(tmp_path: Path, capsys, monkeypatch) -> None:
    from het_strategy.cli.plan_cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "empty.yaml").write_text("\n")
    for args, piece in (([f"cluster={tmp_path / 'dir.yaml'}"], "it must be a regular cluster YAML file; it is a directory"),
                        ([f"cluster={tmp_path / 'empty.yaml'}"], "it must be a cluster YAML file with content; it is empty"),
                        ([f"model={tmp_path / 'empty.yaml'}"], "`model` is"),
                        ([f"cluster={tmp_path / 'nowhere.yaml'}"], "it must be a shipped cluster name or an existing")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("het-plan: error: ") and err.count("\n") == 1 and piece in err, err
    assert not (tmp_path / "plan.json").exists()


def test_cli_cluster_file_errors_name_the_file(tmp_path: Path, capsys) -> None:
    from het_strategy.cli.plan_cli import compose_plan_config

    path = tmp_path / "c.yaml"
    path.write_text("inter_node_bandwidth_gbs: 5\n" + _CLUSTER_YAML)
    with pytest.raises(ConfigError, match=rf"^`cluster.inter_node_bandwidth_gbs` is -2; .*\(in cluster file {path}\)$"):
        compose_plan_config([f"cluster={path}", "cluster.inter_node_bandwidth_gbs=-2"])


def test_unknown_model_key_lists_every_allowed_key_and_offers_no_plus_that_fails() -> None:
    from het_strategy.cli.plan_cli import compose_plan_config

    with pytest.raises(ConfigError) as info:
        compose_plan_config(["model=tiny_gpt", "model.no_such_key=3"])
    msg = str(info.value)
    assert msg.startswith("`model.no_such_key` is '3'; it must not be there: unknown key"), msg
    assert f"known keys here: {', '.join(sorted(MODEL_KEYS))})" in msg and "+" not in msg, msg
    with pytest.raises(ConfigError, match=r"`plan` is 'x'; it must not be there: unknown key \(known keys here: "
                                          r"cluster, model,"):
        compose_plan_config(["+plan=x"])  # a top-level key no tool reads is refused, not ignored


def test_the_plus_hint_works_when_followed() -> None:
    from het_strategy.cli.plan_cli import compose_plan_config
    from het_strategy.cli._common import workload_from_cfg

    with pytest.raises(ConfigError) as info:
        compose_plan_config(["model=tiny_gpt", "model.ffn_hidden_size=96"])
    msg = str(info.value)
    assert "write `+model.ffn_hidden_size=96`" in msg, msg
    hint = msg.split("write `", 1)[1].split("`", 1)[0]
    cfg = compose_plan_config(["model=tiny_gpt", hint])
    workload = workload_from_cfg(cfg, "bf16")
    default = workload_from_cfg(compose_plan_config(["model=tiny_gpt"]), "bf16")
    assert workload.total_params < default.total_params  # the narrower MLP the added key asks for


def test_unreadable_files_through_the_clis_and_the_api(tmp_path: Path) -> None:
    prefix = _without_file_capabilities()
    import torch

    cluster, model, plan, ckpt = (tmp_path / n for n in ("c.yaml", "m.yaml", "p.json", "step_1.ckpt"))
    cluster.write_text(_CLUSTER_YAML)
    model.write_text((_REPO / "configs/model/tiny_gpt.yaml").read_text())
    _plan_for("local_cpu4_mixed").save(plan)
    torch.save({"state_dict": {}, "epoch": 0}, ckpt)  # a real checkpoint
    for path in (cluster, model, plan, ckpt):
        path.chmod(0)
    denied = "this user can read (permission denied)"
    cases = [
        ["het-plan", [f"cluster={cluster}", "model=tiny_gpt"]],
        ["het-plan", ["cluster=local_cpu4_mixed", f"model={model}"]],
        ["het-plan", ["cluster=local_cpu4_mixed", "model=tiny_gpt", f"score={plan}"]],
        ["het-train", ["cluster=local_cpu2", f"resume={ckpt}", f"output.dir={tmp_path / 'out'}"]],
        ["hetero", {"cluster": str(cluster)}],
        ["hetero", {"cluster": "local_cpu4_mixed", "plan": str(plan)}],
    ]
    cli_plan, cli_model, cli_score, cli_resume, api_cluster, api_plan = _run_worker(cases, prefix=prefix)
    _assert_one_line(cli_plan, "het-plan: error: `cluster` is", str(cluster), denied)
    _assert_one_line(cli_model, "het-plan: error: `model` is", str(model), denied)
    _assert_one_line(cli_score, "het-plan: error: `score` is", str(plan), denied)
    _assert_one_line(cli_resume, "het-train: error: `resume` is", str(ckpt), denied)
    assert api_cluster["error"] == f"`cluster` is '{cluster}'; it must be a cluster YAML file {denied}"
    assert api_plan["error"] == f"`plan` is '{plan}'; it must be a plan JSON file {denied}"


def test_named_pipes_never_hang_a_cli_or_the_api(tmp_path: Path) -> None:
    pipes = {name: tmp_path / name for name in ("c.yaml", "m.yaml", "p.json", "step_1.ckpt")}
    for path in pipes.values():
        os.mkfifo(path)
    cases = [
        ["het-plan", [f"cluster={pipes['c.yaml']}", "model=tiny_gpt"]],
        ["het-plan", ["cluster=local_cpu4_mixed", f"model={pipes['m.yaml']}"]],
        ["het-plan", ["cluster=local_cpu4_mixed", "model=tiny_gpt", f"score={pipes['p.json']}"]],
        ["het-train", ["cluster=local_cpu2", f"resume={pipes['step_1.ckpt']}", f"output.dir={tmp_path / 'out'}"]],
        ["hetero", {"cluster": str(pipes["c.yaml"])}],
        ["hetero", {"cluster": "local_cpu4_mixed", "plan": str(pipes["p.json"])}],
    ]
    results = _run_worker(cases, timeout=240)  # a blocked open would end in TimeoutExpired
    for (kind, _), result in zip(cases[:4], results[:4]):
        _assert_one_line(result, f"{kind}: error: ", "it is a named pipe")
    for result in results[4:]:
        assert result["error"] is not None and "it is a named pipe" in result["error"], result


# -- the plan against the cluster -----------------------------------------------------------------------

def test_plan_of_another_cluster_is_refused_at_construction(tmp_path: Path) -> None:
    from het_strategy.strategy.arguments import check_cluster_source, check_plan_source, check_workload_source

    # local_cpu2's devices (rank0, rank1) are also local_cpu4_mixed's: names overlap, the clusters differ
    path = _plan_for("local_cpu2").save(tmp_path / "p.json")
    cluster = check_cluster_source("local_cpu4_mixed")
    with pytest.raises(ConfigError, match=r"^`plan.cluster_devices` is .*it must equal the devices of cluster "
                                          r"`local_cpu4_mixed` in rank order .*the plan was made for cluster "
                                          r"`local_cpu2`") as info:
        # the cluster is named, not "another model"
        check_plan_source(str(path), cluster, check_workload_source("tiny_gpt"))
    assert "another model" not in str(info.value)
    same = check_plan_source(str(path), check_cluster_source("local_cpu2"), check_workload_source("tiny_gpt"))
    assert same.cluster == "local_cpu2"

    from het_strategy import HeteroStrategy

    with pytest.raises(ConfigError, match=r"^`plan.cluster_devices` is .*`local_cpu2`"):
        HeteroStrategy(cluster="local_cpu4_mixed", plan=str(path))


def test_a_model_factory_block_is_named_under_model_input(tmp_path: Path, capsys, monkeypatch) -> None:
    from het_strategy.cli.plan_cli import main

    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef make():\n"
        "    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(2, 8)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["cluster=local_cpu4_mixed", f"model={tmp_path / 'net.py'}:make", "model_input.repeats=1",
                 "model_input.blocks=[nope]", "output.plan=null"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("het-plan: error: `model_input.blocks[0]` is 'nope'") and err.count("\n") == 1, err


def test_the_strategy_refuses_a_directory_and_an_empty_file_at_construction(tmp_path: Path) -> None:
    from het_strategy import HeteroStrategy

    (tmp_path / "dir.yaml").mkdir()
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ConfigError, match=r"^`cluster` is '.*dir.yaml'; it must be a regular cluster YAML file; "
                                          r"it is a directory$"):
        HeteroStrategy(cluster=str(tmp_path / "dir.yaml"))
    with pytest.raises(ConfigError, match=r"^`plan` is '.*empty.json'; it must be a plan JSON file with content; "
                                          r"it is empty$"):
        HeteroStrategy(cluster="local_cpu2", plan=tmp_path / "empty.json")


def test_a_name_too_long_is_one_error_not_an_oserror(tmp_path: Path, capsys, monkeypatch) -> None:
    from het_strategy.cli.plan_cli import main

    long_name = "a" * 300
    for source in (long_name, f"{long_name}.yaml", tmp_path / f"{long_name}.yaml"):
        with pytest.raises(ConfigError, match=r"^`cluster` is '.*'; it must be "):
            load_cluster(source)
    monkeypatch.chdir(tmp_path)
    assert main([f"cluster={long_name}.yaml"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("het-plan: error: `cluster` is ") and err.count("\n") == 1, err
