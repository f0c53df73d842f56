"""AMP's measured per-layer times of GPT-2 on T4 and V100, as a ``MeasuredProfile`` of our ``gpt2_amp`` workload.

AMP (Li, Wang, Xing, Zhang; NeurIPS 2022) profiled each pipeline layer of its
GPT-2 (hidden 1024, sequence 1024, 24 blocks) on AWS T4 and V100-16GB nodes at
tensor-parallel degree 1, 2 and 4, micro-batch 1 (``data/amp/known_cost.json``,
transcribed from AMP's ``src/known_cost/*.npy``; its README beside the project's
reference data says how they were measured: forward time per layer, under
Megatron-LM + DeepSpeed, the tp allreduces of a block inside its time).

The profile feeds the cost model through the same path as Sailor's
(``CostModel(..., profile=...)``), mapped as AMP's own cost model reads it:

* **layers:** AMP's 30 entries onto our 26 (``amp_plans._our_boundary``'s map):
  our embedding = ``embed2h`` + the no-op after it, our 24 blocks = AMP's 24
  ``transformer_layer`` entries, our head = the two no-ops, ``embed2v`` and the
  last no-op;
* **forward + backward = 3 x forward** (backward 2 x forward), as AMP prices it;
* **micro-batch:** one measured size; ``MeasuredProfile`` scales the times in
  proportion to the micro-batch beyond it, as AMP does;
* **optimizer update:** not measured; the cost model prices it from the
  device's memory bandwidth (``update_s`` None).

Pure Python: no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from het_strategy.core.errors import field_error
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["AMP_KNOWN_COST", "AMP_DEVICE_TYPES", "load_amp_profile"]

AMP_KNOWN_COST = Path(__file__).with_name("data") / "amp" / "known_cost.json"

AMP_DEVICE_TYPES = {"T4": "T4", "V100-16": "V100-16GB"}
"""AMP's GPU names -> the catalog's device types (the ``amp_v100_t4`` cluster's)."""

_BLOCK = "transformer_layer"


def _our_layers(names: list[str], times: list[float], where: str) -> list[float]:
    """AMP's per-entry forward times summed onto embedding, blocks and head (module docstring)."""
    if len(names) != len(times):
        raise field_error(where, f"{len(times)} layers", f"have one time per entry of _layers_gpt2 ({len(names)})")
    blocks = [i for i, name in enumerate(names) if name == _BLOCK]
    if not blocks or blocks != list(range(blocks[0], blocks[-1] + 1)):
        raise field_error("_layers_gpt2", names, "list the transformer blocks contiguously")
    head_start = blocks[-1] + 1
    return [sum(times[:blocks[0]]), *(times[i] for i in blocks), sum(times[head_start:])]


def load_amp_profile(workload: WorkloadSpec, path: Path = AMP_KNOWN_COST) -> MeasuredProfile:
    """AMP's measured GPT-2 times as a profile of ``workload`` (``gpt2_amp``: embedding, 24 blocks, head), keyed
    ``(catalog device type, tp)`` at micro-batch 1."""
    data = json.loads(path.read_text())
    names = data["_layers_gpt2"]
    times: dict[tuple[str, int], dict[int, list[tuple[float, float, float | None]]]] = {}
    for amp_gpu, by_tp in data["gpt2"].items():
        device_type = AMP_DEVICE_TYPES.get(amp_gpu)
        if device_type is None:
            raise field_error(f"amp.gpt2.{amp_gpu}", amp_gpu, f"be one of {', '.join(AMP_DEVICE_TYPES)}")
        for tp_key, forward in by_tp.items():
            layers = _our_layers(names, [float(t) for t in forward], f"amp.gpt2.{amp_gpu}[tp={tp_key}]")
            times[(device_type, int(tp_key))] = {1: [(f, 2.0 * f, None) for f in layers]}
    profile = MeasuredProfile(model="gpt2_amp", times=times)
    profile.check_matches(workload)
    return profile
