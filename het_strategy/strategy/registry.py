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

__all__ = ["NAMESPACES", "strategy_class", "deepspeed_strategy_class", "register", "register_when_imported"]
# 0.1.0 names, reached through ``het_strategy.strategy`` with a DeprecationWarning: ``build_strategy_class``,
# ``register_strategies`` (below)

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")
_SUFFIX = {"lightning.pytorch": "", "pytorch_lightning": "PL"}
_classes: dict[str, type] = {}
_lock = threading.RLock()


def strategy_class(namespace: str) -> type:
    """``HeteroStrategy`` (or ``HeteroStrategyPL``) on ``namespace``'s DDPStrategy; registered on first build."""
    if namespace not in _SUFFIX:
        raise ValueError(f"namespace {namespace!r} is not one of {NAMESPACES}")
    with _lock:
        if namespace not in _classes:
            from het_strategy.strategy.hetero import HeteroLogic

            pl = importlib.import_module(namespace)
            name = f"HeteroStrategy{_SUFFIX[namespace]}"
            # __module__ + __qualname__ name the lazy attribute of het_strategy.strategy, so pickling (spawn) finds it
            cls = type(name, (HeteroLogic, pl.strategies.DDPStrategy),
                       {"__doc__": HeteroLogic.__doc__, "__module__": "het_strategy.strategy", "__qualname__": name})
            _classes[namespace] = cls
            register(pl, cls)
            deepspeed_strategy_class(namespace)
        return _classes[namespace]


def deepspeed_strategy_class(namespace: str) -> type:
    """``HeteroDeepSpeedStrategy`` (or ``...PL``) on ``namespace``'s DDPStrategy; ``hetero_deepspeed`` registered."""
    if namespace not in _SUFFIX:
        raise ValueError(f"namespace {namespace!r} is not one of {NAMESPACES}")
    key = "deepspeed:" + namespace
    with _lock:
        if key not in _classes:
            from het_strategy.ds_runtime.strategy import HeteroDeepSpeedLogic

            pl = importlib.import_module(namespace)
            name = f"HeteroDeepSpeedStrategy{_SUFFIX[namespace]}"
            cls = type(name, (HeteroDeepSpeedLogic, pl.strategies.DDPStrategy),
                       {"__doc__": HeteroDeepSpeedLogic.__doc__, "__module__": "het_strategy.ds_runtime.strategy",
                        "__qualname__": name})
            _classes[key] = cls
            registry = pl.strategies.StrategyRegistry
            if "hetero_deepspeed" not in registry:
                registry.register("hetero_deepspeed", cls, description="A given heterogeneous plan (uneven "
                                  "pipelines) run on DeepSpeed (het_strategy)")
        return _classes[key]


def register(pl: ModuleType, cls: type) -> None:
    """Register ``hetero`` and ``hetero_spawn`` in ``pl``'s StrategyRegistry (a second call does nothing)."""
    registry = pl.strategies.StrategyRegistry
    if "hetero" not in registry:
        registry.register("hetero", cls, description="Uneven data parallelism planned for a heterogeneous cluster "
                                                     "(het_strategy)")
    if "hetero_spawn" not in registry:
        registry.register("hetero_spawn", cls, description="hetero with start_method='spawn'", start_method="spawn")


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
