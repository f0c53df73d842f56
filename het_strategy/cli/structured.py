"""Structured configs of the Hydra tools: a dataclass schema in Hydra's ConfigStore, and the composed config as it.

``store_schema`` stores a dataclass as a named schema that a primary config
names first in its defaults list, so Hydra checks every override and group
file against the field types while it composes.  Frozen dataclasses
(``TrainSettings``, ``PlanRequest``) are read-only in OmegaConf; the stored
schema is a writable copy, so overrides still apply, and ``to_typed`` builds
the dataclasses themselves, whose ``__post_init__`` checks the values.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from het_strategy.cli._common import schema_error
from het_strategy.core.errors import ConfigError, field_error

__all__ = ["store_schema", "to_typed"]

T = TypeVar("T")


def store_schema(name: str, node_type: type) -> None:
    """Store ``node_type`` as the schema ``name`` (idempotent: the store replaces its entry)."""
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.structured(node_type)
    _writable(node)
    ConfigStore.instance().store(name=name, node=node)


def _writable(node: DictConfig) -> None:
    node._set_flag("readonly", None)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _writable(child)


def to_typed(cfg: DictConfig, kind: type[T]) -> T:
    """The composed config as ``kind``; keys the schema lacks and bad values raise ConfigError."""
    _refuse_added_keys(cfg, "")
    try:
        typed = OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        key = str(getattr(exc, "full_key", "") or "config")
        raise ConfigError(f"`{key}` is missing; it must be given (set {key}=...)", field=key) from None
    except OmegaConfBaseException as exc:
        raise schema_error(exc) from None
    assert isinstance(typed, kind)
    return typed


def _refuse_added_keys(node: DictConfig, where: str) -> None:
    """``+train.foo=1`` adds a key Hydra lets through and ``to_object`` would drop silently: refuse it."""
    kind = OmegaConf.get_type(node)
    if not (isinstance(kind, type) and is_dataclass(kind)):
        return
    known = {f.name for f in fields(kind)}
    for key in node.keys():
        path = f"{where}{key}"
        if key not in known:
            value: Any = OmegaConf.select(node, str(key), throw_on_missing=False)
            raise field_error(path, value, "not be there: unknown key", f"known keys here: {', '.join(sorted(known))}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            _refuse_added_keys(child, f"{path}.")
