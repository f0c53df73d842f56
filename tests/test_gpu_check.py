"""``benchmarks/gpu_check.py --cpu``: the GPU check's sections run on gloo and the CPU, and its RESULT parses.

The script is meant for a machine with one CUDA GPU (NCCL); ``--cpu`` runs the same sections here, smaller, so
that it is known to run before it gets its one try there.  It starts one world-1 rank per section.
"""

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.core.codecs import CODECS, Codec

REPO = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"^RESULT hook_ok=(?P<hook_ok>True|False) hook_max_diff=(?P<hook_max_diff>\S+) "
                    r"bf16_gap=(?P<bf16_gap>\S+) fp16_gap=(?P<fp16_gap>\S+) tp=(?P<tp>\S+) "
                    r"per_device_gap=(?P<per_device_gap>\S+) gpu=(?P<gpu>\S+)$")

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """The script's stdout (its stderr's tail appended when it has one) and exit status."""
    log_dir = tmp_path_factory.mktemp("gpu_check")
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--cpu", "--log-dir",
                           str(log_dir), "--budget-s", "300"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=330)
    out = proc.stdout
    return out + (f"\n[stderr]\n{proc.stderr[-3000:]}" if proc.stderr.strip() else ""), proc.returncode


def test_result_line_parses_and_every_section_passed(cpu_run: tuple[str, int]) -> None:
    out, code = cpu_run
    stdout = out.split("\n[stderr]\n", 1)[0]
    result = RESULT.match(stdout.strip().splitlines()[-1])  # the last line
    assert result, out[-4000:]
    assert code == 0, out[-4000:]
    fields = result.groupdict()
    assert fields["hook_ok"] == "True" and float(fields["hook_max_diff"]) == 0.0, out[-4000:]
    for dtype in ("bf16", "fp16"):
        assert 0.0 <= float(fields[f"{dtype}_gap"]) <= 0.02, (dtype, out[-4000:])
    # the fp32 tp-2 run's largest parameter difference to the one-process reference's shards
    assert math.isfinite(float(fields["tp"])) and float(fields["tp"]) < 1e-4, out[-4000:]
    assert fields["gpu"] == "cpu"
    assert "SECTION hooks: ok" in out and "SECTION deepspeed dtypes: ok" in out
    assert "SECTION tensor parallel: ok" in out and "tp bf16: 2 ranks" in out
    # a bf16 rank beside an fp16 rank (hetero_deepspeed's per-device precision) tracks one fp32 process
    assert 0.0 <= float(fields["per_device_gap"]) <= 0.03 and "SECTION per-device precision: ok" in out, out[-4000:]
    assert "torch.bfloat16 and torch.float16 (per_device)" in out


def test_on_gloo_the_hooks_take_the_synchronous_path_and_the_forced_chain_matches(cpu_run: tuple[str, int]) -> None:
    """Every registered codec ran; off NCCL its own path is the synchronous one (codec none: DDP's plain async
    allreduce) and the forced chained path gave bitwise the same gradients and residuals."""
    out, _ = cpu_run
    assert "exchange.overlaps -> False" in out
    rows = {ln.split()[0]: ln for ln in out.splitlines() if "own path:" in ln}
    assert set(map(str, CODECS)) | {"q4-stochastic", "mixed", "hierarchical-q4"} <= set(rows), sorted(rows)
    for label, row in rows.items():
        own = "plain async allreduce" if label == Codec.NONE else "synchronous"
        assert f"own path: {own}" in row and "(bitwise)" in row and row.endswith("ok"), row
        if label != Codec.NONE:
            assert "forced: chained" in row, row


def test_the_deepspeed_runs_hold_their_layers_in_their_dtype(cpu_run: tuple[str, int]) -> None:
    out, _ = cpu_run
    table = {ln.split()[0]: ln.split() for ln in out.splitlines()
             if re.match(r"^  (fp32\*?|bf16|fp16) +\d ", ln)}
    assert {"fp32", "bf16", "fp16"} <= set(table), out[-4000:]
    expected = {"fp32": ("0", "float32"), "bf16": ("0", "bfloat16"), "fp16": ("1", "float16")}
    for run, (zero, layers) in expected.items():
        assert table[run][1:4] == [zero, layers, "cpu"], table[run]
