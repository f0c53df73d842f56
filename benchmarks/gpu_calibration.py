"""Calibrating the cost model on one GPU: layer times, codec throughput and memory, predicted against measured.

Run where a GPU is (under 5 minutes on one; ``--budget-s`` caps the whole run), from the repository root::

    .venv/bin/python benchmarks/gpu_calibration.py --out "$OUT"          # on the GPU machine
    .venv/bin/python benchmarks/gpu_calibration.py --cpu --out /tmp/cal  # here: smaller shapes on the CPU

Three sections, each printing predicted / measured (a ratio above 1: the model is slow or large):

1. **Layer times** (``profile_module``, the profiler ``het-plan model=...`` runs).  The demo char GPT and a
   GPT-2-medium-shaped model (two blocks of hidden 1024, 16 heads, sequence 1024) at micro-batch 1, 2 and 4, in
   bf16, fp16, fp32 (torch's default ``highest``) and TF32 (fp32 under ``set_float32_matmul_precision("high")``),
   the model cast to the dtype.  Predicted: the cost model without a profile, ``settings.compute_model=roofline``
   (``core/compute_model.py``) on the catalog entry of this GPU (on the CPU, which the roofline does not describe:
   FLOPs at the catalog CPU's rate).  Per row: a block's forward + backward (the median over the blocks), the
   head's and the embedding's.  The head is measured with a ``sum`` loss, priced with the cross-entropy
   over fp32 logits: its ratio is an upper figure.
2. **Codec throughput**: quantize + dequantize (``compression/torch_codecs.py``, the comm hooks' own encoders) of a
   flat fp32 gradient in each codec the joint planner offers (q8, q4), in GB/s of fp32 input, against what the
   cost model assumes without a measurement (``core/compressed_sync.codec_bandwidth``: 1/8 of the memory
   bandwidth for a GPU).  The slower codec's figure is the ``codec_gbs`` written for the catalog.
3. **Memory** of a training step of the GPT-2-medium-shaped model with AdamW (cross-entropy over fp32 logits)
   in fp32 and bf16 at micro-batch 1, 2 and 4: the activations (allocated after the forward less before it)
   against the memory model's (``core/memory.py``, ``transformer_workload``); the allocator's peak over the
   step (``torch.cuda.max_memory_allocated``) against those activations plus the state a plain loop holds
   (weights, gradients and AdamW's two moments in the model's dtype: the memory model's figure adds the
   runtimes' fp32 masters and buffers, which this loop has not); what the caching allocator reserved beyond
   its peak; and the memory the process holds outside the allocator (``torch.cuda.mem_get_info``: used less
   reserved, which includes the CUDA context) against the model's 2 GB at tp 1.  On the CPU torch keeps no
   allocator statistics: the activations are the bytes autograd saves (``profile_module``'s count).

What it cannot check: one GPU, so no tensor-parallel or pipeline communication (``gpu_check.py`` runs those
paths; their prices come from the links' figures); the shapes are two GPT sizes, not every model.

It writes ``<out>/<device type>.calibration.json`` (every row, the catalog fields measured: ``codec_gbs``, and
each profile's path) and ``<out>/profiles/<model>.<dtype>.mbs<m>.model.json`` (``ProfileResult.to_dict``, the
form ``het-plan`` writes beside a plan, which ``het-plan model=<that file>`` plans with), each whole or not at
all.  Last line::

    RESULT device=<type> block_ratio_median=... block_ratio_worst=... codec_gbs=... codec_ratio=...
    act_ratio_max=... peak_ratio_max=... outside_gb=... seconds=...
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from het_strategy.compression.torch_codecs import TORCH_CODECS
from het_strategy.compression.config import CompressionConfig
from het_strategy.core.atomic_file import replacing
from het_strategy.core.catalog import catalog_device_name, lookup_device_type
from het_strategy.core.cluster import ClusterSpec, cluster_from_dict
from het_strategy.core.codecs import CODECS, Exchange
from het_strategy.core.compressed_sync import JOINT_CHOICES, codec_bandwidth
from het_strategy.core.compute_model import ComputeModel
from het_strategy.core.cost_model import CostModel
from het_strategy.core.dtypes import Float32MatmulPrecision
from het_strategy.core.errors import ConfigError
from het_strategy.core.memory import GiB, OVERHEAD_TP1_BYTES, MemoryModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import WorkloadSpec, transformer_workload
from het_strategy.demo.char_gpt import CharGPT
from het_strategy.profiling.module_profile import profile_module

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"models": {"char_gpt": {},
                       "gpt2_medium_2blocks": {"num_layers": 2, "hidden_size": 1024, "num_heads": 16,
                                               "seq_len": 1024, "vocab_size": 50257}},
            "dtypes": ("bf16", "fp16", "fp32", "tf32"), "micro_batches": (1, 2, 4), "repeats": 5, "warmup": 2,
            "codec_elements": 64 * 2**20, "codec_repeats": 10, "memory_dtypes": ("fp32", "bf16")},
    "cpu": {"models": {"char_gpt": {"num_layers": 2, "seq_len": 64},
                       "gpt2_medium_2blocks": {"num_layers": 2, "hidden_size": 256, "num_heads": 4,
                                               "seq_len": 128, "vocab_size": 512}},
            "dtypes": ("bf16", "fp32"), "micro_batches": (1, 2), "repeats": 2, "warmup": 1,
            "codec_elements": 2**20, "codec_repeats": 3, "memory_dtypes": ("fp32", "bf16")},
}
"""Per mode: the models (``CharGPT`` arguments), dtypes, micro-batches, timed passes, the codec tensor's size."""
MEMORY_MODEL = "gpt2_medium_2blocks"
"""The model the memory section trains."""
TORCH_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Budget:
    """The run's time limit: a section stops starting new rows once it is spent, and says so."""

    def __init__(self, seconds: float) -> None:
        self.start, self.seconds, self.skipped = time.perf_counter(), seconds, 0

    def left(self) -> bool:
        if time.perf_counter() - self.start < self.seconds:
            return True
        self.skipped += 1
        return False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def _one_device(device_type: str) -> ClusterSpec | None:
    """A one-device cluster of the catalog's ``device_type``; None for a GPU the catalog does not hold (its rows
    are measured, not predicted: add its datasheet figures to ``core/catalog.yaml`` first)."""
    try:
        lookup_device_type(device_type)
    except ConfigError:
        print(f"  {device_type} is not in the catalog: measured only, nothing predicted")
        return None
    return cluster_from_dict({"name": "calibration", "nodes": [{"name": "n", "devices": [{"type": device_type}]}]})


