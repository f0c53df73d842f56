"""The roofline's constants (``core/compute_model.py``) fitted on measured transformer blocks: Sailor's and AMP's.

The measurements (``block_measurements``) are every middle transformer block the project holds a measured time
for, on a GPU the catalog describes:

- Sailor's ``layer_profiles.json``: forward + backward of OPT-350 (hidden 1024, 16 heads, sequence 2048) and
  GPT-Neo-2.7 (hidden 2560, 32 heads) on A100-40/80, GH200, V100, RTX-3090, Titan RTX and RTX 2080 Ti, at
  every micro-batch and tp Sailor profiled.  Sailor trains in fp32; its A100 blocks run faster than the fp32
  rate allows (OPT-350 at tp 1, micro-batch 1: 206 GFLOP in 8.2 ms, 25 TFLOP/s against 19.5), so its runs used
  TF32: they are priced with ``float32_matmul_precision=high``.  Sailor's ``RTX-2080`` is an RTX 2080 Ti
  (``sailor_profiles.SAILOR_GPU_TYPES``).
- AMP's ``known_cost.json``: the forward of GPT-2 (hidden 1024, 16 heads, sequence 1024) on T4 and V100 at
  micro-batch 1 and tp 1, 2, 4, in fp32 (neither GPU has TF32 units).

Both ran Megatron without flash attention (``AttentionKernel.materialized``).  ``fit_calibration`` fits the
five constants on the tp-1 measurements only (no communication in them): coordinate descent, each constant by
golden-section search within its bounds, minimising the sum of squared log ratios of predicted to measured
time.  The tp > 1 measurements are left for the check: the cost model prices them with its tp all-reduces
(``benchmarks/cost_model_fidelity.py``).  ``python -m het_strategy.reference.compute_calibration`` refits and
writes ``core/data/compute_calibration.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from het_strategy.core.catalog import lookup_device_type
from het_strategy.core.cluster import ClusterSpec, cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.compute_model import (CALIBRATION_FILE, AttentionKernel, ComputeCalibration, ComputeModel,
                                             LayerShape, device_roofline, layer_seconds)
from het_strategy.core.device_spec import DeviceSpec, device_from_dict
from het_strategy.core.dtypes import Dtype, Float32MatmulPrecision
from het_strategy.core.network import BLOCK_TP_ALLREDUCES
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import LayerCost, WorkloadSpec
from het_strategy.reference.amp_profile import AMP_DEVICE_TYPES, AMP_KNOWN_COST
from het_strategy.reference.sailor_profiles import read_sailor_json, sailor_device_type

__all__ = ["BlockMeasurement", "BOUNDS", "block_measurements", "measurement_device",
           "predicted_s", "cost_model_s", "one_type_node", "fit_calibration", "write_calibration"]

SAILOR_MODELS = {"OPT-350": "training_opt_350.json", "GPT-Neo-2.7": "training_gpt_neo27.json"}
"""Sailor's models with a GPT shape file (its LLaMA and OPT-30 profiles have none)."""
FP32_MATMUL = Float32MatmulPrecision.high
"""How the measured runs computed fp32 matmuls (TF32 where the GPU has it)."""
BOUNDS: dict[str, tuple[float, float]] = {"tensor_efficiency": (0.05, 1.0), "vector_efficiency": (0.05, 1.0),
                                          "memory_efficiency": (0.05, 1.0), "small_dim": (0.0, 512.0),
                                          "launch_s": (0.0, 50e-6)}
"""Where each constant is searched."""
_ROUNDS, _STEPS = 6, 24
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class BlockMeasurement:
    """One measured transformer block."""

    source: str
    """``sailor`` or ``amp``."""
    model: str
    """The measured model (``OPT-350``, ``GPT-Neo-2.7``, ``gpt2``)."""
    gpu: str
    """The catalog device type."""
    micro_batch: int
    tp: int
    seconds: float
    """Measured seconds: forward + backward (Sailor), forward (AMP)."""
    forward_only: bool
    shape: LayerShape
    seq_len: int


