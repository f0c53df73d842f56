"""het-train: bad input stops before any worker starts; a tiny end-to-end run trains, logs and reports."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

from het_strategy.cli.train_cli import compose_train_config, main
from het_strategy.core.cluster_limits import MAX_DEVICES

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.seq_len=64", "train.global_batch_size=16",
        "data.max_bytes=200000", "train.val_every_n_steps=3", "train.val_batches=2"]


@pytest.mark.parametrize("overrides, needle", [
    (["devices=4"], "devices"),                                   # 2 devices described, 4 launched
    (["strategy=fsdp"], "strategy"),
    (["train.global_batch_size=1"], "global_batch_size"),
    (["strategy=ddp", "train.global_batch_size=15"], "divisible"),
    (["logger=tensorboard"], "logger"),
    (["resume=/nonexistent.ckpt"], "resume"),
    (["cluster=local_cpu9"], "cluster"),
    (["train.max_stepz=3"], "max_stepz"),
    (["strategy=ddp", "straggler.enabled=true"], "straggler"),
    (["straggler.enabled=true", "straggler.threshold=0"], "threshold"),
    (["straggler.enabled=true", "straggler.min_share=1.5"], "min_share"),
    (["compression=adaptive", "compression.bits=1"], "compression.bits"),
    (["compression=adaptive", "compression.error_budget=0"], "compression.error_budget"),
    (["compression=powersgd", "compression.rank=0"], "compression.rank"),
    (["compression=none", "compression.method=gzip"], "compression.method"),
    (["compression=q4", "+compression.bitz=4"], "compression.bitz"),
    (["strategy=ddp", "compression=adaptive"], "compression.method"),
    (["compression=zip"], "compression"),
    (["planner.mode=pipeline"], "planner.mode"),                   # hetero plans data parallelism only
    (["planner.mode=ring"], "planner.mode"),
    (["strategy=hetero_deepspeed", "train.precision=bf16-true"], "train.precision"),  # DeepSpeed keeps fp32 masters
    (["strategy=hetero_deepspeed", "train.accumulate_grad_batches=2"], "accumulate_grad_batches"),
    (["elastic.enabled=true", "elastic.min_devices=3", "checkpoint.every_n_steps=2"],
     "`elastic.min_devices` is 3; it must be at most the 2 devices of cluster"),
    (["elastic.enabled=true"], "`checkpoint.every_n_steps` is null; it must be set with elastic.enabled"),
    (["elastic.enabled=true", "checkpoint.every_n_steps=2"], "run under torchrun's elastic agent"),
    (["elastic.enabled=true", "checkpoint.every_n_steps=2", "strategy=ddp"],
     "go with strategy=hetero or hetero_deepspeed, not ddp"),
    (["elastic.min_devices=0"], "elastic.min_devices"),
    (["strategy=ddp", "train.precision=per_device"],
     "`train.precision` is 'per_device'; it must go with strategy=hetero or hetero_deepspeed"),
    (["strategy=hetero_diloco", "strategy.groups=device", "train.precision=per_device"], "train.precision"),
    (["strategy=hetero_deepspeed", "checkpoint.async_save=true"], "checkpoint.async_save"),
    (["strategy=hetero_deepspeed", "resume=/nonexistent.ckpt"], "be a checkpoint directory with strategy=hetero_deepspeed"),
    (["strategy=hetero_deepspeed", "compression=adaptive"], "DeepSpeed reduces"),
    (["model=moe_gpt_tiny", "moe.placement=random"], "moe.placement"),
    (["model=moe_gpt_tiny", "model.num_experts=5", "moe.placement=uniform"], "divisible by devices"),
    (["model=moe_gpt_tiny", "model.num_experts=1"], "model.num_experts"),
    (["model=moe_gpt_tiny", "model.top_k=13"], "model.top_k"),
    (["model=moe_gpt_tiny", "moe.capacity_factor=0"], "moe.capacity_factor"),
    (["model=moe_gpt_tiny", "+moe.experts_per_rank=3"], "moe.experts_per_rank"),
    (["model=moe_gpt_tiny", "strategy=hetero_deepspeed"], "HeteroMoE runs under DDP"),
])
def test_bad_input_is_one_line_and_exit_2(overrides: list[str], needle: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster=local_cpu2", *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("het-train: error:") and "\n" not in err and needle in err


def test_resume_of_a_pipeline_run_names_what_keeps_the_checkpoint_from_loading(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """strategy=hetero_deepspeed ``resume=``: a directory cut short, and a checkpoint of another model or global
    batch, are refused in one line before any worker starts; one of this model, batch and dtype passes the check
    whatever its plan (it is loaded layer by layer)."""
    pytest.importorskip("deepspeed")
    import torch

    from het_strategy.cli.train_job import TrainJob
    from het_strategy.core.plan import SCHEMA_VERSION
    from het_strategy.strategy.checkpoint import CHECKPOINT_FORMAT, CHECKPOINT_KEY, FORMAT_KEY
    from het_strategy.strategy.deepspeed_checkpoint import CHECKPOINT_TAG, PLAN_KEY
    from het_strategy.strategy.elastic import COMPLETE_MARKER

    args = ["cluster=local_cpu2_pipeline", "strategy=hetero_deepspeed", *TINY]
    cfg, _ = compose_train_config(args)
    workload = TrainJob(cfg).workload

    def checkpoint(name: str, gb: int, complete: bool = True) -> Path:
        folder = tmp_path / name
        (folder / CHECKPOINT_TAG).mkdir(parents=True)
        plan = {"schema_version": SCHEMA_VERSION, "model": workload.fingerprint(), "global_batch_size": gb,
                "dtype": "fp32", "pipelines": [], "cluster": "elsewhere"}
        torch.save({CHECKPOINT_KEY: {FORMAT_KEY: CHECKPOINT_FORMAT}, PLAN_KEY: plan},
                   folder / CHECKPOINT_TAG / "mp_rank_00_model_states.pt")
        if complete:
            (folder / COMPLETE_MARKER).write_text("{}")
        return folder

    TrainJob(compose_train_config([*args, f"resume={checkpoint('ok', 16)}"])[0])  # another plan: passes
    for folder, needle in ((checkpoint("cut", 16, complete=False), "it has no `complete` file"),
                           (checkpoint("batch", 8), "differs in: global_batch_size")):
        assert main([*args, f"resume={folder}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("het-train: error: `resume`") and "\n" not in err and needle in err, err
    assert main([*args, "model.hidden_size=32", f"resume={tmp_path / 'ok'}"]) == 2
    assert "differs in: model;" in capsys.readouterr().err


def test_an_error_every_rank_raises_is_printed_by_rank_zero_alone(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import het_strategy.strategy.rank_zero as rank_zero
    from het_strategy.cli._common import run_cli
    from het_strategy.core.errors import ConfigError

    def refuse() -> None:
        raise ConfigError("no dp plan fits in memory")

    verdict: list = []

    def broadcast(payload: list, src: int) -> None:  # rank 0's verdict reaches rank 1
        if payload[0] is None:
            payload[0] = verdict[0]
        else:
            verdict.append(payload[0])

    monkeypatch.setattr(rank_zero.dist, "broadcast_object_list", broadcast)
    for rank in (0, 1):
        assert run_cli("het-train", lambda: rank_zero.decided_on_rank_zero(rank, 2, refuse)) == 2
    assert capsys.readouterr().err == "het-train: error: no dp plan fits in memory\n"


def test_an_elastic_run_under_an_agent_sharing_its_store_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    for name, value in (("TORCHELASTIC_RUN_ID", "job"), ("WORLD_SIZE", "2"), ("HET_STRATEGY_DEVICE", "rank0"),
                        ("TORCHELASTIC_USE_AGENT_STORE", "True")):
        monkeypatch.setenv(name, value)
    assert main(["cluster=local_cpu2", "elastic.enabled=true", "checkpoint.every_n_steps=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("het-train: error: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE` is null") and "\n" not in err


def test_a_cluster_with_an_emulated_speed_of_zero_is_refused(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nodes:\n  - name: n\n    devices:\n      - {name: a, type: CPU, emulated_speed: 1}\n"
                    "      - {name: b, type: CPU, emulated_speed: 0}\n")
    assert main([f"cluster={path}"]) == 2
    assert "emulated_speed" in capsys.readouterr().err


@pytest.mark.parametrize("text, needle", [
    ("nodes: &n [{name: n0, devices: *n}]\n", "YAML alias loop"),
    ("nodes: [{name: n0, devices: [{type: CPU, count: 100000000}]}]\n", f"within {MAX_DEVICES} devices"),
    ("nodes: [{name: n0, count: 100000000, devices: [{type: CPU}]}]\n", f"within {MAX_DEVICES} devices"),
    ("nodes: [{name: [a, b], devices: [{type: CPU, count: 2}]}]\n", "nodes[0].name"),
    ("nodes: [{name: n0, devices: [{type: CPU, count: 2, tflops: 1.0e+308}]}]\n", "tflops"),
])
def test_bad_cluster_files_are_one_line_and_exit_2_without_a_hang(text: str, needle: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    start = time.monotonic()
    assert main([f"cluster={path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("het-train: error:") and "\n" not in err and needle in err, err
    assert time.monotonic() - start < 30


def test_an_eight_device_cluster_on_four_processes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster=mixed_a100_v100_t4", "devices=4"]) == 2
    err = capsys.readouterr().err
    assert "devices" in err and "10" in err


def test_cfg_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "strategy=ddp"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# groups: cluster=local_cpu4_mixed model=tiny_gpt strategy=ddp logger=wandb")
    assert "_target_: lightning.pytorch.strategies.DDPStrategy" in out and "local_cpu4_mixed" in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_end_to_end_tiny(tmp_path: Path) -> None:
    """Two emulated ranks (speeds 1, 0.5), a 2-layer GPT, 8 steps: the run prints its plan and report, writes the
    summary, CSV metrics and an offline wandb run, and the loss falls from ln(256)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", "train.max_steps=8", *TINY,
           f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "per-rank batch shares" in out and "EMULATED cluster `local_cpu2`" in out
    assert "throughput (hetero, 2 ranks" in out and "validation loss" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["shares"] == [11, 5]  # speeds 1 : 0.5 of a 16-sample batch
    assert sum(summary["shares"]) == summary["global_batch"] == 16
    assert summary["final_val_loss"] < 5.3 < 5.545  # ln(256) = 5.545 at initialisation
    assert summary["samples_per_s"] > 0 and summary["predicted_speedup_vs_equal"] > 1.2
    assert list(tmp_path.glob("csv/version_*/metrics.csv"))
    runs = list(tmp_path.glob("wandb/offline-run-*"))
    assert runs
    # the wandb run holds the summary, the plan table and the plan picture
    assert json.loads((runs[0] / "files" / "summary.json").read_text())["shares"] == [11, 5]
    assert list(runs[0].glob("files/media/table/hetero/plan*.table.json"))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_with_lightnings_ddp_writes_its_summary(tmp_path: Path) -> None:
    """`strategy=ddp` (Lightning's own, the benchmarks' baseline) runs the same job and writes the summary: the
    report reads the package's run only where the strategy has one."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", "strategy=ddp", "logger=none",
           "train.max_steps=2", *TINY, f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["global_batch"] == 16 and "shares" not in summary


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_with_adaptive_compression_on_a_planned_slow_link(tmp_path: Path) -> None:
    """`compression=adaptive` from the Hydra group: after its warm-up the controller, told the link is 10 Mbit/s,
    compresses the large layers; the run still learns and the summary carries the per-layer decisions."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", "train.max_steps=6", *TINY,
           "logger=csv", "compression=adaptive", "compression.warmup_steps=2", "compression.link_mbit=10",
           f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compression choice at step 2" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compression"]["method"] == "adaptive"
    assert summary["compression_wire_ratio"] > 1.5
    methods = {d["layer"]: d["method"] for d in summary["compression_decisions"]}
    assert methods["module.blocks.0.mlp.0.weight"] != "none" and "module.ln_f.weight" not in methods
    assert summary["final_val_loss"] < 5.3
    (metrics,) = tmp_path.glob("csv/version_*/metrics.csv")
    header = metrics.read_text().splitlines()[0]
    assert "compression/wire_ratio" in header and "compression/bits/module.blocks.0.mlp.0.weight" in header


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_runs_a_planned_pipeline_with_the_same_updates_as_hetero(tmp_path: Path) -> None:
    """`strategy=hetero_deepspeed planner.mode=pipeline` on the emulated (1, 0.4) pair: rank 0 plans a 2-stage
    pipeline of the GPT's layers and broadcasts it; the run makes the same updates as `hetero` (uneven data
    parallelism) on the same batches, so the training losses agree."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    losses = {}
    for strategy, extra in (("hetero_deepspeed", ["planner.mode=pipeline"]), ("hetero", [])):
        out = tmp_path / strategy
        cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2_pipeline",
               "train.max_steps=4", *TINY, "logger=none", f"strategy={strategy}", *extra, f"output.dir={out}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        losses[strategy] = summary["final_train_loss"]
        if strategy == "hetero_deepspeed":
            assert "plan: fast[0," in proc.stdout and "-> slow[" in proc.stdout
            (stages,) = summary["plan_stages"]
            assert len(stages) == 2 and summary["plan_samples"] == [16]
            assert "0.0% slower" in summary["plan_summary"]
            assert summary["samples_per_s"] > 0 and summary["final_val_loss"] < 5.4
    assert losses["hetero_deepspeed"] == pytest.approx(losses["hetero"], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_moe_places_experts_by_speed_and_shows_them(tmp_path: Path) -> None:
    """`model=moe_gpt_tiny cluster=local_cpu4_moe`: experts 4/4/2/2 for speeds (1, 1, 0.5, 0.5), in the plan table
    and the summary; the run learns."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "model=moe_gpt_tiny", "cluster=local_cpu4_moe",
           "train.max_steps=4", "train.global_batch_size=8", "data.max_bytes=100000", "train.val_every_n_steps=4",
           "train.val_batches=1", "logger=none", f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers 2, 4: rank0, rank1: 4 experts; rank2, rank3: 2 experts" in proc.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["experts_per_rank"] == [[4, 4, 2, 2], [4, 4, 2, 2]]
    assert summary["final_val_loss"] < 5.545  # ln(256) at initialisation


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_works_with_the_checkpoint_path_as_written(tmp_path: Path) -> None:
    """Checkpoints are named step_N.ckpt (Hydra's grammar refuses `=` in `resume=step=N.ckpt`), and
    `resume=<that path>` continues the run; the first run writes it in the background (`checkpoint.async_save`)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    base = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", *TINY, "logger=none",
            f"output.dir={tmp_path}"]
    first = subprocess.run([*base, "train.max_steps=2", "checkpoint.every_n_steps=2", "checkpoint.async_save=true"],
                           capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_2.ckpt"]
    again = subprocess.run([*base, "train.max_steps=4", f"resume={tmp_path}/checkpoints/step_2.ckpt"],
                           capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["max_steps"] == 4


def test_multirun_checks_every_combination_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-m", "cluster=local_cpu2", "train.global_batch_size=16,1"]) == 2
    captured = capsys.readouterr()
    assert "run 1/2" not in captured.out  # nothing started
    err = captured.err.strip()
    assert err.startswith("het-train: error:") and "\n" not in err and "global_batch_size" in err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_multirun_sweeps_seeds_into_one_summary_each(tmp_path: Path) -> None:
    """The issue's command: `het-train -m train.seed=0,1 train.max_steps=5 model.num_layers=1` runs twice."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "-m", "train.seed=0,1", "train.max_steps=5",
           "model.num_layers=1", "cluster=local_cpu2", "data.max_bytes=200000", "logger=none",
           f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((tmp_path / "multirun" / "multirun.json").read_text())
    assert [r["overrides"][0] for r in runs] == ["train.seed=0", "train.seed=1"]
    losses = [json.loads((tmp_path / "multirun" / str(i) / "summary.json").read_text())["final_train_loss"]
              for i in (0, 1)]
    assert losses[0] != losses[1]  # two seeds, two runs


