"""Measured per-layer times of a Hugging Face causal LM built from its config: ``profile_hf_model``.

``het-plan model=<config.json> planner.profile=measured`` (and ``profile_hf_model`` in Python) builds the model
with transformers from its config (random init, in the training dtype, on this machine's device: the first CUDA
device, else the CPU), cuts it into the L + 2 pipeline units the runtime runs (``hf.pipeline_units``:
embedding, one unit per decoder layer, head; each decoder unit recomputes its mask and rotary embeddings as on a
pipeline stage), and times forward, backward and an Adam update per unit with the module profiler
(``module_profile.profile_module``) at each micro-batch size, ``seq_len`` tokens per sample, the loss the
model's own causal-LM loss.  The times form a ``MeasuredProfile`` keyed ``(device type present, tp 1)``, beside
the analytic workload of the same config (``core.hf_config.hf_workload``: same L + 2 layers, same name), which the
cost model prefers for that device type; other types and tp > 1 stay priced by the analytic model.

The whole model is built: every decoder layer is timed, none is extrapolated.  A model whose weights and
gradients (2 x parameters x dtype bytes) exceed the memory free on the device is refused in one line before
anything is built.  This is a runtime module: it imports torch (transformers where it builds a model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from het_strategy.core.dtypes import DTYPE_BYTES
from het_strategy.core.errors import field_error, require_int
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec
from het_strategy.hf.causal_lm_loss import CausalLMLoss
from het_strategy.hf.pipeline_units import hf_pipeline_units
from het_strategy.profiling.module_profile import profile_module
from het_strategy.profiling.torch_device import TORCH_DTYPES

__all__ = ["HFProfile", "profile_hf_model"]


@dataclass(frozen=True)
class HFProfile:
    """What ``profile_hf_model`` measured, and the workload it prices."""

    workload: WorkloadSpec
    """The analytic workload of the config (``hf_workload``): L + 2 layers, the profile's layers."""
    profile: MeasuredProfile
    """(forward_s, backward_s, update_s) per layer at ``(device_type, 1)`` and each micro-batch size."""
    device_type: str
    """The device type the times are filed under (a catalog name where one matched, ``CPU`` on the CPU)."""
    device: str
    """The torch device they were measured on (``cpu``, ``cuda:0``)."""


class _UnitChain(nn.Module):
    """The pipeline units in order, ending in the model's causal-LM loss: what ``profile_module`` times."""

    def __init__(self, units: list[nn.Module], loss: Any) -> None:
        super().__init__()
        self.embedding = units[0]
        self.blocks = nn.ModuleList(units[1:-1])
        self.head = units[-1]
        self._loss = loss

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        return self._loss(self.head(hidden), labels)


def profile_hf_model(config: str | Path | Mapping[str, Any] | nn.Module, seq_len: int,
                     micro_batches: Sequence[int] = (1, 2), *, dtype: str = "fp32", repeats: int = 3,
                     warmup: int = 1, device: str | torch.device | None = None, device_type: str | None = None,
                     field: str = "config") -> HFProfile:
    """Time a Hugging Face causal LM per pipeline unit at ``seq_len`` tokens and each of ``micro_batches``.

    ``config``: a ``config.json`` path, a model directory holding one, the mapping of ``model.config.to_dict()``
    (the model is then built, random init, in ``dtype`` on ``device``), or a ``PreTrainedModel`` causal LM (timed
    as it is, on its device, in its dtype, which ``dtype`` must name).  ``device``: default the first CUDA device,
    else the CPU.  ``device_type``: the type the times are filed under (default the device's, as
    ``profile_module`` finds it).  ``repeats`` timed passes after ``warmup`` ones, the median kept.  ``field``
    names ``config`` in errors (``model`` for het-plan).

    Use: ``plan(cluster, result.workload, settings, PlanRequest(profile="measured"), result.profile)``.
    """
    from het_strategy.core.hf_config import hf_workload

    if dtype not in TORCH_DTYPES:
        raise field_error("dtype", dtype, f"be one of {', '.join(TORCH_DTYPES)} (the dtype the model is built and "
                          "timed in)")
    sizes = _micro_batches(micro_batches)
    repeats = require_int(repeats, "repeats", minimum=1)
    if isinstance(config, nn.Module):
        model = config
        workload = hf_workload(_model_config(model, field), seq_len, dtype)
    else:
        raw = _config_mapping(config, field)
        workload = hf_workload(config, seq_len, dtype)  # named as het-plan names it (the directory or file)
        target = _device(device)
        _check_fits(workload, dtype, target, field, config)
        model = _build(raw, dtype, target)
    units = hf_pipeline_units(model)
    chain = _UnitChain(units, CausalLMLoss(model))
    where = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    times: dict[int, list[tuple[float, float, float | None]]] = {}
    found_type = device_type
    gen = torch.Generator().manual_seed(0)
    for mb in sizes:
        ids = torch.randint(0, vocab, (mb, workload.seq_len), generator=gen).to(where)
        result = profile_module(chain, {"input_ids": ids, "labels": ids},
                                blocks=[f"blocks.{i}" for i in range(len(units) - 2)], name=workload.name,
                                dtype=dtype, repeats=repeats, warmup=warmup, device_type=device_type)
        times[mb] = result.profile.layer_times(result.device_type, 1, mb)
        found_type = result.device_type
    profile = MeasuredProfile(model=workload.name, times={(str(found_type), 1): times})
    profile.check_matches(workload)  # the profile's L + 2 layers are the workload's
    return HFProfile(workload=workload, profile=profile, device_type=str(found_type), device=str(where))


