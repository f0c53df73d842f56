"""OmegaConf nodes as plain dicts and lists, so every API that takes a mapping takes a Hydra config too.

A cluster, model or plan given inline in a Hydra config arrives as a
``DictConfig`` whose lists are ``ListConfig``s; the schema checks expect
``dict`` and ``list``.  ``plain`` converts such a node (resolving
interpolations) and passes anything else through unchanged.  omegaconf is
imported only when a node is seen.
"""

from __future__ import annotations

from typing import Any

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """``value`` with OmegaConf containers turned into dicts and lists (anything else as it is)."""
    if type(value).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(value, resolve=True)
    return value
