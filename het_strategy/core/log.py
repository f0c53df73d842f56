"""The ``het_strategy`` logger, rank-aware: debug lines carry the rank; warnings and notes come from rank 0 only."""

from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["logger", "rank_debug", "rank_zero_info", "rank_zero_warning", "quiet_known_warnings", "install_handler"]

logger = logging.getLogger("het_strategy")


class ProgressAwareHandler(logging.Handler):
    """Writes each message on lines of its own on stdout: above a running tqdm progress bar (``tqdm.write``,
    which clears and redraws the bar) when one is drawn, so a message is never glued to the bar's line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)
            tqdm = sys.modules.get("tqdm")
            bars = getattr(getattr(tqdm, "tqdm", None), "_instances", None)
            if bars:
                tqdm.tqdm.write(message, file=sys.stdout)
            else:
                sys.stdout.write(message + "\n")
                sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging must not raise (the stdlib handlers do the same)
            self.handleError(record)


def install_handler() -> None:
    """Notes (INFO) and warnings of ``het_strategy`` are shown: through the root logger's handlers when the
    application configured logging, else through ``ProgressAwareHandler`` (as Lightning does for its own)."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logging.getLogger().handlers and not any(isinstance(h, ProgressAwareHandler) for h in logger.handlers):
        logger.addHandler(ProgressAwareHandler())
        logger.propagate = False


def rank_debug(rank: int, message: str, *args: object) -> None:
    """One lifecycle line, e.g. ``rank_debug(rank, "setup: cluster %s", name)``."""
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("[rank %d] " + message, rank, *args)


def rank_zero_warning(rank: int, message: str, *args: object) -> None:
    """Something the user should know, said once (by rank 0)."""
    if rank == 0:
        logger.warning(message, *args)


def rank_zero_info(rank: int, message: str, *args: object) -> None:
    """A note on what the run does (e.g. the plan it chose), said once (by rank 0)."""
    if rank == 0:
        logger.info(message, *args)


KNOWN_WARNINGS = (
    # torch 2.13 deprecates constructing LeafSpec; Lightning 2.6's own pytree copy still does, once per step
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     r"(lightning\.pytorch|pytorch_lightning)\.utilities\._pytree"),
)
"""(message, category, the module that triggers it): warnings of the pinned torch / Lightning pair that a user
can do nothing about."""


def quiet_known_warnings() -> None:
    """Ignore ``KNOWN_WARNINGS``, each only where it comes from (the same message elsewhere still shows)."""
    for message, category, module in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
