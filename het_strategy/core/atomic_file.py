"""Writing a file whole or not at all: a temporary file beside the target, then one rename.

A reader (or a crash) never sees a half-written plan, config, cache entry or
picture: the content goes to a hidden temporary file in the target's folder,
which then replaces the target in one ``os.replace``.  The file gets the
ordinary mode of a new file (``0o666`` less the umask), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["write_atomic", "replacing"]


@contextmanager
def replacing(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; when the block ends cleanly it replaces ``path``.

    On any exception (KeyboardInterrupt included) the temporary file is removed
    and ``path`` is left as it was.  ``suffix`` ends the temporary name, for
    writers that pick a format by it (``.tmp.png``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and a rename; returns ``path``."""
    path = Path(path)
    with replacing(path) as tmp:
        tmp.write_text(text)
    return path
