"""The public class names, and the strategies' names in each Lightning package's StrategyRegistry.

1. ``lightning.pytorch`` and ``pytorch_lightning`` each get their own written-out classes, in the module of
   ``CLASS_MODULES``; that module registers its strategies when it is imported, each class through its
   ``register_strategies`` classmethod (Lightning's convention), with the names of ``ENTRIES``.
2. ``class_named`` gives a public class by name (importing its module); when torch, a Lightning package or
   DeepSpeed is not installed it raises ``ImportError`` naming what to install.
3. ``register_when_imported`` (called by ``import het_strategy``) imports the class module of each Lightning
   package imported already; a Lightning package imported later gets its module imported once its own import
   has finished (and once any module of het_strategy being imported meanwhile has finished).  That one deferral
   is what lets ``import het_strategy`` register in either import order while loading no Lightning itself, so
   that the planning core and ``het-plan`` stay free of torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__all__ = ["CLASS_MODULES", "ENTRIES", "CLASS_NAMES", "class_named", "register_entries", "register_when_imported"]

CLASS_MODULES = {"lightning.pytorch": "het_strategy.strategy.lightning_classes",
                 "pytorch_lightning": "het_strategy.strategy.pytorch_lightning_classes"}
"""Lightning package -> the module that defines (and registers) het_strategy's classes on it."""

_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}

ENTRIES: dict[str, dict[str, tuple[str, dict[str, Any]]]] = {
    "hetero": {
        "hetero": ("Uneven data parallelism planned for a heterogeneous cluster (het_strategy)", {}),
        "hetero_spawn": ("hetero with start_method='spawn'", {"start_method": "spawn"})},
    "hetero_deepspeed": {
        "hetero_deepspeed": ("Heterogeneous pipelines, planned or given (asymmetric replicas too), on DeepSpeed "
                             "(het_strategy)", {})},
    "hetero_diloco": {
        "hetero_diloco": ("DiLoCo across groups of uneven data parallelism, H and the codec planned from the "
                          "devices and the link (het_strategy)", {})},
    "hetero_fsdp": {
        "hetero_fsdp": ("Fully sharded data parallelism, shards sized by each device's memory and shares by its "
                        "speed (het_strategy)", {})},
}
"""A strategy's ``strategy_name`` -> its registry names: (description, the constructor arguments it adds)."""

_CLASSES = ("HeteroStrategy", "HeteroDeepSpeedStrategy", "HeteroDiLoCoStrategy", "HeteroFSDPStrategy",
            "PerDevicePrecision")
CLASS_NAMES = {f"{name}{suffix}": namespace for name in _CLASSES for namespace, suffix in _SUFFIX.items()}
"""Public class name (``HeteroStrategy``, ``HeteroDeepSpeedStrategyPL``, ...) -> its Lightning package."""

_INSTALL = {
    "torch": "torch (a dependency of het_strategy: pip install het_strategy)",
    "lightning": "lightning (a dependency of het_strategy: pip install het_strategy)",
    "pytorch_lightning": "pytorch_lightning: pip install 'het_strategy[pl]'",
    "deepspeed": "deepspeed: pip install 'het_strategy[deepspeed]'",
}
"""Top-level package a class needs -> what the ImportError tells the user to install."""


def register_entries(registry: Any, cls: type) -> None:
    """Register ``cls`` under its names of ``ENTRIES`` (a name already there is left as it is)."""
    for entry, (description, init_kwargs) in ENTRIES[cls.strategy_name].items():  # type: ignore[attr-defined]
        if entry not in registry:
            registry.register(entry, cls, description=description, **init_kwargs)


def class_named(name: str) -> type:
    """The class behind a public name of ``CLASS_NAMES``; ImportError naming what to install when a package it
    needs is missing."""
    try:
        return getattr(importlib.import_module(CLASS_MODULES[CLASS_NAMES[name]]), name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _INSTALL:
            raise
        raise ImportError(f"{name} needs {_INSTALL[missing]}", name=exc.name) from exc


def register_when_imported() -> None:
    """Register the strategies in every Lightning package imported now, and in the others once imported."""
    for namespace, module in CLASS_MODULES.items():
        if _imported(namespace):
            importlib.import_module(module)
        else:
            _finder.pending.add(namespace)
    if _finder.pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def _initializing(name: str) -> bool:
    return bool(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False))


def _imported(name: str) -> bool:
    return sys.modules.get(name) is not None and not _initializing(name)  # None: an import blocked


def _ours_importing(finished: str) -> bool:
    """A module of het_strategy other than ``finished`` is being imported now."""
    return any(name.startswith("het_strategy.") and name != finished and _initializing(name)
               for name in list(sys.modules))


def _finished(name: str) -> None:
    """``name`` (a Lightning package, or a module of het_strategy while one waits) has been imported."""
    if name in CLASS_MODULES:
        _waiting.add(name)
    if _ours_importing(name):
        return  # the class module would meet a half-imported module of ours: wait until that one is done
    for namespace in sorted(_waiting):
        _waiting.discard(namespace)
        importlib.import_module(CLASS_MODULES[namespace])


_waiting: set[str] = set()
"""Lightning packages imported whose class module is not imported yet."""


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a pending Lightning package, and for a module of het_strategy while one is pending,
    it asks the other finders, then wraps the loader so that ``_finished`` runs when the module's import is done."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending and not ((self.pending or _waiting) and fullname.startswith("het_strategy.")):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.pending.discard(fullname)
        spec.loader = _RegisteringLoader(spec.loader, fullname)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner, self._name = inner, name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._inner  # the module keeps its own loader
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        _finished(self._name)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self._inner, name)


_finder = _RegisterAfterImport()
