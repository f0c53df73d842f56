"""A user's own model named by a Python path: load its factory, build a sample input, profile it.

``het-plan model=<python path>`` plans a model that exists only as code:

* the path is ``package.module:function`` (importable) or
  ``path/to/file.py:function`` (loaded from the file, relative to the current
  directory); the function takes no arguments and returns either an
  ``nn.Module`` or a pair ``(module, sample_input)``;
* without a sample input from the factory, ``model_input.shape`` (e.g.
  ``[4,1,28,28]``) and ``model_input.dtype`` (``float32``, ``float16``,
  ``bfloat16``, ``float64``, or ``int64`` for token ids) describe one: a
  seeded random tensor (zeros for integers) the model is called with;
* ``profile_module`` then counts FLOPs, parameters, saved and output bytes per
  block and times forward, backward and update on this machine.

``ProfileResult.to_dict`` is what ``het-plan`` writes next to the plan
(``<plan>.model.json``); ``load_profile_file`` reads the workload back, so the
strategy can be given the very workload the plan was made for
(``HeteroStrategy(plan=..., workload=load_profile_file(...).workload)``).
This is a runtime module: it imports torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.files import check_readable_file, read_json_file
from het_strategy.core.workload import LayerCost, MeasuredProfile, MoESpec, WorkloadSpec
from het_strategy.profiling.module_profile import ProfileResult, profile_module
from het_strategy.profiling.torch_device import DTYPE_NAMES

__all__ = ["INPUT_DTYPES", "SavedProfile", "load_factory", "build_model", "profile_factory", "load_profile_file"]

INPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float64": torch.float64, "int64": torch.int64}
"""``model_input.dtype`` names and the torch dtypes they stand for."""


def load_factory(spec: str, field: str = "model") -> Callable[[], Any]:
    """The function ``spec`` names: ``package.module:function`` or ``path/to/file.py:function``."""
    where, sep, attr = str(spec).rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise field_error(field, spec, "be `package.module:function` or `path/to/file.py:function`")
    if where.endswith(".py"):
        path = check_readable_file(Path(where).expanduser(), field, "Python file")  # no fifo, folder or unreadable
        mod_name = f"_het_model_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
        try:
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # the user's code: any error means the path does not give a model
            raise field_error(field, spec,
                              f"be importable; importing {path} raised {type(exc).__name__}: {exc}") from None
        finally:
            sys.path.remove(str(path.resolve().parent))
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise field_error(field, spec, f"be importable; `import {where}` raised {type(exc).__name__}: {exc}",
                              "run from the folder that holds the package, or give path/to/file.py:function") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise field_error(field, spec, f"name a function of {where} (it has no callable `{attr}`)")
    return fn


def build_model(spec: str, shape: Sequence[int] | None = None, dtype: str = "float32",
                field: str = "model") -> tuple[nn.Module, Any]:
    """Call the factory; the sample input is the factory's own or one of ``shape`` and ``dtype``."""
    made = load_factory(spec, field)()
    sample = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
        made, sample = made
    if not isinstance(made, nn.Module):
        raise field_error(field, spec, f"return an nn.Module or (nn.Module, sample_input); it returned "
                          f"{type(made).__name__}")
    if sample is None:
        sample = sample_input(shape, dtype)
    return made, sample


def sample_input(shape: Sequence[int] | None, dtype: str) -> torch.Tensor:
    """A seeded random tensor of ``shape`` (zeros for integer dtypes)."""
    if shape is None:
        raise field_error("model_input.shape", None, "be given when the factory returns only a module",
                          "e.g. model_input.shape=[4,1,28,28]: dim 0 is the micro-batch profiled; or return "
                          "(module, sample_input) from the factory")
    if (not isinstance(shape, (list, tuple)) or not shape
            or any(isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1 << 20 for n in shape)):
        raise field_error("model_input.shape", shape, "be a list of integers in [1, 1048576], e.g. [4,1,28,28]")
    numel = 1
    for n in shape:
        numel *= n
    if numel > 1 << 28:
        raise field_error("model_input.shape", list(shape), f"hold at most {1 << 28} elements (it holds {numel})")
    if dtype not in INPUT_DTYPES:
        raise field_error("model_input.dtype", dtype, f"be one of {', '.join(INPUT_DTYPES)}")
    torch_dtype = INPUT_DTYPES[dtype]
    if not torch_dtype.is_floating_point:
        return torch.zeros(*shape, dtype=torch_dtype)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(*shape, generator=gen).to(torch_dtype)


def profile_factory(spec: str, shape: Sequence[int] | None = None, dtype: str = "float32", *,
                    blocks: Sequence[str] | None = None, repeats: int = 3,
                    device_type: str | None = None) -> ProfileResult:
    """Build the model ``spec`` names and profile it (``profile_module``) on this machine's CPU.

    The byte figures are in the dtype of the model's parameters; ``device_type``
    is the type the measured times are filed under (default: this machine's).
    """
    module, sample = build_model(spec, shape, dtype)
    params = [p for p in module.parameters() if p.is_floating_point()]
    cost_dtype = DTYPE_NAMES.get(params[0].dtype) if params else "fp32"
    if cost_dtype is None:
        raise field_error("model", spec, f"build a model whose parameters are fp32, fp16 or bf16 "
                          f"(they are {params[0].dtype})")
    name = str(spec).rpartition(":")[2]
    try:
        return profile_module(module, sample, blocks=blocks, name=name, dtype=cost_dtype, repeats=repeats,
                              device_type=device_type)
    except ConfigError:
        raise
    except Exception as exc:  # the model refused the sample input: say so in one line
        raise field_error("model_input", f"{type(sample).__name__} "
                          f"{tuple(sample.shape) if isinstance(sample, torch.Tensor) else ''}".strip(),
                          f"be an input the model accepts; calling it raised {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


@dataclass
class SavedProfile:
    """What ``load_profile_file`` reads back: the workload and the measured times."""

    workload: WorkloadSpec
    profile: MeasuredProfile
    device_type: str


def load_profile_file(path: str | Path, field: str = "model profile") -> SavedProfile:
    """A ``<plan>.model.json`` written by ``het-plan model=<python path>`` or ``benchmarks/gpu_calibration.py``
    (``ProfileResult.to_dict``); a bad file is a ``ConfigError`` naming ``field``."""
    path = Path(path)
    try:
        raw = read_json_file(path, field, "model profile JSON file")[1]
        w = raw["workload"]
        layers = tuple(LayerCost(**{**layer, "moe": MoESpec(**layer["moe"]) if layer.get("moe") else None})
                       for layer in w["layers"])
        workload = WorkloadSpec(name=w["name"], layers=layers, seq_len=int(w["seq_len"]), dtype=w["dtype"])
        rows = [tuple(float(x) for x in row) for row in raw["times"]]
        device_type = str(raw["device_type"])
        profile = MeasuredProfile(model=workload.name, times={(device_type, 1): {int(raw["micro_batch"]): rows}})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise field_error(field, str(path), f"be a model.json written by het-plan ({exc!r})") from None
    return SavedProfile(workload, profile, device_type)
