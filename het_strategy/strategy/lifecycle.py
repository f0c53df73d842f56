"""``RunLifecycle``: how a rank's run starts, is watched and ends, the same for every strategy.

1. **Construction** (in the user's script): the heartbeat bound and the collectives' timeout are checked, and
   ranks that name their devices must run under an agent that keeps its store (``elastic.check_agent_store``).
2. ``join_process_group`` (before Lightning's own ``setup_distributed``): under torchrun's agent store, each
   restart joins a process group of its own attempt (``elastic.init_attempt_process_group``).
3. ``devices_present`` / ``start`` (once the group is up): the devices the ranks named, then this rank's heartbeat
   and watchdog (``liveness.LivenessGuard``), and the process groups destroyed at a normal exit.
4. ``failed`` (from ``on_exception``): a collective that failed because a rank is gone ends with the watchdog's one
   line; ``stop`` (teardown) ends the heartbeat; ``writing()`` keeps a checkpoint whole while a peer is lost.

The run owns the collectives' timeout (``timeout``): it is what it hands Lightning and its own process groups.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Sequence

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_debug
from het_strategy.strategy.elastic import check_agent_store, gather_device_names, init_attempt_process_group
from het_strategy.strategy.liveness import COLLECTIVE_TIMEOUT_S, LivenessGuard
from het_strategy.strategy.process_exit import destroy_groups_at_exit, mark_failed

__all__ = ["RunLifecycle", "check_timeouts"]


def check_timeouts(heartbeat_timeout_s: Any, timeout: Any) -> None:
    """``heartbeat_timeout_s`` (seconds, or None: no heartbeat) and Lightning's ``timeout`` (a ``timedelta``)."""
    if heartbeat_timeout_s is not None and (isinstance(heartbeat_timeout_s, bool)
                                            or not isinstance(heartbeat_timeout_s, (int, float))
                                            or not 0 < heartbeat_timeout_s < float("inf")):
        raise field_error("heartbeat_timeout_s", heartbeat_timeout_s, "be a number of seconds > 0, or None (off)")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise field_error("timeout", timeout, "be a datetime.timedelta > 0 (each collective's timeout)")


class RunLifecycle:
    """A rank's heartbeat, elastic restart and end of process (see the module docstring).

    Args:
        heartbeat_timeout_s: a rank silent this long is gone (None: no heartbeat).
        timeout: each collective's timeout (Lightning's ``timeout=``); None: ``COLLECTIVE_TIMEOUT_S``.
        backend: the process group backend the user asked for (Lightning's ``process_group_backend=``); None: torch's
            default for each device type.
    """

    def __init__(self, heartbeat_timeout_s: float | None, timeout: timedelta | None = None,
                 backend: str | None = None) -> None:
        check_timeouts(heartbeat_timeout_s, timeout)
        check_agent_store()  # ranks that name their devices run under an agent that keeps its store
        self.timeout = timeout if timeout is not None else timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        """Each collective's timeout."""
        self.backend = backend
        self.liveness = LivenessGuard(heartbeat_timeout_s)
        """This rank's heartbeat and watchdog (from ``start``, with more than one rank)."""

    def join_process_group(self, rank: int, world_size: int) -> None:
        """Under torchrun's agent store: the default process group of this restart's attempt (else nothing)."""
        if init_attempt_process_group(self.backend, rank, world_size, self.timeout):
            rank_debug(rank, "process group of restart %s", os.environ.get("TORCHELASTIC_RESTART_COUNT"))

    def devices_present(self, world_size: int) -> list[str] | None:
        """The device each rank named (``HET_STRATEGY_DEVICE``; a collective), or None when none did."""
        return gather_device_names(world_size)

    def start(self, rank: int, world_size: int, devices: Sequence[Any]) -> None:
        """Beat and watch (``devices[r]`` names rank ``r``), and destroy the process groups at a normal exit."""
        self.liveness.start(rank, world_size, devices)
        destroy_groups_at_exit()

    def failed(self, exception: BaseException) -> None:
        """This rank ends after ``exception``: a lost peer's verdict first, when that is what it was."""
        mark_failed()
        self.liveness.after(exception)

    def stop(self) -> None:
        self.liveness.stop()

    def writing(self) -> AbstractContextManager[None]:
        """While a checkpoint is written a lost peer ends this rank only once the file is complete."""
        return self.liveness.writing()
