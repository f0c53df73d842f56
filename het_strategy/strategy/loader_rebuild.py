"""The user's DataLoader and batch sampler rebuilt around this rank's share, keeping their own classes.

Lightning's DDP re-instantiates the user's ``DataLoader`` class (and a custom
``BatchSampler`` class) with a distributed sampler, so a subclass keeps its
methods, attributes and ``isinstance``.  The hetero strategies do the same with
their own samplers, from the arguments the loader was built with: the call
recorded while Lightning built it (``constructor_args``), its sampling arguments
replaced by name.  A loader whose call was not recorded (made outside Lightning)
is built the way Lightning builds such a loader: every parameter of the class's
``__init__`` is taken from the instance attribute of the same name, the values
the strategy sets override them, and a required parameter that no attribute
holds is refused in one line naming it.

``bind_position`` makes a rebuilt loader resumable through Lightning's
``state_dict``/``load_state_dict`` interface without changing its class.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from torch.utils.data import BatchSampler, DataLoader, Sampler

from het_strategy.core.errors import field_error
from het_strategy.strategy.constructor_args import called_again

__all__ = ["rebuild_loader", "rebuild_batch_sampler", "fixed_batch_size", "bind_position"]

# The DataLoader arguments a rebuilt loader carries over (its sampling ones are the strategy's).
_LOADER_FIELDS = ("dataset", "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                  "multiprocessing_context", "generator", "persistent_workers", "pin_memory_device")
_SAMPLING = {"batch_size": 1, "shuffle": False, "sampler": None, "drop_last": False}



def rebuild_loader(dataloader: DataLoader, batch_sampler: Sampler[list[int]]) -> DataLoader:
    """``dataloader``'s own class, drawing its batches from ``batch_sampler``."""
    sampling = dict(_SAMPLING, batch_sampler=batch_sampler)
    values: dict[str, Any] = {name: getattr(dataloader, name) for name in _LOADER_FIELDS}
    if dataloader.num_workers > 0:
        values["prefetch_factor"] = dataloader.prefetch_factor
    values.update(sampling)
    return _reinstantiated(dataloader, DataLoader, values, "DataLoader", required=("dataset", "batch_sampler"),
                           replaced=sampling)


def fixed_batch_size(batch_sampler: Any) -> int | None:
    """The batch size of a user's batch sampler whose class does not take one (``None`` when it does).

    Such a sampler still must take a ``sampler`` (as Lightning requires to add its distributed sampler), and
    say its size in a ``batch_size`` attribute: the strategy then gives each rank whole batches.
    """
    cls = type(batch_sampler)
    params = inspect.signature(cls.__init__).parameters
    if "sampler" not in params:
        raise field_error("DataLoader.batch_sampler", cls.__name__,
                          "take a `sampler` argument (as torch's BatchSampler does) so the hetero strategy can give "
                          "it this rank's slices of every global batch",
                          "or pass Trainer(use_distributed_sampler=False) and size each rank's batches with "
                          "strategy.planned_batch_size()")
    if "batch_size" in params:
        return None
    size = getattr(batch_sampler, "batch_size", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise field_error("DataLoader.batch_sampler.batch_size", size,
                          "be its batches' size (an integer >= 1) when its class takes no batch_size argument: the "
                          "hetero strategy then gives each rank whole batches")
    return size


def rebuild_batch_sampler(batch_sampler: Any, sampler: Sampler[int], batch_size: int | None) -> Any:
    """The user's batch sampler class over ``sampler``, with ``batch_size`` samples per batch (``None``: its
    own fixed size, see ``fixed_batch_size``)."""
    values: dict[str, Any] = {"sampler": sampler}
    if batch_size is not None:
        values["batch_size"] = batch_size
    if hasattr(batch_sampler, "drop_last"):
        values["drop_last"] = batch_sampler.drop_last
    return _reinstantiated(batch_sampler, BatchSampler, values, "DataLoader.batch_sampler",
                           required=tuple(values.keys() - {"drop_last"}))


def bind_position(loader: DataLoader, state_dict: Callable[[], dict[str, Any]],
                  load_state_dict: Callable[[dict[str, Any]], None]) -> DataLoader:
    """``loader`` saving and restoring its position through ``state_dict``/``load_state_dict``.

    Lightning checks a loader's resumability by those two attributes, so they are set on the instance:
    the user's class stays what it is.
    """
    loader.state_dict = state_dict  # type: ignore[method-assign]
    loader.load_state_dict = load_state_dict  # type: ignore[method-assign]
    return loader


def _takes_kwargs(params: Any) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def _refused_arguments(field: str, cls: type, refused: list[str]) -> Exception:
    return field_error(field, cls.__name__, f"accept the arguments {refused} in its __init__ (or **kwargs), "
                      "so the hetero strategy can build it again around each rank's share")


def _reinstantiated(obj: Any, base: type, values: dict[str, Any], field: str, required: tuple[str, ...],
                    replaced: dict[str, Any] | None = None) -> Any:
    """``type(obj)`` built again: its recorded call with ``replaced`` (default ``values``) in place of those
    arguments, or, unrecorded, ``values`` plus, for its own ``__init__`` parameters, the attributes of ``obj``.

    ``required`` are the ``values`` its ``__init__`` must accept (the others are dropped when it has no such
    parameter: they are the base class's defaults).
    """
    cls = type(obj)
    if cls is base:
        return cls(**values)
    again = called_again(obj, values if replaced is None else replaced, required)
    if again is not None:
        built, refused = again
        if refused:
            raise _refused_arguments(field, cls, refused)
        return built
    params = inspect.signature(cls.__init__).parameters
    own = [p for name, p in params.items() if name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    kwargs = {p.name: getattr(obj, p.name) for p in own if p.name not in values and hasattr(obj, p.name)}
    missing = sorted(p.name for p in own if p.default is p.empty and p.name not in values and p.name not in kwargs)
    if missing:
        raise field_error(field, cls.__name__, f"keep its __init__ arguments {missing} as attributes of the same "
                          "name, so the hetero strategy can build it again around each rank's share (as Lightning "
                          "does to add its distributed sampler to a loader made outside its *_dataloader hooks)",
                          "or let Lightning hand the loader over (from a *_dataloader hook or trainer.fit's "
                          "dataloaders): its call is then recorded")
    if _takes_kwargs(params):
        kwargs.update(values)
    else:
        kwargs.update({k: v for k, v in values.items() if k in params})
        refused = sorted(k for k in values if k not in params and k in required)
        if refused:
            raise _refused_arguments(field, cls, refused)
    return cls(**kwargs)
