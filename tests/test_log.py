"""The het_strategy logger: notes on lines of their own, above a running progress bar."""

from __future__ import annotations

import io
import logging
import sys

import tqdm

import het_strategy  # noqa: F401  (installs the handler)
from het_strategy.core.log import ProgressAwareHandler, logger


def test_a_note_during_a_progress_bar_gets_its_own_line(monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    handler = ProgressAwareHandler()
    record = logging.LogRecord("het_strategy", logging.INFO, __file__, 1, "straggler: rank 1 is slower", None, None)
    with tqdm.tqdm(total=3, file=out, ascii=True) as bar:
        bar.update(1)  # the bar's line has no newline now
        handler.emit(record)
        bar.update(1)
    lines = out.getvalue().replace("\r", "\n").split("\n")
    assert "straggler: rank 1 is slower" in lines  # a line of its own, not glued to "33%|###  | 1/3"


def test_without_a_bar_it_is_a_plain_line(monkeypatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    ProgressAwareHandler().emit(logging.LogRecord("het_strategy", logging.INFO, __file__, 1, "plan: %s", ("x",),
                                                  None))
    assert out.getvalue() == "plan: x\n"


def test_notes_are_shown_by_default() -> None:
    assert logger.isEnabledFor(logging.INFO)
    assert any(isinstance(h, ProgressAwareHandler) for h in logger.handlers) or logging.getLogger().handlers
