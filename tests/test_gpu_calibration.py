"""``benchmarks/gpu_calibration.py --cpu``: the calibration script runs here, and what it writes is usable.

The script is meant for one CUDA GPU; ``--cpu`` runs its three sections on the CPU with smaller shapes, so that it
is known to run before it gets its one try on a GPU.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.profiling.model_factory import load_profile_file

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_calibration.py"
RESULT = re.compile(r"^RESULT device=(?P<device>\S+) block_ratio_median=(?P<block_median>\S+) "
                    r"block_ratio_worst=(?P<block_worst>\S+) codec_gbs=(?P<codec_gbs>\S+) codec_ratio=(?P<codec>\S+) "
                    r"act_ratio_max=(?P<act>\S+) peak_ratio_max=(?P<peak>\S+) outside_gb=(?P<outside>\S+) "
                    r"seconds=(?P<seconds>\S+)$")

pytestmark = pytest.mark.slow


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("calibration")
    return _run("--cpu", "--out", str(out)), out


def test_the_result_line_parses_and_the_memory_model_holds_the_saved_activations(cpu_run) -> None:
    proc, _ = cpu_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = RESULT.match(proc.stdout.strip().splitlines()[-1])
    assert result, proc.stdout[-3000:]
    fields = result.groupdict()
    assert fields["device"] == "CPU"
    assert float(fields["codec_gbs"]) > 0 and math.isfinite(float(fields["codec"]))
    assert float(fields["block_median"]) > 0
    # the memory model's fused-attention block activations against what autograd saves: never below, at most the
    # two dropout masks above (the demo GPT trains without dropout)
    assert 1.0 <= float(fields["act"]) <= 34 / 32 * 1.01, proc.stdout[-3000:]
    assert fields["peak"] == "nan" and fields["outside"] == "nan"  # no allocator statistics on a CPU
    assert "(3) memory" in proc.stdout and "none on a CPU" in proc.stdout


def test_it_writes_the_calibration_file_and_profiles_the_cost_model_reads(cpu_run) -> None:
    proc, out = cpu_run
    calibration = json.loads((out / "CPU.calibration.json").read_text())
    assert calibration["catalog"]["codec_gbs"] > 0 and calibration["rows_skipped_for_time"] == 0
    assert {r["codec"] for r in calibration["codecs"]} == {"q8", "q4"}
    rows = calibration["layer_times"]
    assert {(r["model"], r["dtype"], r["micro_batch"]) for r in rows} == {
        (m, d, b) for m in ("char_gpt", "gpt2_medium_2blocks") for d in ("bf16", "fp32") for b in (1, 2)}
    for row in rows:
        assert row["block_s"] > 0 and row["block_predicted_s"] > 0 and not list(out.glob("**/*.tmp"))
        saved = load_profile_file(out / row["profile"])  # het-plan's model.json form
        assert saved.device_type == "CPU" and saved.workload.dtype == row["dtype"]
        cluster = cluster_from_dict({"name": "c", "nodes": [{"name": "n", "devices": [{"type": "CPU"}]}]})
        model = CostModel(cluster, saved.workload, TrainSettings(row["micro_batch"], dtype=row["dtype"], max_tp=1),
                          saved.profile)
        block = 1 if saved.workload.layers[0].name == "embedding" else 0
        f, b, _ = saved.profile.layer_times("CPU", 1, row["micro_batch"])[block]
        # the cost model prices the block from the measured times the script wrote
        assert model.stage_compute_s(cluster.devices[0], 1, row["micro_batch"], block, block + 1) == \
            pytest.approx(f + b)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0 and "--cpu" in proc.stderr
    assert not any(tmp_path.iterdir())
