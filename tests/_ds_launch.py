"""Start the ranks of a DeepSpeed test worker as separate processes (gloo, CPU) and collect what they wrote."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from het_strategy.emulation.local_ranks import run_script_ranks


def _cpu_fp16() -> bool:
    """DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (``is_fp16_supported``:
    ``torch.ops.mkldnn._is_mkldnn_fp16_supported``, true on CPUs with AVX512-FP16 or AMX-FP16)."""
    try:
        import torch

        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - no torch, or an op this build lacks: DeepSpeed refuses fp16 then too
        return False


needs_cpu_fp16 = pytest.mark.skipif(not _cpu_fp16(), reason="DeepSpeed refuses fp16 on this CPU (no oneDNN fp16 "
                                    "kernels: 'Type fp16 is not supported on your device')")
"""Marks a test that runs DeepSpeed in fp16 on CPU ranks."""


def run_ds_ranks(worker: Path, world: int, args: list[str], out_dir: Path, timeout_s: float) -> list[dict]:
    """``python worker args[0] out_dir args[1:]`` on ``world`` ranks; each writes ``out_dir/rank{r}.json``.

    Kills every rank when one fails (its peers would stay blocked in a collective) or when they outlive
    ``timeout_s``, and fails the test with the ranks' last log lines.
    """
    repo = str(Path(__file__).resolve().parents[1])
    env = {"DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    codes = run_script_ranks([sys.executable, str(worker), args[0], str(out_dir), *args[1:]], world, out_dir,
                             timeout_s, env)
    logs = [out_dir / f"log{rank}.txt" for rank in range(world)]
    if codes != [0] * world:
        pytest.fail(f"workers exited {codes} (negative: killed after {timeout_s} s or on a peer's failure):\n"
                    + "\n----\n".join(path.read_text()[-3000:] for path in logs))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
