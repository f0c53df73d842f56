"""What a Lightning checkpoint carries for the ``hetero`` strategy, under ``checkpoint["het_strategy"]``.

``{"format": CHECKPOINT_FORMAT, "cluster", "devices", "global_batch_size", "plan", "shares", "compression"}``:
the Plan being run (after a rebalance, the rebalanced one), the cluster's
device names in rank order (a resume on other devices re-plans), the shares
in rank order, and every rank's compression state (error feedback is per
rank, and the checkpoint is written by rank 0 alone, so the states are
gathered first).

``CHECKPOINT_FORMAT`` is the one format number of what het_strategy writes into
a checkpoint (``hetero_deepspeed``'s client state carries it too,
``deepspeed_checkpoint.py``).  ``check_format`` refuses a checkpoint whose part
has no format or another one with one ``ConfigError`` naming the checkpoint.
A checkpoint with no ``het_strategy`` part (a plain Lightning one) loads, and
the run plans afresh.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from het_strategy.compression import CompressionState
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import ConfigError
from het_strategy.core.log import rank_zero_warning
from het_strategy.core.plan import Plan

__all__ = ["CHECKPOINT_KEY", "CHECKPOINT_FORMAT", "FORMAT_KEY", "strategy_state", "check_format",
           "gather_compression", "restore_compression", "restored_state", "restored_plan"]

CHECKPOINT_KEY = "het_strategy"
"""Where a Lightning checkpoint holds the ``hetero`` strategy's part."""
CHECKPOINT_FORMAT = 2
"""The format of what het_strategy writes into checkpoints; a checkpoint of another format is refused."""
FORMAT_KEY = "format"


def strategy_state(cluster: ClusterSpec, plan: Plan, shares: list[int], compression: dict[str, Any] | None
                   ) -> dict[str, Any]:
    return {FORMAT_KEY: CHECKPOINT_FORMAT, "cluster": cluster.name, "devices": [d.name for d in cluster.devices],
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


def check_format(state: Any, checkpoint_path: Any, where: str) -> None:
    """Refuse ``state`` (het_strategy's part of the checkpoint at ``checkpoint_path``, found at ``where``) unless
    it is a mapping of ``CHECKPOINT_FORMAT``."""
    found = state.get(FORMAT_KEY) if isinstance(state, dict) else None
    if found == CHECKPOINT_FORMAT:
        return
    written = "has no checkpoint format" if found is None else f"is of checkpoint format {found!r}"
    raise ConfigError(f"checkpoint {str(checkpoint_path)!r}: its {where} {written}; this het_strategy reads "
                      f"format {CHECKPOINT_FORMAT} only (fix: resume with the het_strategy version that wrote it, "
                      "or start the run afresh without ckpt_path)")


def restored_state(checkpoint: dict[str, Any], checkpoint_path: Any) -> dict[str, Any] | None:
    """The strategy's part of a loaded checkpoint (None if it has none), its format checked."""
    state = checkpoint.get(CHECKPOINT_KEY)
    if state is not None:
        check_format(state, checkpoint_path, f"entry {CHECKPOINT_KEY!r}")
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
