"""The strategies in the StrategyRegistry of ``lightning.pytorch`` and ``pytorch_lightning``, without importing them.

How the strategy classes are made (the contract every strategy of this package follows):

1. Each strategy is one ordinary class on ``lightning.pytorch``'s ``DDPStrategy``, written in its own module
   (``KINDS``: ``hetero.HeteroStrategy``, ``hetero_deepspeed.HeteroDeepSpeedStrategy``,
   ``hetero_diloco.HeteroDiLoCoStrategy``).  It derives directly from ``DDPStrategy``, or from another of
   ``KINDS`` (``hetero_diloco`` from ``hetero``), and its method bodies reach Lightning through ``self`` and
   their arguments only.
2. Its ``pytorch_lightning`` twin (``<name>PL``) is made by the one factory, ``pytorch_lightning_classes.twin``,
   and lives in that module: ``pytorch_lightning`` is a separate class tree whose Trainer takes only its own
   strategies.
3. ``register_when_imported`` (called by ``import het_strategy``) registers ``KINDS``' names in a Lightning
   package already imported at once, and in one imported later as soon as its ``__init__`` has run, through a
   meta-path finder that wraps only that package's loader: either import order gives a working
   ``Trainer(strategy="hetero")``, and importing the planning core alone loads no Lightning.  A Lightning
   package imported from inside a module of het_strategy (a callback, a strategy) is registered once that
   module's import is done, so the classes' modules never meet a half-imported module of ours.
4. ``class_named`` gives a public class by name; when torch, a Lightning package or another dependency of the
   class is not installed it raises ``ImportError`` naming what to install.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["NAMESPACES", "KINDS", "CLASS_NAMES", "StrategyKind", "class_named", "register_namespace",
           "register_when_imported"]

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
PL_MODULE = "het_strategy.strategy.pytorch_lightning_classes"
"""The module that holds the ``pytorch_lightning`` twins."""

_INSTALL = {
    "torch": "torch (a dependency of het_strategy: pip install het_strategy)",
    "lightning": "lightning (a dependency of het_strategy: pip install het_strategy)",
    "pytorch_lightning": "pytorch_lightning: pip install 'het_strategy[pl]'",
    "deepspeed": "deepspeed: pip install 'het_strategy[deepspeed]'",
}
"""Top-level package a strategy class needs -> what the ImportError tells the user to install."""


@dataclass(frozen=True)
class StrategyKind:
    """One strategy: where its ``lightning.pytorch`` class is written and the registry names it goes under."""

    module: str
    """The module that defines the class."""
    class_name: str
    """The ``lightning.pytorch`` class's name; the ``pytorch_lightning`` twin's is this + ``PL``."""
    entries: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    """Registry name -> (description, the constructor arguments that name adds)."""


KINDS = {
    "hetero": StrategyKind("het_strategy.strategy.hetero", "HeteroStrategy", {
        "hetero": ("Uneven data parallelism planned for a heterogeneous cluster (het_strategy)", {}),
        "hetero_spawn": ("hetero with start_method='spawn'", {"start_method": "spawn"})}),
    "hetero_deepspeed": StrategyKind("het_strategy.strategy.hetero_deepspeed", "HeteroDeepSpeedStrategy", {
        "hetero_deepspeed": ("Heterogeneous pipelines, planned or given (asymmetric replicas too), on DeepSpeed "
                             "(het_strategy)", {})}),
    "hetero_diloco": StrategyKind("het_strategy.strategy.hetero_diloco", "HeteroDiLoCoStrategy", {
        "hetero_diloco": ("DiLoCo across groups of uneven data parallelism, H and the codec planned from the "
                          "devices and the link (het_strategy)", {})}),
}
CLASS_NAMES = {f"{kind.class_name}{suffix}": (key, namespace) for key, kind in KINDS.items()
               for namespace, suffix in _SUFFIX.items()}
"""Public class name (``HeteroStrategy``, ``HeteroDeepSpeedStrategyPL``, ...) -> (kind, Lightning namespace)."""


def lightning_class(kind: str) -> type:
    """The ``lightning.pytorch`` class of ``kind`` (imports its module)."""
    spec = KINDS[kind]
    module = importlib.import_module(spec.module)
    return getattr(module, spec.class_name)


def class_named(name: str) -> type:
    """The class behind a public name of ``CLASS_NAMES``; ImportError naming what to install when a package it
    needs is missing."""
    kind, namespace = CLASS_NAMES[name]
    try:
        if namespace == "lightning.pytorch":
            return lightning_class(kind)
        return getattr(importlib.import_module(PL_MODULE), name)
    except ImportError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing not in _INSTALL:
            raise
        raise ImportError(f"{name} needs {_INSTALL[missing]}", name=exc.name) from exc


def register_namespace(namespace: str, _finished_module: str = "") -> None:
    """Register every kind's names in ``namespace``'s StrategyRegistry (a second call does nothing).

    While a module of het_strategy is being imported (it may import Lightning, whose import triggers this, and
    the classes' modules may need it), the registration waits until that module's import has finished.
    """
    if any(name != _finished_module for name in _importing()):
        _waiting.add(namespace)
        return
    registry = importlib.import_module(namespace).strategies.StrategyRegistry
    for key, kind in KINDS.items():
        cls = class_named(f"{kind.class_name}{_SUFFIX[namespace]}")
        for entry, (description, init_kwargs) in kind.entries.items():
            if entry not in registry:  # another import or a reload registers nothing twice
                registry.register(entry, cls, description=description, **init_kwargs)


def _initializing(name: str) -> bool:
    return bool(getattr(getattr(sys.modules.get(name), "__spec__", None), "_initializing", False))


def _importing() -> list[str]:
    """The modules of het_strategy being imported now (the package itself aside: it calls the registration)."""
    return [name for name in list(sys.modules) if name.startswith("het_strategy.") and _initializing(name)]


def _imported(name: str) -> bool:
    return sys.modules.get(name) is not None and not _initializing(name)  # None: an import blocked


def _finished(name: str) -> None:
    """``name`` (a Lightning package or a module of het_strategy) has been imported: register what waits for it."""
    if name in NAMESPACES:
        register_namespace(name)
    for namespace in sorted(_waiting):
        _waiting.discard(namespace)
        register_namespace(namespace, name)


_waiting: set[str] = set()
"""Lightning packages imported while a module of the classes was being imported: registered after it."""


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a pending Lightning package, and for a module of het_strategy while one is pending,
    it asks the other finders, then wraps the loader so that ``_finished`` runs when the module's import is done."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending and not (self.pending and fullname.startswith("het_strategy.")):
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
        module.__loader__ = module.__spec__.loader = self._inner  # the package keeps its own loader
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        _finished(self._name)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self._inner, name)


_finder = _RegisterAfterImport()


def register_when_imported() -> None:
    """Register the strategies in every Lightning package imported now, and in the others when they are imported."""
    for namespace in NAMESPACES:
        if _imported(namespace):
            register_namespace(namespace)
        else:
            _finder.pending.add(namespace)
    if _finder.pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
