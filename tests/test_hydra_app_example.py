"""examples/hydra_app.py runs as its docstring says: a Hydra app whose strategy, logger and Trainer are built
with hydra.utils.instantiate from `_target_` nodes, the cluster inline; small settings here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._example_runner import run_example



_run = run_example


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
