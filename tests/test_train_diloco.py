"""het-train strategy=hetero_diloco: bad options stop in one line before any worker; a short run trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.cli.train_cli import main

TINY = ["model.num_layers=1", "model.hidden_size=32", "model.seq_len=32", "train.global_batch_size=12",
        "data.max_bytes=100000", "train.val_every_n_steps=3", "train.val_batches=1"]


@pytest.mark.parametrize("overrides, message", [
    (["cluster=local_cpu2"], "`strategy.groups` is 'node'; it must give at least 2 groups"),
    (["strategy.inner_steps=0"], "`strategy.inner_steps` is 0; it must be an integer >= 1"),
    (["strategy.outer_lr=0"], "`strategy.outer_lr` is 0; it must be a number > 0"),
    (["strategy.outer_codec=topk"], "`strategy.outer_codec` is 'topk'; it must be one of none, fp16"),
    (["strategy.groups=[[lab0,lab1],[cloud0]]"], "`strategy.groups` is"),
    (["strategy.max_sync_overhead=0"], "`strategy.max_sync_overhead` is 0"),
    (["compression=q4"], "`compression.method` is 'q4'; it must be none with strategy=hetero_diloco"),
    (["+strategy.find_unused_parameters=true"], "`strategy.find_unused_parameters` is True; it must not be there"),
    (["train.precision=per_device"], "`train.precision` is 'per_device'"),
])
def test_bad_options_are_one_line_naming_the_field(overrides: list[str], message: str, no_training: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["strategy=hetero_diloco", "cluster=local_cpu4_two_sites", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("het-train: error:") and "\n" not in err, err
    assert message in err, err


@pytest.mark.multiprocess
def test_het_train_hetero_diloco_trains_in_rounds(tmp_path: Path) -> None:
    """Two emulated sites (2 x speed 1, 2 x speed 0.5, 10 Mbit/s declared): 6 steps at H=3 in q8 are two outer
    steps; the lab devices take more samples per step; validation sees the outer parameters and the loss falls."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "strategy=hetero_diloco",
           "cluster=local_cpu4_two_sites", "strategy.inner_steps=3", "strategy.outer_codec=q8", "train.max_steps=6",
           "logger=none", *TINY, f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["outer_sync"] == {"inner_steps": 3, "codec": "q8", "groups": [["lab0", "lab1"],
                                                                                  ["cloud0", "cloud1"]]}
    assert summary["outer_rounds"] == 2 and summary["outer_bytes_per_round"] > 0
    shares = summary["diloco_shares"]
    assert sum(shares) == 12 and shares[0] > shares[2]  # the faster site takes more samples per inner step
    assert summary["final_val_loss"] < 5.545  # ln(256) at initialisation
    assert "hetero_diloco: groups [['lab0', 'lab1'], ['cloud0', 'cloud1']]" in proc.stdout
