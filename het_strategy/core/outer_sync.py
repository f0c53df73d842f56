"""The low-communication part of a Plan: how often and in what codec the groups exchange parameters.

A plan run by ``strategy="hetero_diloco"`` (DiLoCo across groups of devices)
carries one ``OuterSync``:

- ``groups`` — the devices split into groups (by default one per node of the
  cluster YAML); each group trains as an uneven data-parallel replica of its
  own, its gradients all-reduced inside the group only;
- ``inner_steps`` — H, the optimizer steps each group takes between two outer
  steps (every group the same count: a faster group gets more samples per step,
  the plan's shares);
- ``codec`` — how each group's pseudo-gradient crosses the slow link: a codec
  of the registry (``core/codecs.py``) whose payload an all-gather among the
  groups' leaders carries (``OUTER_CODECS``: a cast or a bucketed quantizer).

JSON form: ``"outer_sync": {"inner_steps": 50, "codec": "q4", "groups": [["a0",
"a1"], ["b0", "b1"]]}``.  Pure Python: the planner and the plan file read it
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from het_strategy.core.codecs import CODECS, Codec, Exchange, codec
from het_strategy.core.errors import check_keys, field_error, require_int

__all__ = ["OUTER_CODECS", "OuterSync", "outer_codec"]

OUTER_CODECS: tuple[Codec, ...] = tuple(token for token, spec in CODECS.items()
                                        if spec.exchange in (Exchange.ALLREDUCE, Exchange.QUANTIZED))
"""Codecs the outer exchange carries: a whole flat tensor each group encodes on its own (a cast, or a bucketed
quantizer with error feedback).  Top-k and PowerSGD need the shapes of the layers and a state of their own
across rounds; the outer exchange sends one flat pseudo-gradient, so they are refused."""


def outer_codec(token: Any, field: str) -> Codec:
    """``token`` as a codec the outer exchange carries, or a ConfigError naming ``field``."""
    return codec(token, field, OUTER_CODECS)


@dataclass(frozen=True)
class OuterSync:
    """Groups, inner steps per outer step, and the outer exchange's codec (module docstring)."""

    inner_steps: int
    """H: optimizer steps of every group between two outer steps (>= 1)."""
    codec: Codec
    """The outer exchange's codec (one of ``OUTER_CODECS``)."""
    groups: tuple[tuple[str, ...], ...]
    """Device names per group, each group non-empty, no device in two groups."""

    def __post_init__(self) -> None:
        require_int(self.inner_steps, "plan.outer_sync.inner_steps", minimum=1)
        object.__setattr__(self, "codec", outer_codec(self.codec, "plan.outer_sync.codec"))
        groups = tuple(tuple(str(d) for d in group) for group in self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups:
            raise field_error("plan.outer_sync.groups", [], "list at least one group of devices")
        seen: set[str] = set()
        for g, group in enumerate(groups):
            if not group:
                raise field_error(f"plan.outer_sync.groups[{g}]", [], "list at least one device")
            for device in group:
                if device in seen:
                    raise field_error(f"plan.outer_sync.groups[{g}]", list(group),
                                      f"not repeat `{device}`, which another group already holds")
                seen.add(device)

    def check_covers(self, devices: Sequence[str], field: str = "plan.outer_sync.groups") -> None:
        """Every device of ``devices`` in exactly one group, and no other device (ConfigError naming ``field``)."""
        held = [d for group in self.groups for d in group]
        missing = [d for d in devices if d not in held]
        extra = [d for d in held if d not in devices]
        if missing or extra:
            parts = ([f"it lacks {', '.join(missing)}"] if missing else []) + (
                [f"{', '.join(extra)} take no part in the plan"] if extra else [])
            raise field_error(field, [list(g) for g in self.groups],
                              f"cover the plan's devices exactly once ({'; '.join(parts)})")

    def group_of(self, device: str) -> int:
        """The index of the group holding ``device``."""
        for g, group in enumerate(self.groups):
            if device in group:
                return g
        raise KeyError(device)

    def to_dict(self) -> dict[str, Any]:
        return {"inner_steps": self.inner_steps, "codec": str(self.codec), "groups": [list(g) for g in self.groups]}

    @classmethod
    def from_dict(cls, raw: Any, where: str = "plan.outer_sync") -> "OuterSync":
        if not isinstance(raw, Mapping):
            raise field_error(where, raw, "be a mapping with inner_steps, codec and groups")
        check_keys(raw, {"inner_steps", "codec", "groups"}, where)
        for key in ("inner_steps", "codec", "groups"):
            if key not in raw:
                raise field_error(f"{where}.{key}", None, "be given")
        groups = raw["groups"]
        if not isinstance(groups, list) or not all(
                isinstance(g, list) and all(isinstance(d, str) for d in g) for g in groups):
            raise field_error(f"{where}.groups", groups, "be a list of lists of device names")
        return cls(raw["inner_steps"], raw["codec"], tuple(tuple(g) for g in groups))
