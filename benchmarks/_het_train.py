"""Run the main job (``het-train``) as its own process group and read back its summary (benchmarks' helper)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


def run_het_train(overrides: Sequence[str], out_dir: Path, timeout_s: float = 1800) -> dict[str, Any]:
    """``het-train <overrides> logger=none output.dir=<out_dir>``; its ``summary.json`` plus the launch wall time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", *overrides, "logger=none", f"output.dir={out_dir}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=out_dir)
    if proc.returncode != 0:
        raise RuntimeError(f"het-train {' '.join(overrides)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    summary["launch_wall_s"] = time.perf_counter() - started
    return summary


def describe(summary: dict[str, Any]) -> str:
    return (f"{summary['strategy']:<7} {summary['step_s']:8.3f} s/step {summary['samples_per_s']:8.2f} samples/s "
            f"over {summary['steps_measured']} steps; final val loss {summary['final_val_loss']:.4f}")
