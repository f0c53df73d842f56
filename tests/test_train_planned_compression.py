"""het-train compression=planned: placement and the inter-node compression planned together, before any worker
starts, and handed to the hetero strategy as compression="planned" (cli/train_job.py, cli/train_cli.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from het_strategy.cli.train_cli import build_strategy, compose_train_config, log_planned_compression, main  # noqa: E402
from het_strategy.cli.train_job import TrainJob  # noqa: E402
from het_strategy.compression import CompressionConfig  # noqa: E402

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.seq_len=64", "train.global_batch_size=16",
        "data.max_bytes=200000", "train.val_every_n_steps=6", "train.val_batches=2"]


def _cpu(name: str, speed: float) -> str:
    return (f"      - {{name: {name}, type: CPU, tflops: {{fp32: 0.008, bf16: 0.008}}, efficiency: 1.0, "
            f"emulated_speed: {speed}}}\n")


def _two_nodes(tmp_path: Path, per_node: tuple[int, int] = (1, 1), link_gbs: float = 0.001) -> Path:
    """Two emulated CPU nodes (speeds 1 and 0.5) behind a link of ``link_gbs`` GB/s (1 MB/s: the char GPT's
    0.5 MB of fp32 gradients take longer to cross it than its 16-sample step takes to compute)."""
    text = f"name: two_nodes_cpu\ndescription: a test cluster\ninter_node_bandwidth_gbs: {link_gbs}\nnodes:\n"
    for node, (count, speed) in zip("ab", zip(per_node, (1.0, 0.5))):
        text += f"  - name: {node}\n    intra_bandwidth_gbs: 1\n    devices:\n"
        text += "".join(_cpu(f"{node}{i}", speed) for i in range(count))
    path = tmp_path / "two_nodes_cpu.yaml"
    path.write_text(text)
    return path


def _job(overrides: list[str], tmp_path: Path) -> TrainJob:
    cfg, auto = compose_train_config([*overrides, "compression=planned", *TINY, f"output.dir={tmp_path}"])
    return TrainJob(cfg, auto)


def test_compression_planned_builds_the_strategy_with_the_joint_plans_choice(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    job = _job([f"cluster={_two_nodes(tmp_path)}"], tmp_path)
    assert job.plan is not None and job.plan.compression == {"inter_node": "q4"}
    assert sorted(job.plan.used_devices) == ["a0", "b0"] and job.plan.global_batch_size == 16
    planned = CompressionConfig(method="q4", scope="inter_node")
    assert job.compression == planned
    strategy, callbacks = build_strategy(job)
    # the strategy runs the given joint plan, its inter-node hop in q4 through the hierarchical hook
    assert strategy.run.plans.plan_source is job.plan and strategy.run.comm.config == planned and callbacks == []
    with caplog.at_level(logging.INFO, logger="het_strategy"):
        log_planned_compression(job, rank=1)  # other ranks say nothing
        assert not caplog.records
        log_planned_compression(job, rank=0)
    (record,) = caplog.records
    assert record.name == "het_strategy"
    assert record.getMessage().startswith("compression=planned: q4 between nodes (the hierarchical exchange)")
    assert "compression-blind plan" in record.getMessage()


def test_compression_planned_on_one_node_runs_uncompressed_and_says_so(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    job = _job(["cluster=local_cpu2"], tmp_path)
    assert job.plan is not None and job.plan.compression == {}
    assert job.compression is not None and job.compression.method == "none"
    strategy, _ = build_strategy(job)
    assert strategy.run.comm.config.method == "none"
    with caplog.at_level(logging.INFO, logger="het_strategy"):
        log_planned_compression(job, rank=0)
    (record,) = caplog.records
    assert "cluster `local_cpu2` has one node" in record.getMessage()
    assert "runs uncompressed" in record.getMessage()


def test_compression_planned_keeps_the_sync_plain_where_compressing_does_not_pay(tmp_path: Path) -> None:
    job = _job([f"cluster={_two_nodes(tmp_path, link_gbs=100)}"], tmp_path)
    assert job.plan is not None and job.plan.compression == {} and job.compression.method == "none"
    assert "does not pay" in job.planned_note


@pytest.mark.parametrize("overrides, message", [
    (["strategy=ddp"], "`compression` is 'planned'; it must go with strategy=hetero, not strategy=ddp"),
    (["strategy=hetero_deepspeed"],
     "`compression` is 'planned'; it must go with strategy=hetero, not strategy=hetero_deepspeed"),
    (["cluster=auto", "devices=2"], "`compression` is 'planned'; it must go with a cluster file, not cluster=auto"),
    (["+compression.bits=3"], "`compression.bits` is 3; it must not be there with compression=planned"),
    (["cluster={uneven}"], "`compression` is 'planned'; it must go with nodes of equal size for the planned q4 "
                           "exchange between nodes (cluster `two_nodes_cpu` has [2, 1] devices per node"),
])
def test_bad_compression_planned_input_is_one_line_and_exit_2(overrides: list[str], message: str, tmp_path: Path,
                                                              no_training: None,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    uneven = _two_nodes(tmp_path, per_node=(2, 1))
    overrides = [o.format(uneven=uneven) for o in overrides]
    cluster = [] if any(o.startswith("cluster=") for o in overrides) else ["cluster=local_cpu2"]
    assert main([*cluster, *overrides, "compression=planned", *TINY, f"output.dir={tmp_path}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("het-train: error:") and "\n" not in err, err
    assert message in err and not captured.out.strip()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_compression_planned_runs_q4_between_two_nodes(tmp_path: Path) -> None:
    """Two emulated ranks on two nodes behind a 1 MB/s link, 12 steps: the run logs the planned q4, the
    hierarchical exchange compresses after its 10-step warm-up, and the summary carries the choice."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", f"cluster={_two_nodes(tmp_path)}",
           "compression=planned", "train.max_steps=12", *TINY, "logger=csv", f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compression=planned: q4 between nodes") == 1  # rank 0 only
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compression_planned"] == {"inter_node": "q4"}
    assert summary["compression"]["scope"] == "inter_node" and summary["compression"]["bits"] == 4
    assert summary["compression_wire_ratio"] > 1.1  # 2 of 12 steps sent in 4 bits
    assert summary["final_val_loss"] < 5.3


def test_the_planned_group_file_holds_only_its_method() -> None:
    """configs/compression/planned.yaml is no CompressionConfig: the joint plan supplies the method and bits."""
    import yaml

    from het_strategy.core.shipped import shipped_path

    raw = yaml.safe_load(shipped_path("compression", "planned").read_text())
    assert set(raw) == {"description", "method"} and raw["method"] == "planned"
