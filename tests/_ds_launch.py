"""Start the ranks of a DeepSpeed test worker as separate processes (gloo, CPU) and collect what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from het_strategy.emulation.local_ranks import free_port


def run_ds_ranks(worker: Path, world: int, args: list[str], out_dir: Path, timeout_s: float) -> list[dict]:
    """``python worker args[0] out_dir args[1:]`` on ``world`` ranks; each writes ``out_dir/rank{r}.json``.

    Kills every rank when one fails (its peers would stay blocked in a collective) or when they outlive
    ``timeout_s``, and fails the test with the ranks' last log lines.
    """
    port = free_port()
    repo = str(Path(__file__).resolve().parents[1])
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
        logs.append(out_dir / f"log{rank}.txt")
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen([sys.executable, str(worker), args[0], str(out_dir), *args[1:]],
                                          env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    codes = [p.returncode for p in procs]
    if codes != [0] * world:
        pytest.fail(f"workers exited {codes} (negative: killed after {timeout_s} s or on a peer's failure):\n"
                    + "\n----\n".join(path.read_text()[-3000:] for path in logs))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
