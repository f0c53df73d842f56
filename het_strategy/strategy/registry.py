"""``hetero`` in the StrategyRegistry of ``lightning.pytorch`` and ``pytorch_lightning``, without importing them.

``lightning.pytorch`` and ``pytorch_lightning`` are separate class trees with
separate registries, so the strategy class is built once per package on that
package's own ``DDPStrategy`` (``strategy_class``).  ``register_when_imported``
(called by ``import het_strategy``) registers a package that is already
imported at once, and one imported later as soon as its ``__init__`` has run,
through a meta-path finder that wraps only that package's loader: either import
order gives a working ``Trainer(strategy="hetero")``, and importing the
planning core alone loads no Lightning.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["NAMESPACES", "CLASS_NAMES", "strategy_class", "deepspeed_strategy_class", "class_named", "register",
           "register_when_imported"]
# 0.1.0 names, reached through ``het_strategy.strategy`` with a DeprecationWarning: ``build_strategy_class``,
# ``register_strategies`` (below)

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_classes: dict[tuple[str, str], type] = {}
_lock = threading.RLock()


# kind -> (module and name of the logic class, name of the built class, module it is reached from (pickling),
# the registry entries: name -> (description, init kwargs))
_KINDS: dict[str, tuple[str, str, str, str, dict[str, tuple[str, dict[str, Any]]]]] = {
    "hetero": ("het_strategy.strategy.hetero", "HeteroLogic", "HeteroStrategy", "het_strategy.strategy", {
        "hetero": ("Uneven data parallelism planned for a heterogeneous cluster (het_strategy)", {}),
        "hetero_spawn": ("hetero with start_method='spawn'", {"start_method": "spawn"})}),
    "hetero_deepspeed": ("het_strategy.strategy.hetero_deepspeed", "HeteroDeepSpeedLogic", "HeteroDeepSpeedStrategy",
                         "het_strategy.strategy.hetero_deepspeed", {
        "hetero_deepspeed": ("Heterogeneous pipelines, planned or given (asymmetric replicas too), on DeepSpeed "
                             "(het_strategy)", {})}),
}
CLASS_NAMES = {f"{built}{suffix}": (kind, namespace) for kind, (_, _, built, _, _) in _KINDS.items()
               for namespace, suffix in _SUFFIX.items()}
"""Public class name (``HeteroStrategy``, ``HeteroDeepSpeedStrategyPL``, ...) -> (kind, Lightning namespace)."""


def _build(kind: str, namespace: str) -> type:
    """The ``kind`` strategy on ``namespace``'s own DDPStrategy, built once and registered there."""
    if namespace not in _SUFFIX:
        raise ValueError(f"namespace {namespace!r} is not one of {NAMESPACES}")
    with _lock:
        if (kind, namespace) not in _classes:
            module_name, logic_name, built, home, _ = _KINDS[kind]
            logic = getattr(importlib.import_module(module_name), logic_name)
            pl = importlib.import_module(namespace)
            name = f"{built}{_SUFFIX[namespace]}"
            # __module__ + __qualname__ name the lazy attribute of ``home``, so pickling (spawn) finds the class
            cls = type(name, (logic, pl.strategies.DDPStrategy),
                       {"__doc__": logic.__doc__, "__module__": home, "__qualname__": name})
            _classes[(kind, namespace)] = cls
            _register_kind(pl, kind, cls)
        return _classes[(kind, namespace)]


def _register_kind(pl: ModuleType, kind: str, cls: type) -> None:
    registry = pl.strategies.StrategyRegistry
    for name, (description, init_kwargs) in _KINDS[kind][4].items():
        if name not in registry:  # a second call (another import, a reload) does nothing
            registry.register(name, cls, description=description, **init_kwargs)


def strategy_class(namespace: str) -> type:
    """``HeteroStrategy`` (or ``HeteroStrategyPL``) on ``namespace``'s DDPStrategy; registers ``hetero`` and
    ``hetero_spawn`` on first build, and ``hetero_deepspeed`` beside them."""
    cls = _build("hetero", namespace)
    _build("hetero_deepspeed", namespace)
    return cls


def deepspeed_strategy_class(namespace: str) -> type:
    """``HeteroDeepSpeedStrategy`` (or ``...PL``) on ``namespace``'s DDPStrategy; ``hetero_deepspeed`` registered."""
    return _build("hetero_deepspeed", namespace)


def class_named(name: str) -> type:
    """The class behind a public name of ``CLASS_NAMES`` (what the packages' lazy ``__getattr__`` return)."""
    kind, namespace = CLASS_NAMES[name]
    return strategy_class(namespace) if kind == "hetero" else deepspeed_strategy_class(namespace)


def register(pl: ModuleType, cls: type) -> None:
    """Register ``hetero`` and ``hetero_spawn`` in ``pl``'s StrategyRegistry (a second call does nothing)."""
    _register_kind(pl, "hetero", cls)


def _imported(namespace: str) -> bool:
    module = sys.modules.get(namespace)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a pending namespace it asks the other finders, then wraps the loader."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
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
    def __init__(self, inner: importlib.abc.Loader, namespace: str) -> None:
        self._inner, self._namespace = inner, namespace

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._inner  # the package keeps its own loader
        self._inner.exec_module(module)  # type: ignore[attr-defined]
        strategy_class(self._namespace)

    def __getattr__(self, name: str) -> Any:  # resource readers and the like: the real loader's
        return getattr(self._inner, name)


_finder = _RegisterAfterImport()


def register_when_imported() -> None:
    """Register ``hetero`` in every Lightning package imported now, and in the others when they are imported."""
    for namespace in NAMESPACES:
        if _imported(namespace):
            strategy_class(namespace)
        else:
            _finder.pending.add(namespace)
    if _finder.pending and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def build_strategy_class(pl: ModuleType) -> type:
    """0.1.0's name: ``strategy_class(pl.__name__)``."""
    return strategy_class(pl.__name__)


def register_strategies(pl: ModuleType, cls: type) -> None:
    """0.1.0's name: ``register(pl, cls)``."""
    register(pl, cls)
