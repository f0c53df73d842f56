"""The ``hetero_diloco`` strategy's own options, checked when the strategy is built: ``DiLoCoOptions``.

Each bad value raises one ``ConfigError`` naming the argument (het-train: ``strategy.<argument>``), in the
user's script, before any rank starts.  The planner's budget fields (``max_inner_steps``, ``max_sync_overhead``,
``outer_codecs``, ``split``) default to, and are checked by, ``planning.low_communication.OuterSyncBudget``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Literal, get_args

from het_strategy.core.errors import field_error
from het_strategy.core.outer_sync import outer_codec
from het_strategy.planning.low_communication import DEFAULT_BUDGET, InnerSplit, OuterSyncBudget

__all__ = ["PLANNED", "GroupSplit", "DiLoCoOptions"]

PLANNED = "planned"
GroupSplit = Literal["node", "device"]
"""Groups by the cluster YAML: one per node, or one per device."""

_BUDGET_NAMES = {"max_inner_steps": "max_inner_steps", "max_sync_overhead": "max_sync_overhead",
                 "codecs": "outer_codecs", "groups": "groups", "split": "split"}
"""The budget's fields -> the strategy arguments they are given as."""


@dataclass(frozen=True)
class DiLoCoOptions:
    """What the user asks of the outer loop (``HeteroDiLoCoStrategy``'s arguments of the same names)."""

    inner_steps: int | str = PLANNED
    """H, or ``"planned"``: the planner chooses it within ``max_inner_steps`` and ``max_sync_overhead``."""
    outer_codec: str = PLANNED
    """The outer exchange's codec, or ``"planned"``: chosen among ``outer_codecs``."""
    groups: Any = "node"
    """``"node"``, ``"device"`` or a list of device-name lists."""
    split: InnerSplit | str = DEFAULT_BUDGET.split
    """Samples per inner step: ``planned`` by speed (a faster group takes more), or ``even`` over the devices."""
    max_inner_steps: int = DEFAULT_BUDGET.max_inner_steps
    """The quality budget: the largest H the planner may choose."""
    max_sync_overhead: float = DEFAULT_BUDGET.max_sync_overhead
    """The fraction of an outer round the planner lets the exchange take."""
    outer_codecs: tuple[str, ...] = DEFAULT_BUDGET.codecs
    """Codecs the planner may choose, the most faithful first."""
    outer_lr: float = 0.7
    """The default outer optimizer's learning rate (Nesterov SGD, as DiLoCo)."""
    outer_momentum: float = 0.9
    """The default outer optimizer's momentum."""
    outer_optimizer: Callable[[list[Any]], Any] | None = None
    """``params -> torch.optim.Optimizer`` instead of the default (e.g. ``functools.partial(torch.optim.SGD,
    lr=0.5, momentum=0.9, nesterov=True)``; Hydra: ``_partial_: true``)."""

    budget: OuterSyncBudget = field(init=False, repr=False, compare=False)
    """The planner's budget of these options (the split, the quality budget, the groups as given)."""

    def __post_init__(self) -> None:
        if self.inner_steps != PLANNED and (isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int)
                                            or self.inner_steps < 1):
            raise field_error("inner_steps", self.inner_steps, "be an integer >= 1 (inner steps per outer step) or "
                              "\"planned\"")
        if self.outer_codec != PLANNED:
            object.__setattr__(self, "outer_codec", str(outer_codec(self.outer_codec, "outer_codec")))
        if isinstance(self.groups, str) and self.groups not in get_args(GroupSplit):
            raise field_error("groups", self.groups, "be \"node\", \"device\" or a list of device-name lists (the "
                              "process groups are made before the plan; for a planned split run `het-plan "
                              "planner.mode=low_communication planner.outer_sync.groups=planned` and pass its plan)")
        budget = OuterSyncBudget(max_inner_steps=self.max_inner_steps, max_sync_overhead=self.max_sync_overhead,
                                 codecs=tuple(self.outer_codecs), groups=self.groups, split=self.split,
                                 names=_BUDGET_NAMES)
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "outer_codecs", budget.codecs)
        object.__setattr__(self, "split", budget.split)
        if not _number(self.outer_lr) or self.outer_lr <= 0:
            raise field_error("outer_lr", self.outer_lr, "be a number > 0")
        if not _number(self.outer_momentum) or not 0 <= self.outer_momentum < 1:
            raise field_error("outer_momentum", self.outer_momentum, "be a number in [0, 1)")
        if self.outer_optimizer is not None and not callable(self.outer_optimizer):
            raise field_error("outer_optimizer", type(self.outer_optimizer).__name__,
                              "be a callable params -> torch.optim.Optimizer (Hydra: _partial_: true)")
        if self.outer_optimizer is not None:  # its learning rate, checked on a stand-in parameter
            import torch

            self.make_outer_optimizer([torch.zeros(1, requires_grad=True)])

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The strategy arguments these options take."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    def pinned(self) -> dict[str, Any]:
        """The choices the user fixed (not ``"planned"``), by argument name."""
        return {k: getattr(self, k) for k in ("inner_steps", "outer_codec") if getattr(self, k) != PLANNED}

    def make_outer_optimizer(self, params: list[Any]) -> Any:
        """The outer optimizer over ``params``: the user's, or Nesterov SGD; ConfigError for a rate <= 0."""
        import torch

        make = self.outer_optimizer or partial(torch.optim.SGD, lr=self.outer_lr, momentum=self.outer_momentum,
                                               nesterov=self.outer_momentum > 0)
        optimizer = make(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise field_error("outer_optimizer", type(optimizer).__name__, "build a torch.optim.Optimizer")
        lr = optimizer.param_groups[0].get("lr")
        if not _number(lr) or lr <= 0:
            raise field_error("outer_optimizer.lr", lr, "be a number > 0 (the outer learning rate)")
        return optimizer


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))
