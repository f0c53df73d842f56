"""The configs shipped in the wheel: ``het_strategy.configs/<group>/<name>.yaml``.

A group is a folder of that package (``cluster``, ``model``, ``compression``);
an option of the group is one of its YAML files, named by the file's stem.
The cluster and model loaders and the command-line tools find shipped configs
here, so there is one answer to "which clusters ship".
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["shipped_config_dir", "shipped_names", "shipped_path"]


def shipped_config_dir(group: str) -> Path:
    """The folder of a shipped config group, e.g. ``het_strategy/configs/cluster``."""
    import het_strategy.configs as configs_package

    return Path(configs_package.__file__).parent / group


def shipped_names(group: str) -> list[str]:
    """Names of the shipped options of ``group`` (the stems of its ``*.yaml`` files), sorted."""
    return sorted(p.stem for p in shipped_config_dir(group).glob("*.yaml"))


def shipped_path(group: str, name: str | Path) -> Path | None:
    """The file of the shipped option ``name`` of ``group``, or None when none ships under that name."""
    candidate = shipped_config_dir(group) / f"{name}.yaml"
    return candidate if candidate.is_file() else None
