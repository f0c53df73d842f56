"""Sailor's memory estimate for one device of a pipeline stage, re-implemented on the vendored data.

Source read: Sailor's planner check ``check_stage_fits`` in
``sailor/Planner/sailor_planner/cpp_src/planner_utils.cpp`` (eth-easl/sailor 142ddeb1; the fork
saha18uiuc/sailor 1aa96fa4), the per-stage sums it is given in ``SailorPlanner::build_structs``
(``cpp_src/planner.cpp``) from the columns ``convertLLMInput`` (``cpp_src/training.cpp``) reads, and the
simulator's ``Simulator.check_config_fits`` / ``get_memory_footprint_on_gpu`` in
``sailor/Planner/simulations/runtime_simulator.py`` (saha18uiuc/sailor fb8d0e81).  Sailor is MIT licensed
(SOSP'25, ETH Zurich); this is our own code computing the same numbers.

``sailor_stage_memory`` gives one device's three terms in bytes (``SailorStageMemory``; the formulas there):
its layers' model state from Sailor's measured per-device parameter counts x ``bytes_per_param`` (24 for
Adam), the stored activations of the micro-batches a 1F1B schedule keeps in flight on the stage, and
Megatron's fixed memory outside PyTorch's allocator (``sailor_overhead_bytes``).  ``sailor_stage_fits`` is
Sailor's check: the total at most the GPU's memory in GiB x 2**30 (``SAILOR_GPU_MEMORY_GIB``).

Sailor's layer indices are ours for the same model (OPT-350: 26 = embedding, 24 blocks, head).  Bad input (a
model, tp, layer range or stage index outside Sailor's tables) raises ``ConfigError`` naming the field.  Pure
Python: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from het_strategy.core.errors import field_error
from het_strategy.reference.sailor_profiles import read_sailor_json

__all__ = ["SAILOR_ADAM_BYTES_PER_PARAM", "SAILOR_SGD_BYTES_PER_PARAM", "SAILOR_GPU_MEMORY_GIB",
           "SailorStageMemory", "sailor_stage_memory", "sailor_overhead_bytes", "sailor_stage_fits"]

SAILOR_ADAM_BYTES_PER_PARAM = 8 + 4 + 4 + 4 + 4
"""Adam moments (2 x fp32) + fp32 model copy + gradients + communication buffer + DeepSpeed's extra copy."""

SAILOR_SGD_BYTES_PER_PARAM = 4 + 4 + 4 + 4 + 4
"""As Adam's, with one fp32 optimizer buffer instead of two."""

SAILOR_GPU_MEMORY_GIB = {"A100-40": 40, "A100-80": 80, "V100-16": 16, "V100-32": 32, "T4-16": 16, "GH-96": 96,
                         "RTX-3090": 24, "Titan-RTX": 24, "RTX-2080": 11}
"""GPU memory (GiB) Sailor's planner and simulator check a stage against, by Sailor's GPU name (``GPU_MEMORY`` in
``planner_utils.cpp``, ``GPU_MEMORY_GB`` in ``sailor/Planner/simulations/constants.py``)."""

_TP1_OVERHEAD_BYTES = 2.0e9
_TP_OVERHEAD_BYTES = 3.0e9


@dataclass(frozen=True)
class SailorStageMemory:
    """Sailor's estimate for one device of a stage, by term (bytes)."""

    model_state_bytes: float
    """Parameters x bytes per parameter (weights, gradients, optimizer state, buffers)."""
    activation_bytes: float
    """Stored activations of all micro-batches in flight on the stage."""
    overhead_bytes: float
    """Megatron's memory outside the allocator (2e9 at tp 1, 3e9 above)."""
    in_flight: int
    """Micro-batches whose activations are held: ``num_stages - stage_index``."""

    @property
    def total_bytes(self) -> float:
        return self.model_state_bytes + self.activation_bytes + self.overhead_bytes


def sailor_overhead_bytes(tp: int) -> float:
    """Sailor's fixed per-device overhead at tensor-parallel degree ``tp``."""
    return _TP1_OVERHEAD_BYTES if tp == 1 else _TP_OVERHEAD_BYTES


def _layer_table(model: str, tp: int) -> dict:
    memory = read_sailor_json("layer_memory.json")
    if model not in memory:
        raise field_error("model", model, "be a model Sailor measured memory for",
                          f"measured: {', '.join(sorted(memory))}")
    if isinstance(tp, bool) or not isinstance(tp, int) or str(tp) not in memory[model]:
        raise field_error("tp", tp, f"be a tensor-parallel degree Sailor measured for {model}",
                          f"measured: {', '.join(sorted(memory[model], key=int))}")
    return memory[model][str(tp)]


