"""The wheel holds the source tree: every package, module and data file, under the names DESIGN.md gives them.

The tests run on an editable install, which reads the tree itself; a regular install reads only what the wheel
holds, so a package or data file the build leaves out shows only here (and in scripts/check_wheel.sh).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it ships as (DESIGN.md, "Layout": callbacks/ and configs/ sit at the top)
SHIPPED_AS = {"het_strategy": "het_strategy", "callbacks": "het_strategy.callbacks", "configs": "het_strategy.configs"}
_BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md")


def _is_cache(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix in (".pyc", ".pyo")


def _source_files() -> set[str]:
    """Every file of the source package folders, as its path inside the wheel."""
    files = set()
    for folder, package in SHIPPED_AS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and not _is_cache(path.relative_to(ROOT)):
                files.add("/".join([*package.split("."), *path.relative_to(ROOT / folder).parts]))
    return files


def _packages(files: set[str]) -> set[str]:
    return {f.rsplit("/", 1)[0].replace("/", ".") for f in files if f.endswith("/__init__.py") or f == "__init__.py"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[zipfile.ZipFile]:
    """The wheel built from a copy of the tree (the build writes build/ and *.egg-info beside its sources)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in _BUILD_INPUTS:
        shutil.copy2(ROOT / name, src / name)
    for folder in SHIPPED_AS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.py[co]"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (built,) = out.glob("het_strategy-*.whl")
    with zipfile.ZipFile(built) as zf:
        yield zf


def _shipped(wheel: zipfile.ZipFile) -> set[str]:
    return {n for n in wheel.namelist() if n.startswith("het_strategy/") and not n.endswith("/")}


def test_the_wheel_has_every_package_of_the_tree(wheel: zipfile.ZipFile) -> None:
    source = _packages(_source_files())
    assert {"het_strategy.callbacks", "het_strategy.configs", "het_strategy.diloco"} <= source
    assert _packages(_shipped(wheel)) == source


def test_the_wheel_has_every_module_and_data_file_and_nothing_else(wheel: zipfile.ZipFile) -> None:
    source, shipped = _source_files(), _shipped(wheel)
    data = {f for f in source if not f.endswith(".py")}
    assert {"het_strategy/core/catalog.yaml", "het_strategy/configs/train.yaml",
            "het_strategy/configs/cluster/amp_v100_t4.yaml"} <= data
    assert data - shipped == set(), "data files the wheel leaves out"
    assert {f for f in source if f.endswith(".py")} - shipped == set(), "modules the wheel leaves out"
    assert shipped - source == set(), "files in the wheel that the tree does not have"


def test_the_wheel_is_this_version_with_both_commands(wheel: zipfile.ZipFile) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    meta = wheel.read(f"het_strategy-{version}.dist-info/METADATA").decode()
    assert f"\nVersion: {version}\n" in meta
    entry_points = wheel.read(f"het_strategy-{version}.dist-info/entry_points.txt").decode()
    assert "het-plan = het_strategy.cli.plan_cli:main" in entry_points
    assert "het-train = het_strategy.cli.train_cli:main" in entry_points


def test_the_package_version_is_the_distributions() -> None:
    import het_strategy

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # the installed metadata lags pyproject.toml until `pip install -e .` runs again; a *.egg-info left in the
    # checkout by an in-tree build shadows it when the checkout is on sys.path (python -m pytest)
    assert importlib.metadata.version("het_strategy") == version
    assert het_strategy.__version__ == version
