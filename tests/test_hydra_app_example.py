"""examples/hydra_app.py runs as its docstring says: a Hydra app whose strategy, logger and Trainer are built
with hydra.utils.instantiate from `_target_` nodes, the cluster inline; small settings here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args: str, timeout: float = 300) -> str:
    """The script's stdout and stderr (it must exit 0)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_the_config_composes_with_a_shipped_cluster_name_instead() -> None:
    out = _run("hydra_app.py", "cluster=local_cpu2", "logger=null", "--cfg", "job", timeout=120)
    assert "cluster: local_cpu2" in out and "_target_: het_strategy.HeteroStrategy" in out
    assert "logger: null" in out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hydra_app_builds_the_strategy_and_logger_from_target_nodes(tmp_path: Path) -> None:
    out = _run("hydra_app.py", "trainer.max_steps=20", "trainer.val_check_interval=10", f"hydra.run.dir={tmp_path}")
    found = re.search(r"hydra app: HeteroStrategy from _target_ on `two_cpus`; shares per rank \[(\d+), (\d+)\]; "
                      r"final validation accuracy ([0-9.]+); metrics in (\S+)", out)
    assert found, out[-2000:]
    assert [int(found.group(1)), int(found.group(2))] == [32, 16]  # speeds 1 : 0.5 of 48
    assert float(found.group(3)) > 0.5  # 10 classes: chance is 0.1
    metrics = Path(found.group(4)) / "metrics.csv"
    assert metrics.is_file() and metrics.parent.parent.parent == tmp_path  # the CSVLogger in hydra's run dir
    assert "train_loss" in metrics.read_text().splitlines()[0]
