"""het-train: bad input stops before any worker starts; a tiny end-to-end run trains, logs and reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.cli.train_cli import main

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
    (["compression=quantize4", "compression.bits=1"], "compression.bits"),
    (["compression=adaptive", "compression.error_budget=0"], "compression.error_budget"),
    (["compression=powersgd", "compression.rank=0"], "compression.rank"),
    (["compression=none", "compression.method=gzip"], "compression.method"),
    (["compression=quantize4", "+compression.bitz=4"], "compression.bitz"),
    (["strategy=ddp", "compression=adaptive"], "compression.method"),
    (["compression=zip"], "compression"),
    (["planner.mode=pipeline"], "planner.mode"),                   # hetero plans data parallelism only
    (["planner.mode=ring"], "planner.mode"),
    (["strategy=hetero_deepspeed", "train.precision=bf16-mixed"], "train.precision"),
    (["strategy=hetero_deepspeed", "train.accumulate_grad_batches=2"], "accumulate_grad_batches"),
    (["strategy=hetero_deepspeed", "checkpoint.every_n_steps=2"], "checkpoint.every_n_steps"),
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


def test_a_cluster_with_an_emulated_speed_of_zero_is_refused(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("nodes:\n  - name: n\n    devices:\n      - {name: a, type: CPU, emulated_speed: 1}\n"
                    "      - {name: b, type: CPU, emulated_speed: 0}\n")
    assert main([f"cluster={path}"]) == 2
    assert "emulated_speed" in capsys.readouterr().err


def test_an_eight_device_cluster_on_four_processes_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cluster=mixed_a100_v100_t4", "devices=4"]) == 2
    err = capsys.readouterr().err
    assert "devices" in err and "10" in err


def test_cfg_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--cfg", "strategy=ddp"]) == 0
    out = capsys.readouterr().out
    assert "strategy: ddp" in out and "local_cpu4_mixed" in out


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
    assert list(tmp_path.glob("wandb/offline-run-*"))


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
    `resume=<that path>` continues the run."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    base = [sys.executable, "-m", "het_strategy.cli.train_cli", "cluster=local_cpu2", *TINY, "logger=none",
            f"output.dir={tmp_path}"]
    first = subprocess.run([*base, "train.max_steps=2", "checkpoint.every_n_steps=2"], capture_output=True,
                           text=True, timeout=240, env=env, cwd=tmp_path)
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