def _model(args: dict[str, Any], dtype: str, device: torch.device) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(**args).to(device=device, dtype=TORCH_DTYPE[dtype])


def _element_dtype(dtype: str) -> str:
    """The cost model's and the profiler's name of a row's dtype: TF32 is fp32 computed on tensor cores."""
    return "fp32" if dtype == "tf32" else dtype


def _settings(dtype: str, micro: int) -> TrainSettings:
    """The cost model's settings for a one-device run of ``dtype`` (``tf32``: fp32 under precision ``high``)."""
    fp32_matmul = Float32MatmulPrecision.high if dtype == "tf32" else Float32MatmulPrecision.highest
    return TrainSettings(micro, dtype=_element_dtype(dtype), max_tp=1, micro_batch_sizes=(micro,),
                         compute_model=ComputeModel.roofline, float32_matmul_precision=fp32_matmul)


def _workload(model: CharGPT, dtype: str) -> WorkloadSpec:
    return transformer_workload(model.workload_config(), dtype=_element_dtype(dtype))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1: layer times ----------------------------------------------------------------------------------------------
def layer_times(mode: str, device: torch.device, device_type: str, out: Path, budget: Budget) -> list[dict]:
    """Per (model, dtype, micro-batch): measured and predicted seconds of a block, the head and the embedding."""
    size = SIZES[mode]
    cluster = _one_device(device_type)
    rows = []
    for name, args in size["models"].items():
        for dtype in size["dtypes"]:
            model = _model(args, dtype, device)
            workload = _workload(model, dtype)
            for micro in size["micro_batches"]:
                if not budget.left():
                    continue
                torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
                try:
                    x = torch.randint(0, model.hparams.vocab_size, (micro, model.hparams.seq_len), device=device)
                    profile = profile_module(model, x, name=name, dtype=_element_dtype(dtype),
                                             repeats=size["repeats"], warmup=size["warmup"],
                                             device_type=device_type)
                finally:
                    torch.set_float32_matmul_precision("highest")
                path = out / "profiles" / f"{name}.{dtype}.mbs{micro}.model.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                with replacing(path) as tmp:
                    tmp.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
                measured = [f + b for f, b, _ in profile.profile.layer_times(device_type, 1, micro)]
                if cluster is None:
                    predicted = [math.nan] * workload.num_layers
                else:
                    cm = CostModel(cluster, workload, _settings(dtype, micro))
                    predicted = [cm.stage_compute_s(cluster.devices[0], 1, micro, i, i + 1)
                                 for i in range(workload.num_layers)]
                blocks = range(1, workload.num_layers - 1)
                saved = [profile.workload.layers[i].activation_bytes_per_sample * micro for i in blocks]
                rows.append({
                    "model": name, "dtype": dtype, "micro_batch": micro, "profile": str(path.relative_to(out)),
                    "block_s": statistics.median(measured[i] for i in blocks),
                    "block_predicted_s": statistics.median(predicted[i] for i in blocks),
                    "head_s": measured[-1], "head_predicted_s": predicted[-1],
                    "embedding_s": measured[0], "embedding_predicted_s": predicted[0],
                    "block_saved_bytes": statistics.median(saved),
                    "block_predicted_bytes": workload.layers[1].activation_bytes_per_sample * micro,
                })
            del model
    print("(1) layer times, predicted / measured (forward + backward; a block: the median over the model's blocks)")
    print(f"  {'model':22s} {'dtype':5s} {'mbs':>3s} {'block ms':>9s} {'ratio':>6s} {'head ms':>9s} {'ratio':>6s} "
          f"{'embed ms':>9s} {'ratio':>6s}")
    for r in rows:
        print(f"  {r['model']:22s} {r['dtype']:5s} {r['micro_batch']:3d} {r['block_s'] * 1e3:9.3f} "
              f"{_ratio(r, 'block'):6.2f} {r['head_s'] * 1e3:9.3f} {_ratio(r, 'head'):6.2f} "
              f"{r['embedding_s'] * 1e3:9.3f} {_ratio(r, 'embedding'):6.2f}")
    return rows