# -- the structured schema and the bad input it catches (issue 14) --------------------------------------------

def _error_of(overrides: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one stderr line of a refused command (exit code 2, nothing on stdout)."""
    assert main(overrides) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("het-train: error:") and "\n" not in err, err
    assert "Traceback" not in captured.err and not captured.out.strip()
    return err


@pytest.mark.parametrize("overrides, message", [
    (["train.lr=abc"], "het-train: error: `train.lr` is 'abc'; it must be a number"),
    (["data.seed=abc"], "het-train: error: `data.seed` is 'abc'; it must be an integer"),
    (["train.max_steps=2.5"], "het-train: error: `train.max_steps` is '2.5'; it must be an integer"),
    (["straggler.enabled=maybe"], "het-train: error: `straggler.enabled` is 'maybe'; it must be true or false"),
    (["devices=two"], "het-train: error: `devices` is 'two'; it must be an integer or null"),
    (["train.lr=-1"], "het-train: error: `train.lr` is -1.0; it must be > 0"),
    (["data.val_fraction=1.5"], "`data.val_fraction` is 1.5; it must be in (0, 1)"),
    (["train.seed=-3"], "`train.seed` is -3; it must be in [0, 4294967295]"),
    (["wandb.mode=bogus"], "`wandb.mode` is 'bogus'; it must be one of offline, online, disabled"),
    (["logger.wandb.mode=bogus"], "`logger.wandb.mode` is 'bogus'; it must be one of offline, online, disabled"),
    (["straggler.enabled=true", "straggler.threshold=0"], "`straggler.threshold` is 0.0; it must be > 0"),
    (["straggler.enabled=true", "straggler.min_share=-0.1"], "`straggler.min_share` is -0.1; it must be a fraction"),
    (["straggler.enabled=true", "straggler.evict_ratio=0.5"], "`straggler.evict_ratio` is 0.5; it must be > 1"),
    (["straggler.enabled=true", "straggler.min_share=0.9"],
     "`straggler.min_share` is 0.9; it must be <= 1/devices = 0.5"),
    (["+train.momentum=0.9"], "`train.momentum` is 0.9; it must not be there: unknown key (known keys here: "
                              "accumulate_grad_batches,"),
    (["model.dropout=0.1"], "`model.dropout` is '0.1'; it must not be there: unknown key (known keys here: "
                            "attention, description, expert_ffn_hidden_size, ffn_hidden_size,"),
    (["model.ffn_hidden_size=4096"], "`model.ffn_hidden_size` is 4096; it must be null or 4 * model.hidden_size = "
                                     "512"),
    (["model.attention=materialized"], "`model.attention` is 'materialized'; it must be fused: het-train's char GPT"),
    (["model.attention=flash"], "`model.attention` is 'flash'; it must be one of"),
    (["model.num_layers=null"], "`model.num_layers` is 'null'; it must be an integer"),
    (["output.summary=null", "output.dir=null"], "`output.dir` is 'null'; it must be a string"),
    (["strategy=fsdp"], "`strategy` is 'fsdp'; it must be a shipped strategy name (shipped: ddp, hetero, "
                        "hetero_deepspeed, hetero_diloco, hetero_fsdp)"),
    (["logger=tensorboard"], "`logger` is 'tensorboard'; it must be a shipped logger name (shipped: csv, none, "
                             "wandb)"),
    (["experiment=nope"], "`experiment` is 'nope'; it must be a shipped experiment name"),
    (["+strategy.find_unused_parameters=true"], "`strategy.find_unused_parameters` is True; it must not be there"),
    (["logger=csv", "logger.csv._target_=lightning.pytorch.loggers.NoSuchLogger"],
     "`logger.csv._target_` is 'lightning.pytorch.loggers.NoSuchLogger'; it must name an importable logger class"),
])
def test_a_wrong_value_names_its_full_field_in_one_line(overrides: list[str], message: str, no_training: None,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _error_of(["cluster=local_cpu2", *overrides], capsys)


def test_an_unknown_model_key_lists_every_model_key(no_training: None, capsys: pytest.CaptureFixture[str]) -> None:
    """het-train's model is the demo GPT: its keys are ``ModelConfig``'s (the planning-only keys of modern blocks,
    such as ``dropout`` or ``num_kv_heads``, are not among them)."""
    from dataclasses import fields

    from het_strategy.cli.train_config import ModelConfig

    err = _error_of(["model.dropout=0.1"], capsys)
    known = sorted(f.name for f in fields(ModelConfig))
    assert f"(known keys here: {', '.join(known)})" in err and "+model" not in err, err
    # no key can be added to the model's schema: `+model.dropout=...` is refused the same way
    assert "`model.dropout` is 0.1; it must not be there: unknown key" in _error_of(["+model.dropout=0.1"], capsys)
    # the schema holds every TransformerConfig field, so a documented one is set plainly (and checked)
    assert main(["--cfg", "model.ffn_hidden_size=512", "model.expert_ffn_hidden_size=64"]) == 0
    out = capsys.readouterr().out
    assert "ffn_hidden_size: 512" in out and "expert_ffn_hidden_size: 64" in out


def test_a_model_file_of_the_wrong_type_or_missing_a_field(tmp_path: Path, no_training: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad_model.yaml"
    bad.write_text("num_layers: two\nhidden_size: 64\nnum_heads: 4\nseq_len: 32\nvocab_size: 256\n")
    assert "`model.num_layers` is 'two'; it must be an integer" in _error_of([f"model={bad}"], capsys)
    short = tmp_path / "short_model.yaml"
    short.write_text("num_layers: 2\nnum_heads: 4\nseq_len: 32\nvocab_size: 256\n")
    assert "`model.hidden_size` is missing; it must be given" in _error_of([f"model={short}"], capsys)


def test_resume_refuses_a_file_that_is_no_lightning_checkpoint(tmp_path: Path, no_training: None,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    err = _error_of(["cluster=local_cpu2", f"resume={text}"], capsys)
    assert f"`resume` is '{text}'; it must be a Lightning checkpoint" in err
    weights = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2)}, weights)  # a torch file, but no Lightning checkpoint
    assert "a dict with `state_dict`; this file holds a dict with keys weight" in _error_of(
        ["cluster=local_cpu2", f"resume={weights}"], capsys)


def _model_checkpoint(tmp_path: Path, name: str, *overrides: str) -> Path:
    """A Lightning-shaped checkpoint of the char GPT het-train builds with ``overrides``."""
    import torch

    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob
    from het_strategy.demo.moe_gpt import build_char_model

    cfg, auto = compose_train_config(["cluster=local_cpu2", f"output.dir={tmp_path}", *overrides])
    ckpt = tmp_path / name
    torch.save({"state_dict": build_char_model(TrainJob(cfg, auto).model_cfg).state_dict(), "global_step": 2,
                "epoch": 0}, ckpt)
    return ckpt


def test_a_lightning_checkpoint_of_this_model_passes_the_resume_check(tmp_path: Path) -> None:
    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob

    ckpt = _model_checkpoint(tmp_path, "step_2.ckpt")
    cfg, auto = compose_train_config(["cluster=local_cpu2", f"resume={ckpt}", f"output.dir={tmp_path}"])
    assert TrainJob(cfg, auto).resume == str(ckpt)


def test_resume_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path: Path, no_training: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    wider = _model_checkpoint(tmp_path, "wider.ckpt", "model.hidden_size=128", "model.num_heads=4")
    err = _error_of(["cluster=local_cpu2", f"resume={wider}", "model.hidden_size=64", "model.num_heads=4"], capsys)
    assert err.count("\n") <= 1 and f"`resume` is '{wider}'; it must be a checkpoint of the model `model.*` " \
        "describes (`" in err and "there, [" in err, err
    deeper = _model_checkpoint(tmp_path, "deeper.ckpt", "model.num_layers=3")
    err = _error_of(["cluster=local_cpu2", f"resume={deeper}", "model.num_layers=2"], capsys)
    assert "which this model has not" in err, err
    state = torch.load(deeper, weights_only=True)
    state["state_dict"] = {k: v for k, v in state["state_dict"].items() if "lm_head" not in k}
    torch.save(state, deeper)
    assert "it lacks `" in _error_of(["cluster=local_cpu2", f"resume={deeper}", "model.num_layers=3"], capsys)


def test_output_dir_must_be_a_folder_it_can_write(tmp_path: Path, no_training: None,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "results.txt"
    afile.write_text("x")
    assert f"`output.dir` is '{afile}'; it must be a folder" in _error_of(
        ["cluster=local_cpu2", f"output.dir={afile}"], capsys)
    assert f"be creatable ({afile} is a file, not a folder)" in _error_of(
        ["cluster=local_cpu2", f"output.dir={afile}/run"], capsys)


def test_accelerator_cuda_without_cuda_says_to_use_the_cpu(no_training: None,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "`accelerator` is 'cuda'; it must name an accelerator this machine has (torch sees no CUDA device) " \
           "(accelerator=cpu)" in _error_of(["cluster=local_cpu2", "accelerator=cuda"], capsys)


def test_a_bad_value_inside_a_sweep_is_one_line_before_any_run(no_training: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    err = _error_of(["-m", "cluster=local_cpu2", "train.lr=0.1,abc"], capsys)
    assert "`train.lr` is 'abc'; it must be a number" in err


def test_the_job_reads_typed_sections(tmp_path: Path) -> None:
    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob
    from het_strategy.cli.train_config import MoEConfig, TrainConfig

    cfg, auto = compose_train_config(["cluster=local_cpu2", "train.lr=1", "data.seed=3", f"output.dir={tmp_path}"])
    job = TrainJob(cfg, auto)
    assert isinstance(job.train, TrainConfig) and job.train.lr == 1.0 and isinstance(job.train.lr, float)
    assert job.data.seed == 3 and isinstance(job.moe, MoEConfig) and job.moe.routing()["capacity_factor"] == 1.25
    assert job.strategy == "hetero" and list(job.loggers) == ["csv", "wandb"]


@pytest.mark.parametrize("overrides, strategy, loggers", [
    ([], "hetero", ["csv", "wandb"]),
    (["strategy=ddp", "logger=csv"], "ddp", ["csv"]),
    (["strategy=hetero_deepspeed", "logger=none", "cluster=local_cpu2_pipeline"], "hetero_deepspeed", []),
])
def test_strategy_and_logger_are_group_choices(overrides: list[str], strategy: str, loggers: list[str],
                                               tmp_path: Path) -> None:
    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob

    cfg, auto = compose_train_config(["cluster=local_cpu2", *overrides, f"output.dir={tmp_path}"])
    job = TrainJob(cfg, auto)
    assert job.strategy == strategy and list(job.loggers) == loggers


def test_the_group_nodes_instantiate_for_a_hydra_user(tmp_path: Path) -> None:
    """What `hydra.utils.instantiate` builds from het-train's own groups: the CSV logger in output.dir, and the
    hetero strategy once given the cluster node (inline OmegaConf) and the batch."""
    from hydra.utils import instantiate
    from lightning.pytorch.loggers import CSVLogger

    import het_strategy
    from het_strategy.cli.train_cli import compose_train_config

    cfg, _ = compose_train_config(["cluster=local_cpu2", "logger=csv", f"output.dir={tmp_path}"])
    logger = instantiate(cfg.logger.csv)
    assert isinstance(logger, CSVLogger) and Path(logger.save_dir) == tmp_path and logger.name == "csv"
    strategy = instantiate(cfg.strategy, cluster=cfg.cluster, global_batch_size=16)
    assert isinstance(strategy, het_strategy.HeteroStrategy)


@pytest.mark.parametrize("name, expect", [
    ("smoke", {"cluster": "local_cpu2", "loggers": ["csv"], "max_steps": 4, "experts": 0}),
    ("moe_placement", {"cluster": "local_cpu4_moe", "loggers": ["csv"], "max_steps": 40, "experts": 12}),
    ("adaptive_compression", {"cluster": "local_cpu2", "loggers": ["csv"], "max_steps": 60, "experts": 0}),
])
def test_experiment_presets_compose_and_check(name: str, expect: dict, tmp_path: Path) -> None:
    from het_strategy.cli.train_cli import compose_train_config
    from het_strategy.cli.train_job import TrainJob

    cfg, auto = compose_train_config([f"experiment={name}", f"output.dir={tmp_path}"])
    job = TrainJob(cfg, auto)
    assert job.cluster is not None and job.cluster.name == expect["cluster"]
    assert list(job.loggers) == expect["loggers"] and job.train.max_steps == expect["max_steps"]
    assert job.model_cfg.num_experts == expect["experts"]
    if name == "adaptive_compression":
        assert job.compression is not None and job.compression.method == "adaptive"
    # the command line still wins over a preset
    cfg, auto = compose_train_config([f"experiment={name}", "train.max_steps=7", f"output.dir={tmp_path}"])
    assert TrainJob(cfg, auto).train.max_steps == 7


@pytest.mark.multiprocess
@pytest.mark.slow
def test_experiment_smoke_runs_end_to_end(tmp_path: Path) -> None:
    """`het-train experiment=smoke`: the preset's 2 emulated ranks train, the CSV logger built by
    hydra.utils.instantiate writes its metrics, and the summary lands in output.dir."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "experiment=smoke", f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["max_steps"] == 4 and sum(summary["shares"]) == 8
    assert summary["shares"][0] > summary["shares"][1]  # speeds 1 : 0.5
    assert summary["final_val_loss"] < 5.545  # ln(256) at initialisation
    assert list(tmp_path.glob("csv/version_*/metrics.csv"))
