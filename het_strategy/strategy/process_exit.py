"""How a rank's process ends after a run: its process groups destroyed while the interpreter is still whole.

A gloo process group that is still alive when Python finalises is destroyed during finalisation; its worker
threads may then still hold finished work whose tensors have Python references (the futures of a comm hook's
``async_op=True`` collectives), and releasing them takes the GIL of an interpreter being torn down: the process
aborts with ``terminate called without an active exception`` (exit 134) after a run that succeeded.  Lightning
destroys the default group at exit only for NCCL (``lightning.fabric.utilities.distributed``); for any backend,
``destroy_groups_at_exit`` registers one ``atexit`` handler per process that destroys every group
(``torch.distributed.destroy_process_group()``) before finalisation.

After a failure (``mark_failed``, from the strategy's ``on_exception``) the handler does nothing: a collective a
dead peer never completes could keep the destroy waiting, and the process is ending with an error anyway.
"""

from __future__ import annotations

import atexit
import signal

__all__ = ["destroy_groups_at_exit", "mark_failed"]

_state = {"registered": False, "failed": False}


def destroy_groups_at_exit() -> None:
    """Destroy every process group when this process exits normally (registered once per process)."""
    if not _state["registered"]:
        _state["registered"] = True
        atexit.register(_destroy_groups)


def mark_failed() -> None:
    """This process ends after an exception: leave its groups to the operating system."""
    _state["failed"] = True


def _destroy_groups() -> None:
    import torch.distributed as dist

    if _state["failed"] or not (dist.is_available() and dist.is_initialized()):
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl+C now would leave the groups half-destroyed
    try:
        dist.destroy_process_group()
    finally:
        signal.signal(signal.SIGINT, previous)
