"""The house rules of the package layout: a light planning core, registration in either import order, no import
circle and imports pointing down the layers (module-level and function-level imports alike), optional
dependencies imported only where allowed, no re-exports (one import path per name; an ``__all__`` in every
``__init__.py``), a warning for a module over 500 lines."""

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
    "het_strategy", "het_strategy.planning", "het_strategy.strategy.registry", "het_strategy.core.cluster, het_strategy.core.workload",
    "het_strategy.core.cost_model, het_strategy.core.plan, het_strategy.planning.rebalance",
    "het_strategy.ds_runtime.ds_config, het_strategy.report.table, het_strategy.emulation.speeds",
    "het_strategy.reference.sailor_simulator, het_strategy.reference.amp_plans",
])
def test_importing_the_planning_core_loads_no_torch_lightning_deepspeed_or_matplotlib(modules: str) -> None:
    out = _run(_REPORT_HEAVY + f"import {modules}")
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout


@pytest.mark.parametrize("argv", [["--help"], ["cluster=amp_v100_t4", "model=gpt2_amp", "settings.global_batch_size=32",
                                               "settings.dtype=fp16", "output.dir={tmp}"]])
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


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``importer``."""
    if not level:
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` can import, with the line: the whole file, not only its module-level statements.

    Module-level statements (``TYPE_CHECKING`` and ``try`` blocks included) import when the module is imported;
    the bodies of functions and methods import when they run.  Both count.  ``from a import b`` names ``a`` and
    ``a.b`` (``b`` may be a submodule), and ``importlib.import_module("het_strategy....")`` with a literal name
    counts as an import of that name.
    """
    name = _module_name(path)
    tree = ast.parse(path.read_text())
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
            found.append((module, node.lineno))
            found.extend((f"{module}.{a.name}", node.lineno) for a in node.names if a.name != "*")
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            found.append((node.args[0].value, node.lineno))
    return found