def _ratio(row: dict, what: str) -> float:
    return row[f"{what}_predicted_s"] / row[f"{what}_s"] if row[f"{what}_s"] > 0 else math.inf


# -- 2: codec throughput -------------------------------------------------------------------------------------------
def codec_throughput(mode: str, device: torch.device, device_type: str, budget: Budget) -> list[dict]:
    """GB/s of fp32 input through each planned codec's encoder and decoder, against the model's figure."""
    size = SIZES[mode]
    n = size["codec_elements"]
    torch.manual_seed(0)
    x = torch.randn(n, device=device)
    cfg = CompressionConfig()
    cluster = _one_device(device_type)
    assumed = math.nan if cluster is None else codec_bandwidth(cluster.devices[0]) / 1e9
    rows = []
    for token in JOINT_CHOICES:
        spec = CODECS[token]
        if spec.exchange is Exchange.ALLREDUCE or not budget.left():  # a cast: nothing encoded
            continue
        coder = TORCH_CODECS[token]
        times = []
        for i in range(size["codec_repeats"] + 1):
            _synchronize(device)
            t0 = time.perf_counter()
            coder.decode(spec, coder.encode(spec, x, (n,), cfg, None), cfg)
            _synchronize(device)
            if i:  # the first pass warms the kernels up
                times.append(time.perf_counter() - t0)
        gbs = n * 4 / statistics.median(times) / 1e9
        rows.append({"codec": str(token), "gbs": gbs, "assumed_gbs": assumed})
    print(f"(2) codec throughput, quantize + dequantize of {n * 4 / 2**20:.0f} MiB of fp32 "
          f"(the model without a measurement: {assumed:.2f} GB/s)")
    for r in rows:
        print(f"  {r['codec']:4s} {r['gbs']:8.2f} GB/s   assumed / measured {r['assumed_gbs'] / r['gbs']:6.2f}")
    return rows


