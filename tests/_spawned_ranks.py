"""Spawned ranks for the probe tests: each runs ``target(rank, port, cache_dir, out_dir)`` and writes
``out_dir/rank{r}.json`` (and ``rank{r}.err`` on failure)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any, Callable, Literal

import pytest

from het_strategy.emulation.local_ranks import free_port


def run_spawned_ranks(target: Callable[..., None], world: int, tmp_path: Path, timeout_s: float,
                      start_method: Literal["spawn", "fork"] = "spawn") -> list[dict[str, Any]]:
    """Start ``world`` spawned ranks; kill all when one fails (its peers would block in a collective) or after
    ``timeout_s``; the ranks' JSON results in rank order.  ``start_method="fork"``: the ranks start from this
    process's imports (torch, DCP) instead of importing them again, seconds faster each."""
    ctx = mp.get_context(start_method)
    port, cache, out = free_port(), tmp_path / "cache", tmp_path / "out"
    out.mkdir()
    procs = [ctx.Process(target=target, args=(r, port, str(cache), str(out))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        errors = "\n----\n".join(f.read_text() for f in sorted(out.glob("*.err")))
        pytest.fail(f"ranks exited {codes} (negative: killed after {timeout_s} s or on a peer's failure):\n{errors}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