def _micro_batches(micro_batches: Sequence[int]) -> list[int]:
    if isinstance(micro_batches, (str, bytes)) or not isinstance(micro_batches, Sequence) or not micro_batches:
        raise field_error("micro_batches", micro_batches, "be a non-empty list of micro-batch sizes, e.g. [1, 2]")
    return sorted({require_int(mb, f"micro_batches[{i}]", minimum=1) for i, mb in enumerate(micro_batches)})


def _config_mapping(config: str | Path | Mapping[str, Any], field: str) -> dict[str, Any]:
    """The config's JSON object (a mapping given, or read from the config.json / model directory named)."""
    from het_strategy.core.files import read_json_file
    from het_strategy.core.hf_fields import hf_config_path

    if isinstance(config, Mapping):
        return dict(config)
    path = hf_config_path(str(config))
    if path is None:
        raise field_error(field, str(config), "be a Hugging Face config.json or a model directory holding one")
    raw = read_json_file(path, field, "Hugging Face config.json")[1]
    if not isinstance(raw, Mapping):
        raise field_error(field, str(path), "hold a JSON object (a Hugging Face model config)")
    return dict(raw)


def _model_config(model: nn.Module, field: str) -> dict[str, Any]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise field_error(field, type(model).__name__, "be a Hugging Face PreTrainedModel causal LM (it has no "
                          "config), a config.json path or a config mapping",
                          "profile your own nn.Module with profiling.module_profile.profile_module")
    return config.to_dict()


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    return torch.device(device)


def _free_bytes(device: torch.device) -> int:
    """Memory free on ``device``: CUDA's free bytes, else the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_fits(workload: WorkloadSpec, dtype: str, device: torch.device, field: str, source: Any) -> None:
    """Refuse, before building, a model whose weights and gradients exceed the memory free on ``device``."""
    need = 2 * workload.total_params * DTYPE_BYTES[dtype]
    free = _free_bytes(device)
    if need > free:
        where = str(source) if not isinstance(source, Mapping) else workload.name
        raise field_error(field, where, f"fit this machine's memory to be profiled: its weights and gradients take "
                          f"{need / 2**30:.1f} GiB in {dtype} ({workload.total_params / 1e9:.2f} B parameters), "
                          f"{free / 2**30:.1f} GiB are free on {device}",
                          "plan it with planner.profile=null (datasheet or roofline figures), or profile on a "
                          "device with more memory")


def _build(raw: Mapping[str, Any], dtype: str, device: torch.device) -> nn.Module:
    """The causal LM of ``raw`` (random init under a forked RNG) in ``dtype`` on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version", "architectures")}
    config = AutoConfig.for_model(str(raw.get("model_type")), **fields)
    devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), device:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[dtype])
    return model.train()