# -- 3: memory ---------------------------------------------------------------------------------------------------
def memory(mode: str, device: torch.device, layer_rows: list[dict], budget: Budget) -> list[dict]:
    """Activations, the allocator's peak and reserve, and memory outside the allocator, against the model."""
    size = SIZES[mode]
    rows = []
    for dtype in size["memory_dtypes"]:
        for micro in size["micro_batches"]:
            if not budget.left():
                continue
            model = _model(size["models"][MEMORY_MODEL], dtype, device)
            workload = _workload(model, dtype)
            mem = MemoryModel(workload, TrainSettings(micro, dtype=dtype, max_tp=1, micro_batch_sizes=(micro,)))
            act_predicted = mem.stage_bytes(0, 0, workload.num_layers, 1, micro, 1, 1)
            state = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
            row: dict[str, Any] = {"model": MEMORY_MODEL, "dtype": dtype, "micro_batch": micro,
                                   "act_predicted_bytes": act_predicted, "loop_state_bytes": state}
            if device.type == "cuda":
                row.update(_cuda_step(model, micro, device))
            else:  # no allocator statistics: the bytes autograd saves, counted by the profiler
                profiled = next((r for r in layer_rows if (r["model"], r["dtype"], r["micro_batch"])
                                 == (MEMORY_MODEL, dtype, micro)), None)
                if profiled is None:
                    continue
                blocks = workload.num_layers - 2
                row.update({"block_act_bytes": profiled["block_saved_bytes"],
                            "block_act_predicted_bytes": profiled["block_predicted_bytes"], "blocks": blocks})
            rows.append(row)
            del model
    print("(3) memory, predicted / measured")
    for r in rows:
        head = f"  {r['model']} {r['dtype']:5s} mbs {r['micro_batch']}:"
        if "act_bytes" in r:
            print(f"{head} activations {r['act_bytes'] / GiB:.3f} GiB, model {r['act_predicted_bytes'] / GiB:.3f} "
                  f"({r['act_predicted_bytes'] / r['act_bytes']:.2f}); peak {r['peak_bytes'] / GiB:.3f} GiB, "
                  f"activations + loop state {(r['act_predicted_bytes'] + r['loop_state_bytes']) / GiB:.3f} "
                  f"({(r['act_predicted_bytes'] + r['loop_state_bytes']) / r['peak_bytes']:.2f}); reserved "
                  f"{r['reserved_bytes'] / GiB:.3f} GiB; outside the allocator {r['outside_bytes'] / 1e9:.2f} GB "
                  f"(model {OVERHEAD_TP1_BYTES / 1e9:.0f} GB)")
        else:
            print(f"{head} a block's saved activations {r['block_act_bytes'] / 2**20:.2f} MiB, model "
                  f"{r['block_act_predicted_bytes'] / 2**20:.2f} MiB "
                  f"({r['block_act_predicted_bytes'] / r['block_act_bytes']:.2f}); allocator figures: none on a CPU")
    return rows


