"""examples/plan_own_model.py runs as its docstring says: het-plan on the user's own model, then training with that plan.

Pattern of tests/test_examples.py: the script in a subprocess, small settings, its printed promise checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests._example_runner import EXAMPLES, run_example

SCRIPT = EXAMPLES / "plan_own_model.py"


def _run(*args: str, timeout: float = 400) -> str:
    return run_example(SCRIPT.name, *args, timeout=timeout)


def test_docstring_has_the_run_line_and_the_het_plan_command():
    doc = ast.get_docstring(ast.parse(SCRIPT.read_text())) or ""
    assert "examples/plan_own_model.py" in doc
    assert "het-plan model=examples/plan_own_model.py:make_model" in doc and "HeteroStrategy(" in doc


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_plan_on_own_model_then_training_with_that_plan(tmp_path: Path):
    out = _run("--epochs", "1", "--plan-dir", str(tmp_path))
    planned = re.search(r"planned shares \{'fast': (\d+), 'slow_a': (\d+), 'slow_b': (\d+)\}", out)
    trained = re.search(r"trained with shares \[(\d+), (\d+), (\d+)\]; final validation accuracy ([0-9.]+)", out)
    assert planned and trained, out[-3000:]
    # speeds 1 : 0.5 : 0.5 of 48, planned by het-plan from the profiled model, run as planned by the strategy
    assert [int(planned.group(i)) for i in (1, 2, 3)] == [24, 12, 12]
    assert [int(trained.group(i)) for i in (1, 2, 3)] == [24, 12, 12]
    assert float(trained.group(4)) > 0.5  # 10 classes: chance is 0.1
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "plan.model.json").is_file()
