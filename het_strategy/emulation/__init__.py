"""Devices and networks that one machine plays for tests and benchmarks.

- ``speeds.py``       an emulated device's time per sample, slowdowns and noise (no torch)
- ``padding.py``      the comm-hook wrapper that pads a step to its emulated time (one for every runtime)
- ``netshape.py``     private network namespaces with a rate-limited loopback (``tc tbf``)
- ``local_ranks.py``  start N gloo ranks of a function on this machine
"""


import importlib
import warnings


def __getattr__(name: str) -> object:
    """0.1.0's ``het_strategy.emulation`` module is now ``emulation.speeds``: its names still resolve here for one
    release, with a DeprecationWarning."""
    if name.startswith("__"):
        raise AttributeError(name)
    module = importlib.import_module("het_strategy.emulation.speeds")
    if not hasattr(module, name):
        raise AttributeError(f"module 'het_strategy.emulation' has no attribute {name!r}")
    warnings.warn(f"het_strategy.emulation.{name} moved to het_strategy.emulation.speeds.{name}; the old path goes "
                  "away in the next release", DeprecationWarning, stacklevel=2)
    value = globals()[name] = getattr(module, name)  # warn once: later lookups find it here
    return value
