"""Measuring the real thing (torch): devices and links (``probe.py``), a module's blocks (``module_profile.py``).

What they measure becomes core objects (``ClusterSpec``, ``MeasuredProfile``) that the planner reads.
"""


import importlib
import warnings


def __getattr__(name: str) -> object:
    """0.1.0's ``het_strategy.profiling`` module is now ``profiling.module_profile``: its names still resolve here
    for one release, with a DeprecationWarning."""
    if name.startswith("__"):
        raise AttributeError(name)
    old = {"first_tensor": "batch_contents", "batch_length": "batch_contents"}.get(name, "module_profile")
    module = importlib.import_module(f"het_strategy.profiling.{old}")
    if not hasattr(module, name):
        raise AttributeError(f"module 'het_strategy.profiling' has no attribute {name!r}")
    warnings.warn(f"het_strategy.profiling.{name} moved to het_strategy.profiling.{old}.{name}; the old path goes "
                  "away in the next release", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(module, name)  # warn once: later lookups find it here
    return value
