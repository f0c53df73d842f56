"""Reading the files a user names: one reader for every cluster, model, plan, score and checkpoint path.

Each failure is one ``ConfigError`` in the house form, naming the field the
path was given for and the file:

1. the path must name a regular file: a missing path, a directory, a named
   pipe, a socket or a device is refused from ``os.stat`` alone, so nothing is
   opened that could block (a pipe waits for a writer) or never end (a device);
2. the file must be readable by this user (a permission error, not a traceback);
3. the text must be UTF-8 and must not be empty (blank lines and comments only
   count as empty);
4. YAML and JSON must parse; the error gives the parser's reason and its line.

``naming_file`` adds the file to an error found later in its content
(``cluster.nodes[0].name`` ... ``(in cluster file c.yaml)``).  Pure Python: no torch.
"""

from __future__ import annotations

import json
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from het_strategy.core.errors import ConfigError, field_error

__all__ = ["regular_file", "check_readable_file", "read_text_file", "read_yaml_file", "read_json_file",
           "naming_file"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def regular_file(path: str | Path, field: str, what: str = "file") -> Path:
    """``path`` as a Path when it names an existing regular file (``os.stat`` only, nothing is opened);
    ConfigError naming ``field`` otherwise.  ``what`` names the file's kind in the rule ("plan JSON file")."""
    path = Path(path).expanduser()
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise field_error(field, str(path), f"be an existing {what}", "no such file") from None
    except PermissionError:
        raise field_error(field, str(path), f"be a {what} this user can reach",
                          "permission denied on a folder of its path") from None
    except OSError as exc:  # a file where a folder should be, a loop of links, a name too long, ...
        raise field_error(field, str(path), f"be an existing {what}", exc.strerror or type(exc).__name__) from None
    if not stat.S_ISREG(mode):
        raise field_error(field, str(path), f"be a regular {what}; it is {_kind(mode)}")
    return path


def _read_bytes(path: Path, field: str, what: str, limit: int | None = None) -> bytes:
    """The bytes of a regular file (all of them, or the first ``limit``): opened without blocking, and checked
    again once open (the path may have been replaced since ``regular_file`` looked)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except PermissionError:
        raise field_error(field, str(path), f"be a {what} this user can read", "permission denied") from None
    except OSError as exc:
        raise field_error(field, str(path), f"be a readable {what}", exc.strerror or type(exc).__name__) from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise field_error(field, str(path), f"be a regular {what}; it is {_kind(mode)}")
        try:
            return fh.read() if limit is None else fh.read(limit)
        except OSError as exc:
            raise field_error(field, str(path), f"be a readable {what}", exc.strerror or type(exc).__name__) from None


def check_readable_file(path: str | Path, field: str, what: str = "file") -> Path:
    """``path`` when it is a regular file this user can read (its first byte is read, nothing more)."""
    path = regular_file(path, field, what)
    _read_bytes(path, field, what, limit=1)
    return path


def read_text_file(path: str | Path, field: str, what: str = "file") -> tuple[Path, str]:
    """The path and the UTF-8 text of a regular, readable, non-empty file; ConfigError naming ``field``."""
    path = regular_file(path, field, what)
    data = _read_bytes(path, field, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise field_error(field, str(path), f"be a UTF-8 text {what}",
                          f"byte {exc.start} is {data[exc.start:exc.start + 1]!r}") from None
    if not text.strip():
        raise field_error(field, str(path), f"be a {what} with content; it is empty")
    return path, text


def read_yaml_file(path: str | Path, field: str, what: str = "YAML file", mapping: bool = True) -> tuple[Path, Any]:
    """The path and the parsed content of a YAML file (a mapping at the top unless ``mapping=False``).

    An alias loop or absurd nesting is refused here too (``cluster_limits.check_yaml_tree``), so no reader
    of the result recurses without end.
    """
    import yaml

    from het_strategy.core.cluster_limits import check_yaml_tree

    path, text = read_text_file(path, field, what)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise field_error(field, str(path), f"be valid YAML ({reason}{where})") from None
    except RecursionError:
        raise field_error(field, str(path), "be YAML nested less deeply (the parser ran out of stack)") from None
    if raw is None:
        raise field_error(field, str(path), f"be a {what} with content; it holds only comments or blank lines")
    check_yaml_tree(raw, f"{what} {path}", field=field)
    if mapping and not isinstance(raw, dict):
        raise field_error(field, str(path), f"hold a mapping (key: value) at the top level; it holds a "
                          f"{_yaml_kind(raw)}")
    return path, raw


def read_json_file(path: str | Path, field: str, what: str = "JSON file") -> tuple[Path, Any]:
    """The path and the parsed content of a JSON file."""
    path, text = read_text_file(path, field, what)
    try:
        return path, json.loads(text)
    except json.JSONDecodeError as exc:
        raise field_error(field, str(path), f"be valid JSON ({exc.msg} at line {exc.lineno}, column "
                          f"{exc.colno})") from None
    except RecursionError:
        raise field_error(field, str(path), "be JSON nested less deeply (the parser ran out of stack)") from None


@contextmanager
def naming_file(path: str | Path, what: str) -> Iterator[None]:
    """Add ``(in <what> <path>)`` to a ConfigError raised in the block that does not already name the file."""
    try:
        yield
    except ConfigError as exc:
        msg = str(exc)
        if str(path) in msg:
            raise
        raise ConfigError(f"{msg} (in {what} {path})", field=exc.field, value=exc.value) from None


def _yaml_kind(raw: Any) -> str:
    if isinstance(raw, list):
        return "list"
    if isinstance(raw, str):
        return "string"
    if isinstance(raw, bool):
        return "boolean"
    if isinstance(raw, (int, float)):
        return "number"
    return type(raw).__name__
