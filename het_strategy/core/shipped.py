"""The configs shipped in the wheel: ``het_strategy.configs/<group>/<name>.yaml``.

A group is a folder of that package (``cluster``, ``model``, ``compression``);
an option of the group is one of its YAML files, named by the file's stem.
The cluster and model loaders and the command-line tools find shipped configs
here, so there is one answer to "which clusters ship" and one rule for what
``cluster=<name or path>`` means (``config_file``).
"""

from __future__ import annotations

import os
from pathlib import Path

from het_strategy.core.errors import field_error

__all__ = ["shipped_config_dir", "shipped_names", "shipped_path", "config_file"]


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
    return candidate if os.path.isfile(candidate) else None  # False, not an OSError, for a name too long


def config_file(group: str, source: str | Path) -> Path:
    """The YAML file that ``source`` names for ``group``: a bare name (no suffix) that ships is the shipped
    file, anything else a path; ``ConfigError`` listing the shipped names when that file does not exist."""
    path = Path(source)
    if not path.suffix:
        path = shipped_path(group, source) or path
    if not os.path.lexists(path):  # False, not an OSError, for a name too long or a file used as a folder
        raise field_error(group, str(source), f"be a shipped {group} name or a YAML file path",
                          f"shipped: {', '.join(shipped_names(group))}")
    return path
