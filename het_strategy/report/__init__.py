"""What users read: the plan table (``table.py``) and its picture (``picture.py``, matplotlib)."""

from het_strategy._moved_modules import moved_name


def __getattr__(name: str) -> object:
    """0.1.0's module of this name is now ``report.table``: its names resolve here for one release (warned)."""
    return moved_name(__name__, name, ("table", "picture"))