def _cuda_step(model: CharGPT, micro: int, device: torch.device) -> dict[str, float]:
    """Two AdamW steps; the second one's activations, peak, reserve and the memory outside the allocator."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    hp = model.hparams
    x = torch.randint(0, hp.vocab_size, (micro, hp.seq_len), device=device)
    y = torch.randint(0, hp.vocab_size, (micro, hp.seq_len), device=device)
    result: dict[str, float] = {}
    for step in range(2):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loss = CharGPT.pipeline_loss(model(x), y)
        after = torch.cuda.memory_allocated(device)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if step:
            free, total = torch.cuda.mem_get_info(device)
            reserved = torch.cuda.memory_reserved(device)
            result = {"act_bytes": after - before, "peak_bytes": torch.cuda.max_memory_allocated(device),
                      "reserved_bytes": reserved, "outside_bytes": total - free - reserved}
    del opt
    torch.cuda.empty_cache()
    return result


# -- the run ---------------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU, smaller shapes (this script's test)")
    ap.add_argument("--out", required=True, help="folder for the calibration file and the profiles")
    ap.add_argument("--budget-s", type=float, default=270.0, help="the whole run's time limit in seconds")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_calibration: no CUDA device here; run with --cpu to check the script on the CPU", file=sys.stderr)
        return 2
    mode = "cpu" if args.cpu else "gpu"
    device = torch.device("cpu" if args.cpu else "cuda:0")
    if args.cpu:
        torch.set_num_threads(1)
    device_type = "CPU" if args.cpu else _cuda_type(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    print(f"device: {device_type} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
          f"torch {torch.__version__}")
    layer_rows = layer_times(mode, device, device_type, out, budget)
    codec_rows = codec_throughput(mode, device, device_type, budget)
    memory_rows = memory(mode, device, layer_rows, budget)
    codec_gbs = min((r["gbs"] for r in codec_rows), default=math.nan)
    calibration = {"device_type": device_type, "torch": torch.__version__, "mode": mode,
                   "catalog": {"codec_gbs": round(codec_gbs, 3)}, "layer_times": layer_rows,
                   "codecs": codec_rows, "memory": memory_rows, "rows_skipped_for_time": budget.skipped}
    path = out / f"{device_type}.calibration.json"
    with replacing(path) as tmp:
        tmp.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"wrote {path} (catalog: codec_gbs {codec_gbs:.3f}) and {len(layer_rows)} profiles under {out / 'profiles'}"
          + (f"; {budget.skipped} rows skipped: the time budget ran out" if budget.skipped else ""))
    blocks = [_ratio(r, "block") for r in layer_rows]
    acts = [r["act_predicted_bytes"] / r["act_bytes"] for r in memory_rows if "act_bytes" in r] or \
        [r["block_act_predicted_bytes"] / r["block_act_bytes"] for r in memory_rows]
    peaks = [(r["act_predicted_bytes"] + r["loop_state_bytes"]) / r["peak_bytes"] for r in memory_rows
             if "peak_bytes" in r]
    outside = [r["outside_bytes"] / 1e9 for r in memory_rows if "outside_bytes" in r]
    worst = max(blocks, key=lambda v: abs(math.log(v))) if blocks else math.nan
    print(f"RESULT device={device_type} block_ratio_median={statistics.median(blocks) if blocks else math.nan:.3f} "
          f"block_ratio_worst={worst:.3f} codec_gbs={codec_gbs:.3f} "
          f"codec_ratio={(codec_rows[0]['assumed_gbs'] / codec_gbs) if codec_rows else math.nan:.3f} "
          f"act_ratio_max={max(acts, default=math.nan):.3f} peak_ratio_max={max(peaks, default=math.nan):.3f} "
          f"outside_gb={max(outside, default=math.nan):.2f} seconds={budget.elapsed():.1f}")
    return 0


def _cuda_type(device: torch.device) -> str:
    """This GPU's catalog name (``catalog_device_name``), as the profiler files its times."""
    props = torch.cuda.get_device_properties(device)
    return catalog_device_name(props.name, props.total_memory / 2**30)


if __name__ == "__main__":
    sys.exit(main())