def _require_int(field: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise field_error(field, value, f"be an integer in [{minimum}, {maximum}]")
    return value


def sailor_stage_memory(start: int, stop: int, tp: int, micro_batch: int, stage_index: int, num_stages: int,
                        model: str = "OPT-350", fp16: bool = False,
                        bytes_per_param: float = SAILOR_ADAM_BYTES_PER_PARAM) -> SailorStageMemory:
    """Sailor's memory for one device of stage ``stage_index`` of ``num_stages``, layers ``[start, stop)``.

    ``fp16`` is Sailor's flag (2 instead of 4 bytes per activation float); ``bytes_per_param`` is Sailor's
    model-state multiplier (24 for Adam; ``SAILOR_SGD_BYTES_PER_PARAM`` for SGD, 16 for eth-easl's planner).
    At tensor-parallel degree ``tp`` and micro-batch ``micro_batch`` (Sailor's ``mbs``), in bytes:

    1. **Model state** = ``sum(params_floats[tp][layer]) x bytes_per_param``.  ``params_floats`` is Sailor's
       measured per-device parameter count at that tp (``layer_memory.json``; not the tp-1 count divided by
       tp: the embedding's position table is replicated).  ``bytes_per_param`` = 24 for Adam
       (``SAILOR_ADAM_BYTES_PER_PARAM``): 8 for the optimizer's two fp32 moments, 4 for the fp32 model copy,
       4 for the gradients, 4 for a communication buffer and 4 for the extra copy DeepSpeed makes at start
       (``check_config_fits``, ``get_memory_footprint_on_gpu``, and ``check_stage_fits`` in the fork).  With
       SGD the moments count 4 instead of 8 (``check_config_fits``), 20 in all.  eth-easl/sailor 142ddeb's
       ``check_stage_fits`` hard-codes 16 instead (the same terms listed, their sum commented out); pass
       ``bytes_per_param=16`` for that variant.
    2. **Activations** = ``sum(act_mem_floats[tp][layer]) x mbs x float_bytes x (num_stages - stage_index)``:
       the stored activations of one sample, per layer and device, as Sailor measured them at that tp, for
       the micro-batches a 1F1B schedule keeps in flight on that stage (all of the later stages' count plus
       its own).  ``float_bytes`` is 4 in Sailor's training setup (its planner and simulator are run with
       ``fp16=False``; the profiles are fp32) and 2 with ``fp16=True`` (``float_size`` in both).
    3. **Fixed overhead** = 2e9 bytes at tp 1, 3e9 bytes at tp > 1: memory Megatron takes outside PyTorch's
       allocator, seen in nvidia-smi (``megatron_mem`` in ``check_stage_fits`` and ``check_config_fits``).
    """
    table = _layer_table(model, tp)
    num_layers = len(table)
    _require_int("start", start, 0, num_layers - 1)
    _require_int("stop", stop, start + 1, num_layers)
    _require_int("micro_batch", micro_batch, 1, 1 << 20)
    _require_int("num_stages", num_stages, 1, num_layers)
    _require_int("stage_index", stage_index, 0, num_stages - 1)
    if not isinstance(fp16, bool):
        raise field_error("fp16", fp16, "be true or false")
    if isinstance(bytes_per_param, bool) or not isinstance(bytes_per_param, (int, float)) or bytes_per_param <= 0:
        raise field_error("bytes_per_param", bytes_per_param, "be a number > 0")
    rows = [table[str(layer)] for layer in range(start, stop)]
    params = sum(row["params_floats"] for row in rows)
    act_per_sample = sum(row["act_mem_floats"] for row in rows)
    in_flight = num_stages - stage_index
    float_bytes = 2 if fp16 else 4
    return SailorStageMemory(model_state_bytes=params * bytes_per_param,
                             activation_bytes=act_per_sample * micro_batch * float_bytes * in_flight,
                             overhead_bytes=sailor_overhead_bytes(tp), in_flight=in_flight)


def sailor_stage_fits(memory: SailorStageMemory, sailor_gpu: str) -> bool:
    """Whether Sailor's check passes: ``memory.total_bytes`` <= the GPU's GiB x 2**30."""
    if sailor_gpu not in SAILOR_GPU_MEMORY_GIB:
        raise field_error("sailor_gpu", sailor_gpu, "be a GPU Sailor lists memory for",
                          f"listed: {', '.join(sorted(SAILOR_GPU_MEMORY_GIB))}")
    return memory.total_bytes <= SAILOR_GPU_MEMORY_GIB[sailor_gpu] * 2**30
