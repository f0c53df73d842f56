"""What users read: the plan table (``table.py``) and its picture (``picture.py``, matplotlib)."""

import importlib
import warnings


def __getattr__(name: str) -> object:
    """0.1.0's ``het_strategy.report`` module is now ``report.table`` (and ``report.picture``): its names still
    resolve here for one release, with a DeprecationWarning."""
    if name.startswith("__"):
        raise AttributeError(name)
    for home in ("table", "picture"):
        try:
            module = importlib.import_module(f"het_strategy.report.{home}")
        except ModuleNotFoundError:
            continue
        if hasattr(module, name):
            warnings.warn(f"het_strategy.report.{name} moved to het_strategy.report.{home}.{name}; the old path "
                          "goes away in the next release", DeprecationWarning, stacklevel=2)
            value = globals()[name] = getattr(module, name)  # warn once: later lookups find it here
            return value
    raise AttributeError(f"module 'het_strategy.report' has no attribute {name!r}")
