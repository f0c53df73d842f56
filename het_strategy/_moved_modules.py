"""The module paths of 0.1.0, kept for one release: importing one warns and gives the module's new home.

``het_strategy.cluster`` is now ``het_strategy.core.cluster``, and so on
(``MOVED``).  A meta-path finder answers only for these names; the module
object is the new one, so classes keep one identity (``isinstance``, pickling)
whichever path imported them.  ``het_strategy.strategy`` kept its name (now a
package) and ``het_strategy.strategy.EmulatedDeviceCallback`` warns the same way.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED", "install"]

MOVED = {
    "het_strategy.errors": "het_strategy.core.errors",
    "het_strategy.cluster": "het_strategy.core.cluster",
    "het_strategy.workload": "het_strategy.core.workload",
    "het_strategy.cost_model": "het_strategy.core.cost_model",
    "het_strategy.plan": "het_strategy.core.plan",
    "het_strategy.reference_profiles": "het_strategy.core.reference_profiles",
    "het_strategy.runtime_planning": "het_strategy.planning.run_plan",
    "het_strategy.probe": "het_strategy.profiling.probe",
    "het_strategy.sampler": "het_strategy.strategy.sampler",
    "het_strategy.netshape": "het_strategy.emulation.netshape",
    "het_strategy.local_ranks": "het_strategy.emulation.local_ranks",
    "het_strategy.tiny_gpt": "het_strategy.demo.char_gpt",
    "het_strategy.examples_data": "het_strategy.demo.stdlib_text",
    "het_strategy.deepspeed_config": "het_strategy.ds_runtime.config",
}
"""Old module path -> new one.  ``het_strategy.profiling``, ``het_strategy.emulation`` and ``het_strategy.report``
became packages of the same name: their old names resolve there (``profiling.module_profile``,
``emulation.speeds``, ``report.table``) with the same warning."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the new module is already imported."""


_finder = _MovedModuleFinder()


def install() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.append(_finder)


def moved_name(package: str, name: str, homes: tuple[str, ...], old_package: str | None = None) -> object:
    """A package's ``__getattr__`` for the names its 0.1.0 module of the same name held.

    Looks ``name`` up in ``package``'s submodules ``homes`` (in order), warns once
    (the value is then cached on the old package, ``old_package`` or ``package``,
    so later lookups do not come here) and returns it; other names raise
    ``AttributeError`` as usual.
    """
    old = old_package or package
    if not name.startswith("__"):
        for home in homes:
            module = importlib.import_module(f"{package}.{home}")
            if hasattr(module, name):
                warnings.warn(f"{old}.{name} moved to {package}.{home}.{name}; the old path goes away in the "
                              "next release", DeprecationWarning, stacklevel=3)
                value = getattr(module, name)
                setattr(sys.modules[old], name, value)
                return value
    raise AttributeError(f"module {old!r} has no attribute {name!r}")
