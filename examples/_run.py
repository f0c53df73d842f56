"""What the examples' ``main`` functions share: the ``--epochs`` flag and the Trainer arguments of a quiet run.

``epochs_parser`` is the command line every training example takes (the
example adds its own flags); ``QUIET_RUN`` keeps a run's output to what the
example prints: no logger, checkpoints, model summary or progress bar.
"""

from __future__ import annotations

import argparse

__all__ = ["QUIET_RUN", "epochs_parser"]

QUIET_RUN = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False,
             "enable_progress_bar": False}
"""``Trainer(**QUIET_RUN)``: nothing written or shown but what the example prints."""


def epochs_parser(doc: str, epochs: int, **kwargs: object) -> argparse.ArgumentParser:
    """A parser described by the example's docstring ``doc``, with ``--epochs`` (default ``epochs``)."""
    parser = argparse.ArgumentParser(description=doc, **kwargs)  # type: ignore[arg-type]
    parser.add_argument("--epochs", type=int, default=epochs)
    return parser