def _import_graph() -> dict[str, set[str]]:
    """het_strategy module -> the het_strategy modules it imports, at module or function level."""
    files = {_module_name(p): p for p in _module_files()}
    return {name: {m for m, _ in _imports(p) if m in files and m != name} for name, p in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:  # the shortest way from the component's first module back to itself
        start = min(component)
        previous: dict[str, str] = {}
        queue = [start]
        last = None
        while last is None:  # breadth first inside the component, which always leads back to ``start``
            node = queue.pop(0)
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    last = node
                    break
                if nxt not in previous:
                    previous[nxt] = node
                    queue.append(nxt)
        way_back = [start]
        while last != start:
            way_back.append(last)
            last = previous[last]
        cycles.append([start, *reversed(way_back[1:]), start])
    return cycles


def test_cycles_are_found_and_listed() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_at_module_or_function_level() -> None:
    """No module imports, at module level or inside a function, one that imports it back (directly or through
    others).  Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first; an ``__init__`` importing its own
    submodules is no circle, so only the imported module itself is an edge."""
    cycles = _cycles(_import_graph())
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


LAYERS = ("cli", "strategy", "callbacks", "ds_runtime", "fsdp", "hf", "diloco", "compression", "emulation", "profiling",
          "report", "demo", "tensor_parallel", "moe", "reference", "planning", "core")
"""The folders in the docs' "How it works" order: each imports only folders after it (or itself)."""


def test_imports_point_down_the_layers_at_module_and_function_level() -> None:
    modules = {_module_name(p) for p in _module_files()}
    wrong = []
    for path in _module_files():
        name = _module_name(path)
        parts = name.split(".")
        if len(parts) < 3 and not path.name == "__init__.py" or parts == ["het_strategy"]:
            continue  # het_strategy/__init__.py (and any top-level module) sits above every folder
        layer = parts[1]
        for target, line in _imports(path):
            target_parts = target.split(".")
            if target_parts[0] != "het_strategy" or len(target_parts) < 2 or target_parts[1] not in LAYERS:
                continue
            if LAYERS.index(target_parts[1]) < LAYERS.index(layer) and target in modules:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not wrong, "imports pointing up the layers:\n" + "\n".join(sorted(set(wrong)))


REQUIRED = ("numpy", "yaml", "omegaconf", "hydra", "torch", "lightning",
            "typing_extensions")  # comes with torch and Lightning (``override``)
"""pyproject.toml's ``dependencies``, by import name: any module may import them (the planning core aside)."""

OPTIONAL = {
    # extra `deepspeed`: the DeepSpeed engine, the checks of its ds_config, its gradient clipping
    "deepspeed": ("ds_runtime",),
    # extra `hf`: Hugging Face models cut into pipeline units and tp plans, their checkpoints (het_strategy/hf/)
    "transformers": ("hf",),
    "safetensors": ("hf",),
    # extra `plot`: the plan picture (report/picture.py; report/wandb_view.py draws it for a wandb run)
    "matplotlib": ("report",),
    # extra `wandb`: tables, pictures and files logged to a wandb run (report/wandb_view.py)
    "wandb": ("report",),
    # extra `pl`: the strategies' classes on the second Lightning package (strategy/pytorch_lightning_classes.py)
    "pytorch_lightning": ("strategy", "callbacks"),
}
"""The optional dependencies (pyproject.toml's extras, by import name) and the only folders that may import them,
at module or function level.  Whatever imports them must not run on ``import het_strategy``: the subprocess
tests above check that importing the package and its planning core loads none of them."""

PLANNING_CORE = ("core", "planning", "reference")
"""Folders that import no torch, Lightning, DeepSpeed or matplotlib anywhere, not even inside a function."""


def _third_party_imports() -> list[tuple[Path, str, str, int]]:
    """(file, folder, top-level package, line) of every import of a package outside het_strategy and the stdlib."""
    out = []
    for path in _module_files():
        parts = _module_name(path).split(".")
        folder = parts[1] if len(parts) > 1 else ""
        for target, line in _imports(path):
            top = target.split(".")[0]
            if top and top != "het_strategy" and top not in sys.stdlib_module_names:
                out.append((path, folder, top, line))
    return out


def test_third_party_imports_are_dependencies_or_allowed_optional_ones() -> None:
    wrong = []
    for path, folder, top, line in _third_party_imports():
        where = f"{path.relative_to(ROOT)}:{line} imports {top}"
        if top in OPTIONAL:
            if folder not in OPTIONAL[top]:
                wrong.append(f"{where}, an optional dependency allowed only in {OPTIONAL[top]}")
        elif top not in REQUIRED:
            wrong.append(f"{where}, neither a dependency nor an allowed optional one")
    assert not wrong, "\n".join(wrong)


def test_the_planning_core_imports_no_torch_lightning_deepspeed_or_matplotlib_even_in_functions() -> None:
    wrong = [f"{p.relative_to(ROOT)}:{line} imports {top}" for p, folder, top, line in _third_party_imports()
             if folder in PLANNING_CORE and top in HEAVY]
    assert not wrong, "\n".join(wrong)


def test_no_utils_and_a_warning_for_a_module_over_500_lines() -> None:
    """A module over 500 lines is worth a look (two concerns?), not a reason to cut one concern in two: a warning."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _module_files()}
    assert not any(Path(p).stem == "utils" for p in sizes)
    long = {p: n for p, n in sizes.items() if n > 500}
    if long:
        warnings.warn(f"modules over 500 lines (one concern each?): {long}", stacklevel=1)


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


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when a module is imported: its body, and inside it the bodies of ``if``, ``try``,
    ``with``, ``for`` and ``while`` (not of functions or classes, whose names are local)."""
    out = []
    for node in body:
        out.append(node)
        for field in ("body", "orelse", "finalbody"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.extend(_module_level(getattr(node, field, [])))
        for handler in getattr(node, "handlers", []):
            out.extend(_module_level(handler.body))
    return out


def _defined_names(statements: list[ast.stmt]) -> set[str]:
    """The names a module defines itself: functions, classes, assignments (annotated ones and ``TypeAlias``
    included), ``type X = ...`` and loop targets; an imported name is not one of them."""
    names: set[str] = set()
    type_alias = getattr(ast, "TypeAlias", ())  # ``type X = ...``, Python 3.12+
    for node in statements:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif type_alias and isinstance(node, type_alias):
            names.add(node.name.id)
        else:
            targets = {ast.Assign: lambda n: n.targets, ast.AnnAssign: lambda n: [n.target],
                       ast.AugAssign: lambda n: [n.target], ast.For: lambda n: [n.target]}
            for target in targets.get(type(node), lambda n: [])(node):
                names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
    return names


def _re_export_problems(source: str, is_init: bool) -> list[str]:
    """What makes a module re-export a name, one line each (empty: none).

    A module that is not an ``__init__.py`` lists in ``__all__`` (a literal list or tuple of strings) only names it
    defines, and carries no ``# noqa: F401`` on a module-level import: a module-level name the module does not
    use is there only for its importers, a second import path.  (A function-level import binds a local name:
    an F401 there marks an import for its side effect, e.g. whether matplotlib is installed.)  An ``__init__.py``
    is where a package names its public surface: it must have an ``__all__``, and may list imported names in it.
    """
    tree = ast.parse(source)
    statements = _module_level(tree.body)
    lines = source.splitlines()
    all_names = None
    problems = []
    for node in statements:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
            value = node.value
            if not (isinstance(value, (ast.List, ast.Tuple))
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts)):
                problems.append(f"line {node.lineno}: __all__ is not a literal list of names")
                continue
            all_names = [e.value for e in value.elts]
    if is_init:
        return problems + ([] if all_names is not None else ["an __init__.py without __all__"])
    defined = _defined_names(statements)
    problems += [f"__all__ lists {name!r}, which it does not define (import it from where it is defined)"
                 for name in all_names or [] if name not in defined]
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if "noqa: F401" in text:
                problems.append(f"line {node.lineno}: a module-level import kept with `# noqa: F401`, "
                                "a re-export (import the name from the module that defines it)")
    return problems


def test_re_exports_are_found() -> None:
    defines = "from a import b\nX: int = 1\ndef f(): pass\nclass C: pass\nif X:\n    Y = 2\n"
    assert _re_export_problems(defines + "__all__ = ['X', 'f', 'C', 'Y']", is_init=False) == []
    assert _re_export_problems(defines + "__all__ = ['X', 'b']", is_init=False) == [
        "__all__ lists 'b', which it does not define (import it from where it is defined)"]
    assert _re_export_problems("from a import b  # noqa: F401\n__all__ = []", is_init=False) == [
        "line 1: a module-level import kept with `# noqa: F401`, a re-export (import the name from the module "
        "that defines it)"]
    assert _re_export_problems("def f():\n    import a  # noqa: F401\n__all__ = ['f']", is_init=False) == []
    assert _re_export_problems("from a import b\n__all__ = ['b']", is_init=True) == []
    assert _re_export_problems("from a import b\n", is_init=True) == ["an __init__.py without __all__"]
    assert _re_export_problems("__all__ = ['a'] + other", is_init=False) == [
        "line 1: __all__ is not a literal list of names"]


def test_no_module_re_exports_a_name_it_does_not_define_and_every_init_lists_all() -> None:
    """Each name has one import path, the module that defines it; a package's ``__init__.py`` names its public
    surface in ``__all__`` (empty where the package's modules are imported one by one)."""
    wrong = [f"{path.relative_to(ROOT)}: {problem}" for path in _module_files()
             for problem in _re_export_problems(path.read_text(), path.name == "__init__.py")]
    assert not wrong, "re-exports:\n" + "\n".join(wrong)


def test_no_function_over_80_lines() -> None:
    """A function that does one thing reads in one screen (benchmarks/ aside: they are not the package)."""
    long = []
    for path in _module_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})")
    assert not long, long


def test_module_docstrings_say_what_the_module_does_in_25_lines() -> None:
    """What a module does and its invariants; results go to the docs, history to the CHANGELOG."""
    long = []
    for path in _module_files():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if len(doc.splitlines()) > 25:
            long.append(f"{path.relative_to(ROOT)} ({len(doc.splitlines())} lines)")
    assert not long, long
