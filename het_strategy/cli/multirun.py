"""``het-train -m``: a sweep over comma-separated override values, run one after the other.

Hydra's own multirun launches jobs inside one process, but every het-train run
is a process group whose other ranks Lightning starts by re-running the
command line: so each run of the sweep is its own ``het-train`` process.

1. ``sweep_overrides`` expands the sweep overrides with Hydra's override
   parser (``train.seed=0,1 model.num_layers=1,2`` -> 4 combinations, in
   order, the last key varying fastest), as Hydra's basic sweeper does.
2. Every combination is composed and checked first: a bad value anywhere
   exits 2 with one line before any run starts.
3. Run i writes into ``<output.dir>/multirun/<i>`` (its summary, checkpoints
   and logs), and ``<output.dir>/multirun/multirun.json`` lists the runs, their
   overrides and exit codes.  The first failing run stops the sweep.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from het_strategy.core.atomic_file import write_atomic
from het_strategy.core.errors import ConfigError

__all__ = ["MULTIRUN_FLAGS", "sweep_overrides", "run_sweep"]

MULTIRUN_FLAGS = ("-m", "--multirun")


def sweep_overrides(overrides: Sequence[str]) -> list[list[str]]:
    """Every combination of the sweep overrides' values, each a full override list."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError(f"bad override: {exc}") from None
    choices: list[list[str]] = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            choices.append([f"{key}={value}" for value in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    return [list(combo) for combo in itertools.product(*choices)]


def run_sweep(overrides: Sequence[str], check: Callable[[list[str]], Path], prog: str) -> int:
    """Check every combination (``check`` returns its output dir or raises ConfigError), then run each."""
    full = sweep_overrides(overrides)
    bases = [check(combo) for combo in full]  # all of them before any run starts
    combos = [[o for o in combo if not o.startswith("output.dir=")] for combo in full]  # each run: its own dir
    runs = []
    for i, (combo, base) in enumerate(zip(combos, bases)):
        out = base / "multirun" / str(i)
        print(f"{prog} -m: run {i + 1}/{len(combos)}: {' '.join(combo) or '(defaults)'} -> {out}", flush=True)
        code = subprocess.call([sys.executable, "-m", "het_strategy.cli.train_cli", *combo, f"output.dir={out}"])
        runs.append({"run": i, "overrides": combo, "output_dir": str(out), "exit_code": code})
        write_atomic(base / "multirun" / "multirun.json", json.dumps(runs, indent=2))
        if code != 0:
            print(f"{prog} -m: run {i + 1} failed (exit code {code}); the sweep stops", file=sys.stderr)
            return code
    print(f"{prog} -m: {len(combos)} run(s) done; summaries under " +
          ", ".join(sorted({str(b / 'multirun') for b in bases})), flush=True)
    return 0
