"""The strategies on ``pytorch_lightning``: ``HeteroStrategyPL``, ``HeteroDeepSpeedStrategyPL`` and
``HeteroDiLoCoStrategyPL``, and the precision plugin ``PerDevicePrecisionPL``.

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of Lightning with
separate class trees: a ``pytorch_lightning.Trainer`` accepts only subclasses
of its own ``Strategy``.  Each strategy is written once, as an ordinary class on
``lightning.pytorch``'s ``DDPStrategy`` (``hetero.py``, ``hetero_deepspeed.py``);
its ``pytorch_lightning`` twin is made here by ``twin``, the one place a class
is built at run time.  Importing this module imports ``pytorch_lightning``.
"""

from __future__ import annotations

import types
from typing import Any

import pytorch_lightning

from het_strategy.strategy import hetero_deepspeed
from het_strategy.strategy.hetero import HeteroStrategy
from het_strategy.strategy.hetero_diloco import HeteroDiLoCoStrategy
from het_strategy.strategy.per_device_precision import PerDevicePrecision

__all__ = ["twin", "HeteroStrategyPL", "HeteroDeepSpeedStrategyPL", "HeteroDiLoCoStrategyPL", "PerDevicePrecisionPL"]

_NOT_COPIED = ("__dict__", "__weakref__")


def twin(cls: type, base: type, module: str = __name__) -> type:
    """``cls``'s body on ``base`` instead of its own base: ``cls`` must derive directly from the
    ``lightning.pytorch`` class (a ``DDPStrategy``, a ``Precision``) that ``base`` replaces, or from a strategy
    of ours whose twin ``base`` is.

    Why a factory: the ``pytorch_lightning`` class needs the same methods on another package's base class,
    and writing them twice would let the two drift.  The methods are copied with their ``__class__`` cell
    pointing at the new class, so zero-argument ``super()`` follows the new class's MRO; they keep their module
    globals, so a method body must reach Lightning through ``self`` and its arguments, not through
    ``lightning.pytorch`` names.  The new class is named ``<cls>PL`` and lives in ``module`` (pickling finds it
    there).
    """
    if len(cls.__bases__) != 1 or base.__name__ not in (cls.__bases__[0].__name__, f"{cls.__bases__[0].__name__}PL"):
        raise TypeError(f"{cls.__qualname__} must derive directly from {base.__name__} alone")
    name = f"{cls.__name__}PL"
    new = type(cls)(name, (base,), {"__module__": module, "__qualname__": name, "__doc__": cls.__doc__})
    cell = types.CellType(new)
    for key, value in vars(cls).items():
        if key not in _NOT_COPIED and key not in ("__module__", "__qualname__", "__doc__"):
            setattr(new, key, _rebound(value, cell))
    return new


def _rebound(value: Any, cell: types.CellType) -> Any:
    """``value`` with every function's ``__class__`` cell replaced by ``cell`` (through properties and the like)."""
    if isinstance(value, types.FunctionType):
        if "__class__" not in value.__code__.co_freevars:
            return value
        closure = tuple(cell if name == "__class__" else old
                        for name, old in zip(value.__code__.co_freevars, value.__closure__ or ()))
        copy = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, closure)
        copy.__kwdefaults__, copy.__qualname__ = value.__kwdefaults__, value.__qualname__
        copy.__doc__, copy.__annotations__ = value.__doc__, value.__annotations__
        copy.__dict__.update(value.__dict__)
        return copy
    if isinstance(value, property):
        return property(*(None if f is None else _rebound(f, cell) for f in (value.fget, value.fset, value.fdel)),
                        value.__doc__)
    if isinstance(value, (staticmethod, classmethod)):
        return type(value)(_rebound(value.__func__, cell))
    return value


HeteroStrategyPL = twin(HeteroStrategy, pytorch_lightning.strategies.DDPStrategy)
HeteroDeepSpeedStrategyPL = twin(hetero_deepspeed.HeteroDeepSpeedStrategy, pytorch_lightning.strategies.DDPStrategy)
HeteroDiLoCoStrategyPL = twin(HeteroDiLoCoStrategy, HeteroStrategyPL)
PerDevicePrecisionPL = twin(PerDevicePrecision, pytorch_lightning.plugins.precision.Precision)
