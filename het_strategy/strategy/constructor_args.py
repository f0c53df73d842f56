"""The constructor arguments of a ``DataLoader`` or ``BatchSampler`` (subclasses included), recorded as Lightning
records them: ``RECORDING`` and ``called_again``.

Lightning builds a user's ``DataLoader`` subclass again with its distributed sampler from the arguments the
loader was made with: during the ``*_dataloader`` hooks it wraps every ``DataLoader`` and ``BatchSampler``
class's ``__init__`` so each new instance keeps its call's arguments, and its rebuild reads them back.  The
loader the strategy is handed is that rebuilt one, made after the hooks, so it carries none.  The strategies
record it the same way:

1. Lightning asks the strategy's ``distributed_sampler_kwargs`` just before it builds the loader again (the only
   place it reads them): ``RECORDING.open()`` wraps the ``__init__`` of ``DataLoader``, ``BatchSampler`` and
   every subclass of them defined so far;
2. Lightning's rebuild (the loader, and the user's batch sampler inside it) is a constructor call: the
   outermost ``__init__`` of each new instance records its positional and keyword arguments on it;
3. ``process_dataloader`` closes the recording (``RECORDING.close()`` restores every wrapped ``__init__``)
   before it builds the loader again around this rank's share with ``called_again``: the recorded call, with
   the sampling arguments replaced by name, so an argument the class only uses (``num_features``) and never
   stores is passed again as the user passed it.

The wrapped ``__init__`` belongs to the classes, shared by the process, so the recording is one process-wide
object: opening it twice is one recording, and closing restores only the ``__init__`` it wrapped itself.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from torch.utils.data import BatchSampler, DataLoader

__all__ = ["ConstructorRecording", "RECORDING", "RecordedCall", "recorded_call", "called_again"]

_ATTRIBUTE = "__het_strategy_init_call"
"""The instance attribute a recorded call is kept in (set with ``object.__setattr__``: ``DataLoader`` refuses
setting some attributes after its ``__init__``)."""


@dataclass(frozen=True)
class RecordedCall:
    """The arguments one instance's constructor was called with."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def recorded_call(obj: Any) -> RecordedCall | None:
    """The call ``obj`` was constructed with, if it was made while the recording was open."""
    return vars(obj).get(_ATTRIBUTE) if hasattr(obj, "__dict__") else None


def _subclasses(cls: type) -> set[type]:
    found = {cls}
    for sub in cls.__subclasses__():
        found |= _subclasses(sub)
    return found


def _recording(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def init_recorded(obj: Any, *args: Any, **kwargs: Any) -> None:
        if recorded_call(obj) is None:  # the outermost __init__ of the call: the most derived class's runs first
            object.__setattr__(obj, _ATTRIBUTE, RecordedCall(args, dict(kwargs)))
        init(obj, *args, **kwargs)

    return init_recorded


class ConstructorRecording:
    """Wraps the constructors of ``DataLoader``, ``BatchSampler`` and their subclasses between ``open`` and
    ``close`` so each instance made meanwhile records its call (``recorded_call``)."""

    def __init__(self) -> None:
        self._wrapped: list[tuple[type, Callable[..., None], Callable[..., None]]] = []
        """(class, its own ``__init__``, the recording one set in its place) of every class wrapped now."""

    @property
    def is_open(self) -> bool:
        """Whether instances made now record their call."""
        return bool(self._wrapped)

    def open(self) -> None:
        """Record the calls from now on (a no-op when already open)."""
        if self._wrapped:
            return
        for cls in sorted(_subclasses(DataLoader) | _subclasses(BatchSampler), key=lambda c: c.__qualname__):
            own = cls.__dict__.get("__init__")
            if own is None:  # inherits a wrapped __init__
                continue
            recording = _recording(own)
            type.__setattr__(cls, "__init__", recording)
            self._wrapped.append((cls, own, recording))

    def close(self) -> None:
        """Stop recording: every wrapped ``__init__`` is the class's own again (one another tool wrapped since
        is left to that tool)."""
        for cls, own, recording in reversed(self._wrapped):
            if cls.__dict__.get("__init__") is recording:
                type.__setattr__(cls, "__init__", own)
        self._wrapped.clear()


RECORDING = ConstructorRecording()
"""The process's recording (the wrapped constructors are the classes', shared by every strategy in it)."""


def called_again(obj: Any, values: dict[str, Any], required: tuple[str, ...]) -> tuple[Any, list[str]] | None:
    """``type(obj)`` called again with ``obj``'s recorded arguments, ``values`` replacing them by name (None when
    ``obj``'s call was not recorded), and the names of ``required`` its ``__init__`` cannot take.

    A value whose name is not a parameter goes into the ``**kwargs`` the class passes on; without ``**kwargs`` it
    is dropped unless ``required`` (then it is returned among the refused names and nothing is built).
    """
    call = recorded_call(obj)
    if call is None:
        return None
    cls = type(obj)
    signature = inspect.signature(cls.__init__)
    bound = signature.bind(None, *call.args, **call.kwargs)  # None stands for self
    params = signature.parameters
    var_keyword = next((p.name for p in params.values() if p.kind is p.VAR_KEYWORD), None)
    refused = []
    for name, value in values.items():
        param = params.get(name)
        if param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY,
                                                param.POSITIONAL_ONLY):
            bound.arguments[name] = value
        elif var_keyword is not None:
            bound.arguments.setdefault(var_keyword, {})[name] = value
        elif name in required:
            refused.append(name)
    if refused:
        return None, sorted(refused)
    return cls(*bound.args[1:], **bound.kwargs), []
