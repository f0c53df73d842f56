"""The process groups are destroyed at a normal exit, before the interpreter finalises, and left alone after a
failure (``strategy/process_exit.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests._example_runner import ROOT

_SCRIPT = textwrap.dedent("""
    import atexit, sys, tempfile
    import torch.distributed as dist
    from het_strategy.strategy import process_exit

    # registered first, so it runs after process_exit's handler (atexit runs last-in first-out)
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    store = dist.FileStore(tempfile.mktemp(), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.new_group([0])
    process_exit.destroy_groups_at_exit()
    process_exit.destroy_groups_at_exit()  # registered once
    if sys.argv[1] == "failed":
        process_exit.mark_failed()
""")


@pytest.mark.parametrize("ending, initialized", [("normal", False), ("failed", True)])
def test_groups_are_destroyed_at_a_normal_exit_only(ending: str, initialized: bool) -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, ending], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines() == [f"initialized at exit: {initialized}"]
