"""The house rules of the package layout: a light planning core, registration in either import order, no import
loop, small modules, and the 0.1.0 module paths still importable (with a DeprecationWarning)."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "het_strategy"
HEAVY = ("torch", "lightning", "pytorch_lightning", "deepspeed", "matplotlib")


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)


_REPORT_HEAVY = (f"import atexit, sys; atexit.register(lambda: print('HEAVY', sorted(m for m in {HEAVY!r} "
                 "if m in sys.modules)))\n")


@pytest.mark.parametrize("modules", [
    "het_strategy", "het_strategy.planning", "het_strategy.core.cluster, het_strategy.core.workload",
    "het_strategy.core.cost_model, het_strategy.core.plan, het_strategy.planning.rebalance",
    "het_strategy.ds_runtime.config, het_strategy.report.table, het_strategy.emulation.speeds",
])
def test_importing_the_planning_core_loads_no_torch_lightning_deepspeed_or_matplotlib(modules: str) -> None:
    out = _run(_REPORT_HEAVY + f"import {modules}")
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["cluster=amp_v100_t4", "model=gpt2_amp", "train.global_batch_size=32",
                                               "train.dtype=fp16", "output.dir={tmp}"]])
def test_het_plan_loads_no_torch(argv: list[str], tmp_path: Path) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = _REPORT_HEAVY + "from het_strategy.cli.plan_cli import main\nsys.exit(main(sys.argv[1:]))"
    out = _run(code, *argv)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-2000:]


@pytest.mark.parametrize("order", ["het_strategy first", "lightning first"])
@pytest.mark.parametrize("namespace", ["lightning.pytorch", "pytorch_lightning"])
def test_hetero_is_registered_whichever_is_imported_first(order: str, namespace: str) -> None:
    pytest.importorskip(namespace)
    imports = ["import het_strategy", f"import {namespace} as pl"]
    if order == "lightning first":
        imports.reverse()
    code = "\n".join(imports + [
        "t = pl.Trainer(strategy='hetero', accelerator='cpu', devices=1, logger=False)",
        "import het_strategy as h",
        f"cls = h.HeteroStrategy if {namespace!r} == 'lightning.pytorch' else h.HeteroStrategyPL",
        "assert type(t.strategy) is cls, type(t.strategy)",
        "assert 'hetero_spawn' in pl.strategies.StrategyRegistry",
        "assert 'hetero_deepspeed' in pl.strategies.StrategyRegistry",
    ])
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "callbacks":
        parts = ("het_strategy",) + parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "callbacks").glob("*.py")])


def _top_level_imports(path: Path) -> set[str]:
    """Modules imported when ``path`` is imported: module-level statements (TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(tree.body)
    return {m for m in found if m.startswith("het_strategy")}


def test_no_import_loop() -> None:
    """No module imports, at module level, one that imports it back (directly or through others)."""
    files = {_module_name(p): p for p in _module_files()}
    graph = {name: {m for m in _top_level_imports(p) if m in files and m != name} for name, p in files.items()}
    # importing ``a.b.c`` runs ``a.b``'s __init__ first; an __init__ importing its own submodules is no loop
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import loop: " + " -> ".join(loop))
            if nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name)


LAYERS = ("cli", "callbacks", "strategy", "ds_runtime", "compression", "emulation", "profiling", "report", "demo",
          "moe", "reference", "planning", "core")
"""The folders in the README's "How it works" order: each imports only folders after it (or itself)."""


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for path in _module_files():
        name = _module_name(path)
        parts = name.split(".")
        if len(parts) < 3 and not path.name == "__init__.py" or parts == ["het_strategy"]:
            continue  # het_strategy/__init__.py and _moved_modules.py sit above every folder
        layer = parts[1]
        for target in _top_level_imports(path):
            target_parts = target.split(".")
            if len(target_parts) < 2 or target_parts[1] not in LAYERS:
                continue
            if LAYERS.index(target_parts[1]) < LAYERS.index(layer):
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong


def test_modules_are_small_and_the_strategy_glue_smaller() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _module_files()}
    assert not {p: n for p, n in sizes.items() if n >= 500}, "modules of 500 lines or more"
    assert sizes["het_strategy/strategy/hetero.py"] < 300
    assert not any(Path(p).stem == "utils" for p in sizes)


def test_old_module_paths_warn_and_give_the_same_objects() -> None:
    from het_strategy._moved_modules import MOVED

    code = "\n".join([
        "import importlib, sys, warnings",
        "import het_strategy",
        f"moved = {MOVED!r}",
        "for old, new in moved.items():",
        "    sys.modules.pop(old, None)",
        "    with warnings.catch_warnings(record=True) as caught:",
        "        warnings.simplefilter('always')",
        "        module = importlib.import_module(old)",
        "    assert module is importlib.import_module(new), old",
        "    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old",
        "with warnings.catch_warnings(record=True) as caught:",
        "    warnings.simplefilter('always')",
        "    from het_strategy.profiling import profile_module, batch_length",
        "    from het_strategy.emulation import EmulatedCompute",
        "    from het_strategy.strategy import EmulatedDeviceCallback",
        "    from het_strategy.report import plan_table",
        "    from het_strategy.strategy import StepRecord, HeteroDataLoader, register_strategies",
        "moved = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and 'moved to' in str(w.message)]",
        "assert len(moved) == 8, moved",
        "from het_strategy.cluster import ClusterSpec",
        "from het_strategy.core.cluster import ClusterSpec as New",
        "assert ClusterSpec is New",
    ])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_known_lightning_pytree_warning_is_quiet_only_where_it_comes_from() -> None:
    code = "\n".join([
        "import warnings",
        "import het_strategy",
        "from lightning.pytorch.utilities._pytree import _tree_flatten",
        "with warnings.catch_warnings(record=True) as seen:",
        "    warnings.simplefilter('default')",
        "    het_strategy.core.log.quiet_known_warnings()",  # catch_warnings reset the filters: set them again
        "    _tree_flatten([1, 2])",
        "    warnings.warn('`isinstance(treespec, LeafSpec)` is deprecated (elsewhere)', FutureWarning)",
        "print(len(seen), seen[0].filename.endswith('<string>') if seen else None)",
    ])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", "True"], out.stderr
