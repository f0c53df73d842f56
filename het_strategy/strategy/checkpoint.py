"""What a Lightning checkpoint carries for the ``hetero`` strategy, under ``checkpoint["het_strategy"]``.

``{"version": 1, "cluster", "devices", "global_batch_size", "plan", "shares", "compression"}``:
the Plan being run (after a rebalance, the rebalanced one), the cluster's
device names in rank order (a resume on other devices re-plans), the shares
in rank order, and every rank's compression state (error feedback is per
rank, and the checkpoint is written by rank 0 alone, so the states are
gathered first).  Version 1 is what 0.1.0 wrote; it still loads.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from het_strategy.compression import CompressionState
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_zero_warning
from het_strategy.core.plan import Plan

__all__ = ["CHECKPOINT_KEY", "STATE_VERSION", "strategy_state", "gather_compression", "restore_compression",
           "restored_state", "restored_plan"]

CHECKPOINT_KEY = "het_strategy"
STATE_VERSION = 1


def strategy_state(cluster: ClusterSpec, plan: Plan, shares: list[int], compression: dict[str, Any] | None
                   ) -> dict[str, Any]:
    return {"version": STATE_VERSION, "cluster": cluster.name, "devices": [d.name for d in cluster.devices],
            "global_batch_size": plan.global_batch_size, "plan": plan.to_dict(), "shares": shares,
            "compression": compression}


def gather_compression(state: CompressionState | None, world_size: int) -> dict[str, Any] | None:
    """Every rank's compression state.  A collective: Lightning calls ``save_checkpoint`` on every rank."""
    if state is None:
        return None
    own = state.state_dict()
    if not dist.is_initialized() or world_size == 1:
        return {"ranks": [own]}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, own)
    return {"ranks": gathered}


def restore_compression(state: CompressionState, ranks: list[dict[str, Any]], world_size: int, rank: int) -> None:
    """This rank's own saved state; from another world size, the shared choices without the per-rank residuals."""
    if len(ranks) == world_size:
        state.load_state_dict(ranks[rank])
        return
    state.load_state_dict({**ranks[0], "residuals": {}, "chunk_residuals": {}, "powersgd": None, "generator": None})
    rank_zero_warning(rank, "the checkpoint's compression state is from %d ranks, this run has %d: its "
                      "error-feedback residuals are dropped", len(ranks), world_size)


def restored_state(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """The strategy's part of a loaded checkpoint (None if it has none), its version checked."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is not None and state.get("version") != STATE_VERSION:
        raise field_error(f"checkpoint[{CHECKPOINT_KEY!r}].version", state.get("version"), f"be {STATE_VERSION}",
                          "the checkpoint was written by another het_strategy")
    return state


def restored_plan(state: dict[str, Any] | None, cluster: ClusterSpec, global_batch: int, rank: int) -> Plan | None:
    """The checkpoint's Plan if it was made for these devices and this global batch (else None: re-plan)."""
    if state is None:
        return None
    names = [d.name for d in cluster.devices]
    if state["devices"] != names or state["global_batch_size"] != global_batch:
        rank_zero_warning(rank, "het_strategy: the checkpoint's plan was made for devices %s and global batch %s; "
                          "this run has %s and %s: re-planning", state["devices"], state["global_batch_size"],
                          names, global_batch)
        return None
    return Plan.from_dict(state["plan"])
