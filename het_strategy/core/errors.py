"""The one error type that bad input raises.

Every message names the field, the value and the rule (and, where there is
one, the fix), so a user can correct a YAML file without reading our code.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from enum import Enum
from typing import Any, Iterator, Mapping, Sequence, TypeVar

E = TypeVar("E", bound=Enum)

__all__ = ["ConfigError", "field_error", "fields_under", "check_keys", "is_positive", "require_number",
           "require_int", "require_option", "alternatives"]


class ConfigError(ValueError):
    """Bad cluster, model, batch or plan input; the CLIs turn it into exit code 2."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None,
                 reported_by_rank_zero: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.reported_by_rank_zero = reported_by_rank_zero
        """Rank 0 raised the same error and reports it: the CLIs exit 2 here without printing it again."""


def alternatives(values: Sequence[Any]) -> str:
    """``values`` as a rule reads them: ``(0, 1, 2)`` -> ``"0, 1 or 2"``."""
    words = [str(v) for v in values]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def field_error(field: str, value: Any, rule: str, fix: str | None = None) -> ConfigError:
    """Build ``ConfigError`` in the house form: "`field` is value; it must rule (fix)".

    A missing value (None) is shown as ``null``, the way config files and overrides spell it, and an option
    enum's member as its plain string.
    """
    shown = "null" if value is None else repr(str(value) if isinstance(value, str) else value)
    msg = f"`{field}` is {shown}; it must {rule}"
    if fix:
        msg += f" ({fix})"
    return ConfigError(msg, field=field, value=value)


@contextmanager
def fields_under(prefix: str, *names: str) -> Iterator[None]:
    """Give errors raised in the block their full dotted path: a ConfigError whose field is one of ``names``
    (or an index or key below one: ``blocks[2]``) is raised again as ``<prefix>.<field>``, for code that checks
    a value without knowing where in a config it sits."""
    try:
        yield
    except ConfigError as exc:
        field = exc.field or ""
        if not any(re.fullmatch(rf"{re.escape(name)}([.\[].*)?", field) for name in names):
            raise
        full = f"{prefix}.{field}"
        raise ConfigError(str(exc).replace(f"`{field}`", f"`{full}`", 1), field=full, value=exc.value) from None


def is_positive(v: Any) -> bool:
    """True for a finite real number > 0 (bools are not numbers here)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def require_number(v: Any, field: str, allow_zero: bool = False) -> float:
    """``v`` as a float, or ConfigError if it is not a finite number > 0 (>= 0 with allow_zero)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise field_error(field, v, "be a number")
    if v < 0 or (v == 0 and not allow_zero):
        raise field_error(field, v, "be >= 0" if allow_zero else "be > 0")
    return float(v)


def require_int(v: Any, field: str, minimum: int = 0) -> int:
    """``v`` as an int >= minimum, or ConfigError."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise field_error(field, v, "be an integer")
    if v < minimum:
        raise field_error(field, v, f"be >= {minimum}")
    return v


def require_option(kind: type[E], value: Any, field: str, rule: str | None = None) -> E:
    """``value`` as a member of the option enum ``kind`` (a member, or its value), or ConfigError listing them."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        options = ", ".join(str(m.value) for m in kind)
        raise field_error(field, value, f"be one of {options}" + (f" ({rule})" if rule else "")) from None


def check_keys(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """Reject keys a schema does not know (a typo must not be silently ignored)."""
    for key in raw:
        if key not in allowed:
            raise field_error(f"{where}.{key}", raw[key], "not be there: unknown key",
                              f"allowed keys: {', '.join(sorted(allowed))}")
