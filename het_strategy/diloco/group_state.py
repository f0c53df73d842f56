"""What a checkpoint of ``hetero_diloco`` holds beyond Lightning's, and how each group finds its part.

Lightning writes rank 0's file; its ``state_dict`` is the model with the outer
(global) parameters.  Between two outer steps each group's parameters and inner
optimizer differ, so the strategy adds, under ``CHECKPOINT_KEY``:

- ``shared`` — the outer parameters, the outer optimizer, the inner steps per
  round, the step within the round and the rounds taken (equal on every rank);
- ``groups`` — every group's global ranks (a resume with other groups cannot map
  the groups' parts: it starts a new round from the outer parameters, logged);
- ``group_states`` — per group, gathered from its leader: its parameters
  (flat), its inner optimizers' states, its samples in the unfinished round and
  its error-feedback residual;
- ``codec`` — the codec the residuals were made in.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from het_strategy.core.errors import ConfigError
from het_strategy.core.log import logger
from het_strategy.diloco.groups import DiLoCoGroups
from het_strategy.diloco.outer_loop import OuterLoop

__all__ = ["CHECKPOINT_KEY", "FORMAT", "gather_state", "group_part", "copy_flat_into"]

CHECKPOINT_KEY = "hetero_diloco"
FORMAT = 1


def _cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def gather_state(loop: OuterLoop, groups: DiLoCoGroups, optimizers: Sequence[torch.optim.Optimizer],
                 rank: int, world: int) -> dict[str, Any] | None:
    """The checkpoint's ``CHECKPOINT_KEY`` part on rank 0 (None elsewhere); a collective over every rank."""
    part = None
    if rank == groups.leader:
        exchange = loop.exchange
        part = {"local": loop.local_flat(), "inner_optimizers": [_cpu(opt.state_dict()) for opt in optimizers],
                "round_samples": loop.round_samples,
                "residual": None if exchange is None or exchange.residual is None else exchange.residual.cpu()}
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(part, gathered, dst=0)
    if gathered is None:
        return None
    return {"format": FORMAT, "groups": [list(members) for members in groups.ranks],
            "codec": None if loop.exchange is None else str(loop.exchange.spec.token), "shared": loop.state_dict(),
            "group_states": [gathered[members[0]] for members in groups.ranks]}


def group_part(saved: Any, groups: DiLoCoGroups, where: str) -> dict[str, Any] | None:
    """This rank's group's part of a checkpoint's ``CHECKPOINT_KEY`` (``where``: the file, for messages), or
    None when the checkpoint has none or was made with other groups (logged: the run starts a new round from
    the checkpoint's model, the outer parameters)."""
    if saved is None:
        logger.info("hetero_diloco: %s holds no outer state (a checkpoint of another strategy): the outer loop "
                    "starts from its model", where)
        return None
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ConfigError(f"`{CHECKPOINT_KEY}` in {where} is not a hetero_diloco checkpoint part of format {FORMAT}",
                          field="ckpt_path")
    if saved["groups"] != [list(members) for members in groups.ranks]:
        logger.info("hetero_diloco: %s was made with the groups %s, this run has %s: the groups' unfinished round "
                    "is dropped and a new one starts from the outer parameters", where, saved["groups"],
                    [list(m) for m in groups.ranks])
        return None
    return {"shared": saved["shared"], "codec": saved["codec"], **saved["group_states"][groups.index]}


def copy_flat_into(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Set ``params`` (in order) from one flat tensor of all of them."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ConfigError(f"the checkpoint's group parameters hold {flat.numel()} values, the model {total}: the "
                          "checkpoint is of another model", field="ckpt_path")
    start = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[start:start + p.numel()].view_as(p).to(p.device, p.dtype))
            start += p.numel()