def block_measurements() -> list[BlockMeasurement]:
    """Every measured middle block on a catalog GPU (see the module docstring), in a fixed order."""
    rows: list[BlockMeasurement] = []
    profiles = read_sailor_json("layer_profiles.json")
    for model, shape_file in SAILOR_MODELS.items():
        spec = read_sailor_json(shape_file)
        h, heads, s = int(spec["hidden_size"]), int(spec["heads"]), int(spec["sequence_length"])
        shape = LayerShape("block", h, heads, 4 * h, int(spec["vocab_size"]), AttentionKernel.materialized)
        for sailor_gpu, by_mbs in sorted(profiles[model].items()):
            gpu = sailor_device_type(sailor_gpu)
            if gpu is None:
                continue
            for mbs, by_tp in sorted(by_mbs.items(), key=lambda kv: int(kv[0])):
                for tp, layers in sorted(by_tp.items(), key=lambda kv: int(kv[0])):
                    rows_of = [layers[k] for k in sorted(layers, key=int)] if isinstance(layers, dict) else layers
                    fwd, bwd, _ = rows_of[len(rows_of) // 2]
                    rows.append(BlockMeasurement("sailor", model, gpu, int(mbs), int(tp), float(fwd) + float(bwd),
                                                 False, shape, s))
    amp = json.loads(AMP_KNOWN_COST.read_text())
    middle = len(amp["_layers_gpt2"]) // 2  # a transformer block (2 + 24 blocks + 4 others)
    gpt2 = LayerShape("block", 1024, 16, 4096, 52256, AttentionKernel.materialized)
    for amp_gpu, by_tp in sorted(amp["gpt2"].items()):
        for tp, forward in sorted(by_tp.items(), key=lambda kv: int(kv[0])):
            rows.append(BlockMeasurement("amp", "gpt2", AMP_DEVICE_TYPES[amp_gpu], 1, int(tp),
                                         float(forward[middle]), True, gpt2, 1024))
    return rows


def measurement_device(gpu: str) -> DeviceSpec:
    """The catalog's figures for ``gpu``, as a device."""
    return device_from_dict({"type": gpu}, gpu, "node", lookup_device_type(gpu), "gpu")


def predicted_s(m: BlockMeasurement, cal: ComputeCalibration) -> float:
    """The roofline's seconds for measurement ``m`` (its compute only: no tensor-parallel communication)."""
    roof = device_roofline(measurement_device(m.gpu), Dtype.fp32, FP32_MATMUL)
    assert roof is not None  # invariant: every catalog GPU has compute units
    fwd, bwd = layer_seconds(m.shape, m.seq_len, m.micro_batch, m.tp, 4, roof, cal)
    return fwd if m.forward_only else fwd + bwd


def cost_model_s(m: BlockMeasurement, cal: ComputeCalibration) -> float:
    """What the cost model predicts for measurement ``m``: the block on a node of its GPUs, the roofline with
    ``cal`` and the Megatron all-reduces of a tp group (``BLOCK_TP_ALLREDUCES`` per pass) over the node's link:
    for Sailor's GPUs the peak of Sailor's measured fit for a group of that size, for AMP's the catalog's link."""
    cluster = one_type_node(m.gpu, m.tp, sailor_link=m.source == "sailor")
    workload = _block_workload(m)
    settings = TrainSettings(1, dtype=Dtype.fp32, max_tp=8, compute_model=ComputeModel.roofline,
                             float32_matmul_precision=FP32_MATMUL)
    model = CostModel(cluster, workload, settings, calibration=cal)
    device = cluster.devices[0]
    if not m.forward_only:
        return model.stage_compute_s(device, m.tp, m.micro_batch, 0, 1)
    out = workload.layers[0].output_bytes_per_sample * m.micro_batch  # a forward: its roofline time + 2 all-reduces
    return predicted_s(m, cal) + BLOCK_TP_ALLREDUCES * model.network.tp_allreduce_s(out, device.node, m.tp)


def one_type_node(gpu: str, tp: int, sailor_link: bool = True) -> ClusterSpec:
    """A node of 8 ``gpu`` devices; with ``sailor_link``, its link is the peak of Sailor's measured fit for a
    group of ``tp`` of them (the smallest measured group that holds ``tp``), else the catalog's."""
    node: dict = {"name": "node", "devices": [{"type": gpu, "count": 8}]}
    if sailor_link:
        fits = read_sailor_json("intra_node_bandwidth_fits.json")
        sailor = next(k for k in fits if sailor_device_type(k) == gpu)
        sizes = sorted(int(k) for k in fits[sailor])
        node["intra_bandwidth_gbs"] = fits[sailor][str(min((k for k in sizes if k >= tp), default=sizes[-1]))][1] / 1e9
    return cluster_from_dict({"name": f"one_{gpu}", "nodes": [node]})


def _block_workload(m: BlockMeasurement) -> WorkloadSpec:
    """One block of the measured model, in fp32."""
    h = m.shape.hidden
    layer = LayerCost("block", 0.0, 12 * h * h, 0.0, m.seq_len * h * 4, shape=m.shape)
    return WorkloadSpec(m.model, (layer,), m.seq_len, Dtype.fp32)


def fit_calibration(rows: Sequence[BlockMeasurement]) -> ComputeCalibration:
    """The constants that best fit the tp-1 ``rows`` (see the module docstring); deterministic."""
    fitted = [r for r in rows if r.tp == 1]
    if not fitted:
        raise ValueError("no tp-1 measurement to fit on")
    values = {"tensor_efficiency": 0.6, "vector_efficiency": 0.6, "memory_efficiency": 0.6, "small_dim": 64.0,
              "launch_s": 5e-6}

    def loss(trial: dict[str, float]) -> float:
        cal = ComputeCalibration(**trial)
        return sum(math.log(predicted_s(r, cal) / r.seconds) ** 2 for r in fitted)

    for _ in range(_ROUNDS):
        for name, (lo, hi) in BOUNDS.items():
            values[name] = _golden(lambda x: loss({**values, name: x}), lo, hi)
    return ComputeCalibration(**values)


def _golden(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The minimiser of ``f`` on ``[lo, hi]`` by golden-section search (``_STEPS`` steps), the bounds included."""
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    candidates = [(fc, c), (fd, d), (f(lo), lo), (f(hi), hi)]
    return min(candidates)[1]


def write_calibration() -> ComputeCalibration:
    """Refit on every measurement and write the shipped file."""
    rows = block_measurements()
    cal = fit_calibration(rows)
    fitted = [r for r in rows if r.tp == 1]
    CALIBRATION_FILE.write_text(json.dumps({
        "about": "The roofline's constants (het_strategy/core/compute_model.py), fitted by "
                 "het_strategy/reference/compute_calibration.py on the tp-1 transformer blocks of Sailor's "
                 "and AMP's measured profiles.",
        "fitted_on": sorted({f"{r.source} {r.model} {r.gpu}" for r in fitted}),
        "measurements": len(fitted),
        "constants": {k: round(v, 9) for k, v in cal.to_dict().items()},
    }, indent=2) + "\n")
    return cal


if __name__ == "__main__":
    print(write_calibration())
