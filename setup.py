"""The package list, found in the tree: everything else about the distribution is in pyproject.toml.

pyproject.toml alone cannot say "every package under het_strategy/, plus callbacks/ and configs/
(top-level folders) as het_strategy.callbacks and het_strategy.configs": ``packages.find`` finds
names relative to its ``where``, with no prefix.  So the list is computed here, and no hand-written
list can leave a new sub-package out of the wheel.  Folders without ``__init__.py`` (configs/cluster/,
core/data/, ...) are found as namespace packages, so the package-data glob in pyproject.toml takes
their files wherever they sit.
"""

from setuptools import find_namespace_packages, setup

# top-level folder -> the package it is shipped as (DESIGN.md, "Layout")
MAPPED = {"callbacks": "het_strategy.callbacks", "configs": "het_strategy.configs"}


def _found(where: str, prefix: str) -> list[str]:
    """``prefix`` and every folder below ``where`` as ``prefix.<sub>``, caches left out."""
    return [prefix] + [f"{prefix}.{name}" for name in find_namespace_packages(where, exclude=["*__pycache__*"])]


setup(
    packages=_found("het_strategy", "het_strategy") + [p for where, prefix in MAPPED.items() for p in _found(where, prefix)],
    package_dir={prefix: where for where, prefix in MAPPED.items()},
)
