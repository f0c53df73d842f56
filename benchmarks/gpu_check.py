"""A prepared check of the GPU paths of issue 24 on one CUDA device (NCCL, CUDA), under 5 minutes.

What it checks, each section in its own process (a hang or crash in one is killed at its time limit and the
next still runs; every section prints one summary line):

1. **Compressed DDP comm hooks on NCCL** (``compression/hook.py``, ``exchange.py``, ``hierarchical.py``).  A
   small model in torch DDP on ``cuda:0``, NCCL, world size 1, with ``compression_hook`` for every codec of the
   registry (``core.codecs.CODECS``: the allreduce casts, the quantizers, top-k, PowerSGD), q4 with stochastic
   rounding, one bucket whose layers go through six codecs, and ``hierarchical_hook``; ``STEPS_HOOK`` backward
   passes each.  It checks that on NCCL the hook takes the chained (overlapped) path (``exchange.chain`` is
   called: ``exchange.overlaps`` says yes for NCCL), then runs the same steps with the synchronous path forced
   (``exchange.overlaps`` patched to no, as ``tests/test_compression_futures.py`` forces the other way) and
   prints, per codec, the largest absolute difference of the gradients and error-feedback residuals between
   the two paths (expected 0: the same collectives and arithmetic in the same order).
2. **DeepSpeed runtime dtypes on CUDA** (``ds_runtime.engine.PlanRunner``).  The demo char GPT
   (``CharGPT.pipeline_layers()``, ``CharGPT.pipeline_loss``) on a one-device plan (one stage: DeepSpeed's
   plain engine, not its pipeline engine), trained the same steps on the same batches from the same initial
   weights, with AdamW, in fp32 (ZeRO 0), bf16 (ZeRO 0: DeepSpeed wraps the optimizer in its bf16 one) and
   fp16 (ZeRO 1: DeepSpeed's own engine trains fp16 at ZeRO >= 1 only, ``core.runtime_rules``; dynamic loss scaling,
   whose first steps overflow and are skipped by design).  It prints each run's final train and held-out
   losses, the steps skipped, the dtype and device the engine holds the layers in, and the relative gap of
   the held-out loss: bf16's to fp32, fp16's to an fp32 run that leaves out the batches of fp16's skipped
   steps (the gap to plain fp32 is printed beside it); bound ``GAP_BOUND``.  DeepSpeed picks the CUDA
   accelerator and NCCL itself from RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* (``init_deepspeed_distributed``).
3. **Tensor parallelism**: a tp-2 stage of the char GPT on two ranks sharing the one GPU (gloo carries the tp
   collectives on CUDA tensors: NCCL cannot hold two ranks on one device), in fp32 and bf16, with clipping,
   against one process on the same GPU: the largest parameter difference to the reference's shards (fp32:
   bound 1e-4) and the losses' relative gap (fp32 1e-4, bf16 3e-2).
4. **Per-device precision on** ``hetero_deepspeed``: two one-device replicas sharing the GPU (gloo), one
   computing in bf16 and one in fp16 with loss scaling, over the runtime's fp32 masters (``core.runtime_rules``
   deepspeed rule 7), with clipping, against one fp32 process: the losses' relative gap (bound 3e-2) and no
   skipped step.

What it cannot check: the machine it was written for has ONE GPU, and NCCL refuses two ranks on one device in
a communicator, so every NCCL run here is world size 1.  The collectives run (on one rank they copy), the
futures chain and the CUDA streams and events are exercised, but not traffic between ranks, not the ordering
of collectives across ranks, not a multi-stage pipeline (its stages would be ranks) and not a DeepSpeed
gradient reduction over replicas.  Those run on gloo in the multi-process tests.  Nor does it time anything:
one rank on a small model shows no overlap worth measuring.

``--cpu`` runs the same sections on the CPU with gloo (``DS_ACCELERATOR=cpu``), smaller, so that this script
is tested where no GPU is (``tests/test_gpu_check.py``).  Off NCCL the hooks take the synchronous path by
design (``exchange.overlaps``); there the chained path is the forced one.  DeepSpeed refuses fp16 on a CPU
without oneDNN fp16 kernels; ``--cpu`` overrides that check (and says so) so the fp16 path still runs.

Run (from the repository root; about a minute on a GPU, ``--budget-s`` caps the whole run)::

    .venv/bin/python benchmarks/gpu_check.py                      # on the GPU machine
    .venv/bin/python benchmarks/gpu_check.py --log-dir "$OUT"     # keep every section's full log
    .venv/bin/python benchmarks/gpu_check.py --cpu                # here: gloo, CPU, smaller model

On a machine whose Python has a CUDA torch and Lightning but no DeepSpeed (this workplace's H200 image), the
package's own files go on ``PYTHONPATH`` and DeepSpeed travels as wheels made here (DeepSpeed is an sdist:
``pip wheel --no-deps deepspeed==0.19.8``; ``pip download --no-deps --only-binary=:all: --python-version 3.12``
of pydantic, pydantic-core, hjson, annotated-types and typing-inspection), installed there with
``pip install --no-index --no-deps --target /tmp/site .whl/*.whl`` and ``PYTHONPATH=/tmp/site:$PWD``.

Exit status 0 when every section that is built passed.  Last line:
``RESULT hook_ok=... hook_max_diff=... bf16_gap=... fp16_gap=... tp=... per_device_gap=... gpu=<name>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TAG = "gpu_check| "
"""The sections' own lines start with it: the parent prints those from a section's log (DeepSpeed's logging
goes to the log only, and its tail is printed when a section fails)."""

STEPS_HOOK = 3
"""Backward passes per hook run: error feedback, PowerSGD's warm start and the chunk residuals carry across."""
HOOK_TOL = 1e-6
"""Largest absolute difference between the chained and the synchronous path that still passes (0 expected)."""
GAP_BOUND = 0.05
"""Largest relative gap of the bf16/fp16 held-out loss to fp32's that passes.  Loose on purpose: 60 steps end
on a steep part of the loss curve, where a small lag is a large gap, and a one-stage bf16 ZeRO-0 plan runs
DeepSpeed's DDP-bf16 wrapper, which accumulates the micro-batches' gradients in bf16 (at the GPU sizes on a
CPU, bf16 ended 2.7% above fp32; at the ``--cpu`` sizes 0.3%)."""

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"model": {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "seq_len": 128, "vocab_size": 256},
            "batch": 32, "micro": 8, "steps": 60, "val_batches": 4, "lr": 3e-3, "width": 256},
    "cpu": {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_len": 32, "vocab_size": 256},
            "batch": 8, "micro": 4, "steps": 10, "val_batches": 2, "lr": 3e-3, "width": 96},
}
"""Per mode: the char GPT, its global and micro batch, AdamW steps and lr; the hook model's width."""

SECTION_LIMIT_S = {"hook": 150.0, "ds": 90.0, "tp": 200.0, "per_device": 100.0}
"""Each section process is killed after this long (or when the run's budget is spent, if sooner)."""


# -- helpers shared by both sides ---------------------------------------------------------------------------
def _say(text: str) -> None:
    """Print ``text`` from a section, every line tagged (the parent prints only tagged lines)."""
    print("\n".join(TAG + line for line in text.splitlines()), flush=True)


def _tail(exc: BaseException, lines: int = 6) -> str:
    """The last ``lines`` lines of ``exc``'s traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip().splitlines()
    return "\n".join(text[-lines:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = path + ".tmp"
    Path(tmp).write_text(json.dumps(result))
    os.replace(tmp, path)


# -- section 1: compressed hooks -----------------------------------------------------------------------------
def _hook_model(width: int) -> Any:
    """Two large 2-D layers (compressed), a small one and 1-D parameters (never compressed): the layers of
    ``tests/_compression_worker.MixedNet``."""
    import torch

    class MixedNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(32, width)
            self.fc2 = torch.nn.Linear(width, width)
            self.norm = torch.nn.LayerNorm(width)
            self.head = torch.nn.Linear(width, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(torch.relu(self.fc2(torch.relu(self.fc1(x))))))

    return MixedNet()


def _hook_runs() -> dict[str, dict[str, Any]]:
    """Label -> compression config: every registered codec, q4 with stochastic rounding, one bucket of six codec
    groups (``mixed``: the tokens ``_MIXED`` names) and the hierarchical hook."""
    from het_strategy.core.codecs import CODECS

    runs: dict[str, dict[str, Any]] = {str(token): {"method": str(token)} for token in CODECS}
    runs["q4-stochastic"] = {"method": "q4", "stochastic_rounding": True}
    runs["mixed"] = {"method": "q4"}
    runs["hierarchical-q4"] = {"method": "q4"}
    return runs


_MIXED = {"module.fc1.weight": "q8", "module.fc2.weight": "topk", "module.head.weight": "powersgd",
          "module.fc1.bias": "fp16", "module.fc2.bias": "bf16", "module.norm.weight": "q4"}


def _train_hook(label: str, config: dict[str, Any], device: Any, chained: bool | None, width: int,
                bucket_cap_mb: float | None, groups: Any) -> dict[str, Any]:
    """``STEPS_HOOK`` backward passes of the hook model under DDP with ``label``'s hook.

    ``chained``: None leaves ``exchange.overlaps`` as it is (the backend decides); True/False forces it.
    Returns the gradients of every step, the residuals, how often ``exchange.chain`` ran and, per hook call,
    whether its future was already completed when the hook returned.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from het_strategy.compression import CompressionState, compression_hook, exchange
    from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook
    from het_strategy.core.codecs import Codec

    overlaps, chain, token_for = exchange.overlaps, exchange.chain, CompressionState.token_for
    chains: list[Any] = []

    def counted_chain(steps: Any, dev: Any) -> Any:
        chains.append(dev)
        return chain(steps, dev)

    exchange.chain = counted_chain  # type: ignore[assignment]
    if chained is not None:
        exchange.overlaps = lambda group: chained  # type: ignore[assignment]
    if label == "mixed":
        mixed = {name: Codec(token) for name, token in _MIXED.items()}
        CompressionState.token_for = lambda self, name, grad: mixed.get(name, Codec.NONE)  # type: ignore
    try:
        torch.manual_seed(0)
        net = _hook_model(width).to(device)
        kwargs: dict[str, Any] = {"bucket_cap_mb": bucket_cap_mb} if bucket_cap_mb else {}
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        model = DDP(net, **kwargs)
        full = {"warmup_steps": 0, "verbose": False, **config}
        if label.startswith("hierarchical"):
            state: Any = HierarchicalState(model, full, groups)
            base: Any = hierarchical_hook
        else:
            state = CompressionState(model, full)
            base = compression_hook
        calls: list[dict[str, Any]] = []

        # unannotated: DDP checks a hook's annotations as objects, and this module's are strings
        def recorded(st, bucket):  # type: ignore[no-untyped-def]
            fut = base(st, bucket)
            calls.append({"index": bucket.index(), "done": fut.done()})
            return fut

        model.register_comm_hook(state, recorded)
        grads = []
        for step in range(STEPS_HOOK):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step)).to(device)
            model.zero_grad()
            model(x).square().mean().backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.module.named_parameters()})
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        inter = state.inter if label.startswith("hierarchical") else state
        return {"grads": grads, "calls": calls, "chains": len(chains),
                "residuals": {k: v.detach().clone() for k, v in inter.residuals.items()},
                "chunk_residuals": {k: v.detach().clone() for k, v in inter.chunk_residuals.items()}}
    finally:
        exchange.overlaps, exchange.chain, CompressionState.token_for = overlaps, chain, token_for


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference of the two runs' gradients and residuals (inf if their keys differ)."""
    diff = 0.0
    for key in ("residuals", "chunk_residuals"):
        if a[key].keys() != b[key].keys():
            return math.inf
        for name in a[key]:
            diff = max(diff, float((a[key][name].double() - b[key][name].double()).abs().max()))
    for ga, gb in zip(a["grads"], b["grads"]):
        for name in ga:
            diff = max(diff, float((ga[name].double() - gb[name].double()).abs().max()))
    return diff


def _hook_section(cpu: bool, out: str) -> None:
    """Section 1 (module docstring), on NCCL/cuda:0 or, with ``cpu``, on gloo; writes its result to ``out``."""
    import torch
    import torch.distributed as dist

    from het_strategy.compression import exchange

    size = SIZES["cpu" if cpu else "gpu"]
    result: dict[str, Any] = {"ok": False, "max_diff": math.nan, "codecs": {}}
    if cpu:
        device, backend = torch.device("cpu"), "gloo"
        bucket_cap_mb = None  # one bucket: a collective launched from gloo's callback thread meets no other
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch (run with --cpu off a GPU)")
        device, backend = torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
        # deterministic kernels: the two paths' gradients are compared bitwise (warn_only: none is refused)
        torch.use_deterministic_algorithms(True, warn_only=True)
        bucket_cap_mb = 0.01  # several buckets after DDP's rebuild: buckets chained one after another
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        natural = exchange.overlaps(dist.group.WORLD)
        _say(f"hooks: backend {dist.get_backend()}, device {device}, world 1; exchange.overlaps -> {natural}: "
             + ("the compressed hooks chain their collectives on futures (the overlapped path); the synchronous "
                "path is forced for the comparison" if natural else
                "off NCCL the hooks run each collective to completion (the synchronous path, by design); the "
                "chained path is forced for the comparison"))
        groups = None
        try:
            from het_strategy.compression.hierarchical import node_groups

            groups = node_groups(1)  # world 1: one node, its own leader; no collective crosses nodes
        except Exception as exc:  # noqa: BLE001  (the hierarchical run then reports the error)
            _say(f"  node_groups(1) failed:\n{_tail(exc)}")
        ok_all, max_diff = True, 0.0
        for label, config in _hook_runs().items():
            try:
                row = _compare_paths(label, config, device, natural, size["width"], bucket_cap_mb, groups)
            except Exception as exc:  # noqa: BLE001  (a codec that fails is reported, the others still run)
                _say(f"  {label:<16} FAILED\n{_tail(exc)}")
                row = {"ok": False, "max_diff": math.nan, "error": _tail(exc, 2)}
            result["codecs"][label] = row
            ok_all = ok_all and row["ok"]
            max_diff = math.nan if math.isnan(row["max_diff"]) or math.isnan(max_diff) else max(max_diff,
                                                                                                 row["max_diff"])
        result.update(ok=ok_all, max_diff=max_diff, backend=backend, overlaps=natural)
        paths = "chained (natural) vs synchronous (forced)" if natural else \
            "synchronous (natural) vs chained (forced)"
        _say(f"SECTION hooks: {'ok' if ok_all else 'FAILED'}; {len(result['codecs'])} runs on {backend}, "
             f"{paths}, max |diff| {max_diff:.3e}")
        dist.barrier()
    finally:
        _write(out, result)
        dist.destroy_process_group()


def _compare_paths(label: str, config: dict[str, Any], device: Any, natural: bool, width: int,
                   bucket_cap_mb: float | None, groups: Any) -> dict[str, Any]:
    """One label on the backend's own path and on the other one forced; its printed line and verdict."""
    import torch

    if label.startswith("hierarchical") and groups is None:
        raise RuntimeError("no node groups (node_groups(1) failed above)")
    own = _train_hook(label, config, device, None, width, bucket_cap_mb, groups)
    forced = _train_hook(label, config, device, not natural, width, bucket_cap_mb, groups)
    diff = _max_diff(own, forced)
    # codec none sends every bucket through the plain asynchronous allreduce (DDP's own path), never chained;
    # the hierarchical hook chains even on one rank (its steps then launch no collective)
    compresses = label != "none"
    on_chain = {"own": own["chains"] > 0, "forced": forced["chains"] > 0}
    expected = {"own": natural and compresses, "forced": (not natural) and compresses}
    finite = all(bool(torch.isfinite(g).all()) for step in own["grads"] for g in step.values())
    nonzero = any(float(g.norm()) > 0 for g in own["grads"][-1].values())
    ok = on_chain == expected and finite and nonzero and diff <= HOOK_TOL
    pending = sum(not c["done"] for c in own["calls"])
    buckets = len({c["index"] for c in own["calls"]})
    path = "plain async allreduce" if not compresses else ("chained" if on_chain["own"] else "synchronous")
    _say(f"  {label:<16} own path: {path:<21} (exchange.chain x{own['chains']:<2} {buckets} bucket(s), "
         f"{pending}/{len(own['calls'])} futures pending at return)  forced: "
         f"{'chained' if on_chain['forced'] else 'synchronous'}  max |diff| {diff:.3e}"
         f"{'' if diff else ' (bitwise)'}  {'ok' if ok else 'FAILED'}"
         + ("" if on_chain == expected else f"  [chained {on_chain}, expected {expected}]")
         + ("" if finite and nonzero else "  [gradients not finite or all zero]"))
    return {"ok": ok, "max_diff": diff, "path": path, "chains": own["chains"], "forced_chains": forced["chains"]}


# -- section 2: DeepSpeed runtime dtypes ---------------------------------------------------------------------
def _text(max_bytes: int) -> tuple[Any, Any]:
    """Train and held-out bytes: the standard library's source (``demo.stdlib_text``), or this repository's
    own Python files if that fails."""
    import torch

    try:
        from het_strategy.demo.stdlib_text import stdlib_corpus

        corpus = stdlib_corpus(max_bytes=max_bytes)
        return corpus.train, corpus.val
    except Exception as exc:  # noqa: BLE001  (any text will do for comparing dtypes)
        _say(f"  stdlib corpus unavailable ({type(exc).__name__}: {exc}); using this repository's sources")
        data = b"".join(p.read_bytes() for p in sorted((REPO / "het_strategy").rglob("*.py")))[:max_bytes]
        data_t = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        cut = int(len(data_t) * 0.9)
        return data_t[:cut], data_t[cut:]


def _allow_cpu_fp16() -> None:
    """``--cpu`` only: DeepSpeed's CPU accelerator refuses fp16 where oneDNN has no fp16 kernels (most CPUs);
    say so and override that check, so that the fp16 path (ZeRO-1 optimizer, loss scaling) still runs here."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu" and not accel.is_fp16_supported():
        _say("  (--cpu: DeepSpeed refuses fp16 on this CPU, which has no oneDNN fp16; its check is overridden "
             "here so the path runs on torch's slower CPU fp16 kernels)")
        type(accel).is_fp16_supported = lambda self: True  # type: ignore[method-assign]


def _ds_section(cpu: bool, dtype: str, out: str, leave_out: set[int]) -> None:
    """One dtype of section 2 (module docstring); writes its losses and what the engine ran to ``out``.

    ``leave_out``: steps whose batch is not trained on (the fp32 reference of an fp16 run that skipped them).
    """
    import torch

    from het_strategy.core.plan import Pipeline, Plan, Stage
    from het_strategy.core.workload import TransformerConfig
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset
    from het_strategy.ds_runtime.engine import PlanRunner

    size = SIZES["cpu" if cpu else "gpu"]
    zero = 1 if dtype == "fp16" else 0
    if not cpu:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to torch (run with --cpu off a GPU)")
        torch.cuda.set_device(0)
    if cpu and dtype == "fp16":
        _allow_cpu_fp16()
    started = time.monotonic()
    model_cfg = size["model"]
    layers = model_cfg["num_layers"] + 2
    batch, device_name = size["batch"], ("cpu0" if cpu else "gpu0")
    plan = Plan(cluster="gpu_check", cluster_devices=(device_name,), model={"name": "char_gpt",
                "num_layers": layers}, global_batch_size=batch, dtype=dtype, zero_stage=zero, mode="manual",
                pipelines=(Pipeline((Stage((device_name,), (0, layers)),), micro_batch_size=size["micro"],
                                    samples=batch),))
    cfg = TransformerConfig(name="char_gpt", **model_cfg)
    torch.manual_seed(0)
    model = CharGPT.from_workload_config(cfg)
    runner = PlanRunner(plan, model.pipeline_layers(), CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=size["lr"]), timeout_s=120)
    engine = runner.engine
    param = next(engine.module.parameters())
    train_bytes, val_bytes = _text(1_000_000)
    train, val = CharDataset(train_bytes, cfg.seq_len), CharDataset(val_bytes, cfg.seq_len)
    steps = size["steps"]
    if len(train) < steps * batch or len(val) < size["val_batches"] * batch:
        raise RuntimeError(f"too little text: {len(train)} train / {len(val)} held-out windows")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))

    def stacked(data: Any, indices: Any) -> tuple[Any, Any]:
        xs, ys = zip(*(data[int(i)] for i in indices))
        return torch.stack(xs), torch.stack(ys)

    losses, skipped_at = [], []
    for step in range(steps):
        if step in leave_out:
            continue
        before = int(getattr(engine, "skipped_steps", 0))
        losses.append(runner.train_step(*stacked(train, order[step * batch:(step + 1) * batch])))
        if int(getattr(engine, "skipped_steps", 0)) > before:  # an overflow: the optimizer did not step
            skipped_at.append(step)
    val_losses = [runner.eval_step(*stacked(val, range(k * batch, (k + 1) * batch)))
                  for k in range(size["val_batches"])]
    result = {"dtype": dtype, "zero": zero, "losses": losses, "val_loss": sum(val_losses) / len(val_losses),
              "skipped": len(skipped_at), "skipped_at": skipped_at, "left_out": sorted(leave_out),
              "param_dtype": str(param.dtype),
              "device": str(param.device), "engine": type(engine).__name__,
              "optimizer": type(engine.optimizer).__name__, "seconds": time.monotonic() - started}
    _write(out, result)
    left = f" (steps {sorted(leave_out)} left out)" if leave_out else ""
    _say(f"ds {dtype}: ZeRO {zero}, {steps} steps{left} of batch {batch} (micro {size['micro']}), layers in "
         f"{param.dtype} on {param.device}, {type(engine).__name__} / {type(engine.optimizer).__name__}, "
         f"train loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out {result['val_loss']:.4f}, "
         f"skipped (overflow) steps {skipped_at or 'none'}, {result['seconds']:.1f} s")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


# -- section 3: tensor parallelism ---------------------------------------------------------------------------
# One GPU cannot hold two NCCL ranks (NCCL refuses a communicator with the same device twice), so the tp-2 check
# runs two ranks on cuda:0 over gloo, which carries CUDA tensors for the tp all-reduces and all-gathers: the
# split, the shard reduction and DeepSpeed's engine run on the GPU's kernels; NCCL's transport does not.
TP_STEPS = 4
TP_SHAPE = dict(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=128)
TP_BATCH = 6


PER_DEVICE_DTYPES = {"g0": "bf16", "g1": "fp16"}
"""Section 4's ranks: one computing in bf16, one in fp16 with loss scaling."""


def _tp_plan(dtype: str) -> Any:
    """Section 3: one tp-2 stage; section 4 (``per_device``): two one-device replicas in ``PER_DEVICE_DTYPES``."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    if dtype == "per_device":
        half = TP_BATCH // 2
        return Plan(cluster="local", cluster_devices=("g0", "g1"), model={"name": "char_gpt", "num_layers": 4},
                    global_batch_size=TP_BATCH, dtype=dtype, device_dtypes=PER_DEVICE_DTYPES, mode="manual",
                    zero_stage=0, pipelines=tuple(Pipeline((Stage((d,), (0, 4)),), micro_batch_size=half,
                                                           samples=half) for d in ("g0", "g1")))
    return Plan(cluster="local", cluster_devices=("g0", "g1"), model={"name": "char_gpt", "num_layers": 4},
                global_batch_size=TP_BATCH, dtype=dtype, mode="manual", zero_stage=0,
                pipelines=(Pipeline((Stage(("g0", "g1"), (0, 4)),), micro_batch_size=4, samples=TP_BATCH),))


def _tp_rank(cpu: bool, dtype: str, out: str) -> None:
    """One rank of the tp-2 run (started by ``run_script_ranks``): trains, then compares with one process."""
    import torch
    import torch.distributed as dist

    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.tensor_parallel.layers import shard_of
    from het_strategy.tensor_parallel.tp_plan import tensor_parallel_plan_of

    torch.set_num_threads(1)
    device = torch.device("cpu" if cpu else "cuda:0")
    if not cpu:
        os.environ["LOCAL_RANK"] = "0"  # both ranks on the one GPU (DeepSpeed's engine sets the device from it)
        torch.cuda.set_device(0)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, TP_SHAPE["vocab_size"], (TP_BATCH, TP_SHAPE["seq_len"]), generator=g)
    y = torch.randint(0, TP_SHAPE["vocab_size"], (TP_BATCH, TP_SHAPE["seq_len"]), generator=g)

    def model() -> Any:
        torch.manual_seed(0)
        return CharGPT(**TP_SHAPE)

    layers = model().pipeline_layers()
    specs = {i: (tensor_parallel_plan_of(layer).shard_specs() if tensor_parallel_plan_of(layer) else {})
             for i, layer in enumerate(layers)}
    runner = PlanRunner(_tp_plan(dtype), layers, CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=1e-3), gradient_clipping=1.0, timeout_s=120)
    losses = [runner.train_step(x, y) for _ in range(TP_STEPS)]
    ref = model().to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for _ in range(TP_STEPS):
        opt.zero_grad()
        loss = CharGPT.pipeline_loss(ref(x.to(device)), y.to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_losses.append(float(loss.detach()))
    named = {f"{i}.{n}": q.detach() for i, layer in enumerate(ref.pipeline_layers())
             for n, q in layer.named_parameters()}
    rank = dist.get_rank()
    worst, where = 0.0, set()
    tp = dtype != "per_device"  # per_device: each rank holds the whole model
    for name, value in runner.named_parameters().items():
        layer, _, local = name.partition(".")
        spec = specs[int(layer)].get(local)
        want = named[name] if spec is None or not tp else shard_of(named[name], spec, 2, rank)
        worst = max(worst, float((value.float() - want.float()).abs().max()))
        where.add(str(value.device))
    _write(f"{out}.rank{rank}", {"rank": rank, "losses": losses, "ref_losses": ref_losses, "max_diff": worst,
                                 "skipped": int(runner.engine.skipped_steps),
                                 "devices": sorted(where), "param_dtype": str(next(iter(
                                     runner.named_parameters().values())).dtype)})
    dist.barrier()
    dist.destroy_process_group()


def _tp_section(cpu: bool, dtype: str, out: str) -> None:
    """Two ranks, one tp-2 stage of the char GPT, ``TP_STEPS`` steps with clipping, against one process."""
    from het_strategy.emulation.local_ranks import run_script_ranks

    tmp = Path(out).parent / f"tp_{dtype}"
    tmp.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--section", "tp_rank", dtype, "--out", str(tmp / "r")]
    if cpu:
        argv.append("--cpu")
    # run_script_ranks sets each rank's RANK, WORLD_SIZE, LOCAL_RANK and MASTER_*; the rest of the section's env
    env = {k: v for k, v in _child_env(cpu).items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                "LOCAL_WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    codes = run_script_ranks(argv, 2, tmp, 150, env)
    if codes != [0, 0]:
        for r in range(2):
            log = tmp / f"log{r}.txt"
            text = log.read_text(errors="replace") if log.exists() else ""
            print(f"{TAG}  tp {dtype} rank {r} exited {codes[r]}; last lines:\n" + "\n".join(text.splitlines()[-15:]))
        _write(out, {"ok": False, "max_diff": math.nan})
        return
    ranks = [json.loads((tmp / f"r.rank{r}").read_text()) for r in range(2)]
    diff = max(r["max_diff"] for r in ranks)
    gap = max(abs(a - b) / b for r in ranks for a, b in zip(r["losses"], r["ref_losses"]))
    bound = (1e-4, 1e-4) if dtype == "fp32" else (3e-2, 5e-2)  # (loss, parameters): fp32's reduction order
    skipped = max(r["skipped"] for r in ranks)  # an fp16 overflow: that step's update left out, on every rank
    ok = gap <= bound[0] and skipped == 0 and (dtype != "fp32" or diff <= bound[1])
    shape = ("two one-device replicas, " + " and ".join(f"{r['param_dtype']}" for r in ranks) + " (per_device)"
             if dtype == "per_device" else "one tp-2 stage")
    print(f"{TAG}{'tp ' if dtype != 'per_device' else ''}{dtype}: 2 ranks on {ranks[0]['devices']} (gloo), {shape}, "
          f"{TP_STEPS} steps with clipping, {skipped} skipped; losses {[round(v, 4) for v in ranks[0]['losses']]} vs "
          f"one process {[round(v, 4) for v in ranks[0]['ref_losses']]} (largest relative gap {gap:.2e}); parameters "
          f"in {ranks[0]['param_dtype']}, largest |diff| to the reference's "
          f"{'shard' if dtype != 'per_device' else 'weights'} {diff:.2e}; {'ok' if ok else 'FAILED'}", flush=True)
    _write(out, {"ok": ok, "max_diff": diff, "gap": gap})


def check_tensor_parallel(cpu: bool, log_dir: Path, limit_s: float) -> float | None:
    """The tp-2 path on this device in fp32 and bf16 (each its own pair of ranks); the fp32 run's largest
    parameter difference to the single-process reference's shards, or None when neither produced a result."""
    results = {}
    for dtype in ("fp32", "bf16"):
        results[dtype] = _run_section(f"tp_{dtype}", ["tp", dtype], cpu, log_dir, limit_s / 2)
    ok = all(r is not None and r["ok"] for r in results.values())
    print(f"SECTION tensor parallel: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        raise RuntimeError("the tensor-parallel runs did not all pass (their lines above)")
    return float(results["fp32"]["max_diff"])


def check_per_device(cpu: bool, log_dir: Path, limit_s: float) -> float:
    """Two data-parallel ranks on this device, one computing in bf16 and one in fp16 (``hetero_deepspeed``'s
    per-device precision: the runtime's fp32 masters, one loss scale); the largest relative loss gap to one
    fp32 process."""
    res = _run_section("per_device", ["tp", "per_device"], cpu, log_dir, limit_s)
    ok = res is not None and res["ok"]
    print(f"SECTION per-device precision: {'ok' if ok else 'FAILED'}", flush=True)
    if not ok:
        raise RuntimeError("the per-device run did not pass (its line above)")
    return float(res["gap"])


# -- the parent: run each section, then the summary ----------------------------------------------------------
def _child_env(cpu: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if cpu:
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    else:
        # cuda, not the detection's fallback: on a machine whose CUDA is broken the section fails, not runs
        # on the CPU; the cuBLAS workspace setting makes its kernels deterministic (the paths are compared bitwise)
        env.update(DS_ACCELERATOR="cuda", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return env


def _run_section(name: str, argv: list[str], cpu: bool, log_dir: Path, limit_s: float) -> dict[str, Any] | None:
    """Run ``gpu_check.py --section ...`` in its own process (and process group) for at most ``limit_s``; print
    its tagged lines (all of its log's last lines if it failed); its result, or None."""
    out = log_dir / f"{name}.json"
    log = log_dir / f"{name}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", *argv, "--out", str(out)]
    if cpu:
        cmd.append("--cpu")
    started = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=_child_env(cpu), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the section's own process group (it and anything it started)
            proc.wait()
            code = None
    text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith(TAG):
            print(line[len(TAG):], flush=True)
    seconds = time.monotonic() - started
    result = json.loads(out.read_text()) if out.exists() else None
    if code != 0 or result is None:
        why = f"killed after {limit_s:.0f} s" if code is None else f"exit status {code}"
        print(f"  [{name}: {why}, {seconds:.0f} s; last lines of its log {log}]")
        print("    " + "\n    ".join(text.rstrip().splitlines()[-25:]), flush=True)
    return result


def _header(cpu: bool) -> str:
    """Versions and the device; the device's name for RESULT."""
    import importlib.metadata as md

    import torch

    versions = []
    for pkg in ("torch", "deepspeed", "lightning"):
        try:
            versions.append(f"{pkg} {md.version(pkg)}")
        except Exception:  # noqa: BLE001
            versions.append(f"{pkg} missing")
    print(f"gpu_check ({'--cpu: gloo on the CPU' if cpu else 'CUDA + NCCL'}); python {sys.version.split()[0]}, "
          + ", ".join(versions), flush=True)
    if cpu:
        return "cpu"
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch: the GPU sections will fail (run with --cpu off a GPU)")
        return "none"
    props = torch.cuda.get_device_properties(0)
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:  # noqa: BLE001  (only printed)
        nccl = "?"
    print(f"device 0 of {torch.cuda.device_count()}: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
          f"compute capability {props.major}.{props.minor}, CUDA {torch.version.cuda}, NCCL {nccl}, "
          f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}", flush=True)
    return props.name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="run on the CPU with gloo (DS_ACCELERATOR=cpu), smaller")
    ap.add_argument("--log-dir", default=None, help="keep each section's log and result here (default: a temp dir)")
    ap.add_argument("--budget-s", type=float, default=400.0, help="the whole run's time limit in seconds")
    ap.add_argument("--section", nargs="+", default=None, help=argparse.SUPPRESS)  # internal: one section
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.section:
        if args.section[0] == "hook":
            _hook_section(args.cpu, args.out)
        elif args.section[0] == "tp":
            _tp_section(args.cpu, args.section[1], args.out)
        elif args.section[0] == "tp_rank":
            _tp_rank(args.cpu, args.section[1], args.out)
        else:
            leave_out = {int(s) for s in args.section[2].split(",") if s} if len(args.section) > 2 else set()
            _ds_section(args.cpu, args.section[1], args.out, leave_out)
        return 0

    started = time.monotonic()
    gpu = "unknown"
    try:
        gpu = _header(args.cpu)
    except Exception as exc:  # noqa: BLE001
        print(f"header failed:\n{_tail(exc)}")
    keep = args.log_dir is not None
    log_dir = Path(args.log_dir) if keep else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def left(section: str) -> float:
        return min(SECTION_LIMIT_S[section], args.budget_s - (time.monotonic() - started))

    status: dict[str, str] = {}
    hook_ok, hook_diff = False, math.nan
    print("\n== 1. compressed DDP comm hooks " + ("(gloo, CPU)" if args.cpu else "(NCCL, cuda:0)"), flush=True)
    try:
        res = _run_section("hook", ["hook"], args.cpu, log_dir, left("hook"))
        if res is None:
            print("SECTION hooks: FAILED (no result)")
        else:
            hook_ok, hook_diff = bool(res["ok"]), float(res["max_diff"])
        status["hooks"] = "ok" if hook_ok else "FAILED"
    except Exception as exc:  # noqa: BLE001
        print(f"SECTION hooks: FAILED\n{_tail(exc)}")
        status["hooks"] = "FAILED"

    print("\n== 2. DeepSpeed runtime (PlanRunner, one device, char GPT): bf16 and fp16 against fp32 "
          + ("(gloo, CPU)" if args.cpu else "(cuda, NCCL)"), flush=True)
    runs: dict[str, dict[str, Any] | None] = {}
    for dtype in ("fp32", "bf16", "fp16"):
        try:
            runs[dtype] = _run_section(f"ds_{dtype}", ["ds", dtype], args.cpu, log_dir, left("ds"))
        except Exception as exc:  # noqa: BLE001
            print(f"ds {dtype}: FAILED\n{_tail(exc)}")
            runs[dtype] = None
    skipped = (runs.get("fp16") or {}).get("skipped_at") or []
    if skipped:  # fp16's reference: fp32 on the same batches, leaving out those whose update fp16 skipped
        try:
            runs[_FP32_SKIPS] = _run_section("ds_fp32_skips", ["ds", "fp32", ",".join(map(str, skipped))],
                                             args.cpu, log_dir, left("ds"))
        except Exception as exc:  # noqa: BLE001
            print(f"ds fp32 (fp16's skipped steps left out): FAILED\n{_tail(exc)}")
            runs[_FP32_SKIPS] = None
    gaps = {"bf16": math.nan, "fp16": math.nan}
    try:
        gaps, ok = _ds_summary(runs, args.cpu)
        status["ds"] = "ok" if ok else "FAILED"
    except Exception as exc:  # noqa: BLE001
        print(f"SECTION deepspeed dtypes: FAILED\n{_tail(exc)}")
        status["ds"] = "FAILED"

    print("\n== 3. tensor parallelism", flush=True)
    tp: float | None = None
    try:
        tp = check_tensor_parallel(args.cpu, log_dir, left("tp"))
        status["tp"] = "not built" if tp is None else f"ran (max |diff| {tp:.3e})"
    except Exception as exc:  # noqa: BLE001
        print(f"SECTION tensor parallel: FAILED\n{_tail(exc)}")
        status["tp"] = "FAILED"

    print("\n== 4. per-device precision (hetero_deepspeed: a bf16 rank and an fp16 rank)", flush=True)
    per_device = math.nan
    try:
        per_device = check_per_device(args.cpu, log_dir, left("per_device"))
        status["per_device"] = "ok"
    except Exception as exc:  # noqa: BLE001
        print(f"SECTION per-device precision: FAILED\n{_tail(exc)}")
        status["per_device"] = "FAILED"

    print(f"\nSUMMARY {'; '.join(f'{k}: {v}' for k, v in status.items())}; {time.monotonic() - started:.0f} s"
          + (f"; logs in {log_dir}" if keep else ""))
    tp_text = "not_built" if tp is None else ("error" if status["tp"] == "FAILED" else f"{tp:.3e}")
    print(f"RESULT hook_ok={hook_ok} hook_max_diff={hook_diff:.3e} bf16_gap={gaps['bf16']:.4f} "
          f"fp16_gap={gaps['fp16']:.4f} tp={tp_text} per_device_gap={per_device:.4f} gpu={gpu.replace(' ', '_')}",
          flush=True)
    if not keep:
        import shutil

        shutil.rmtree(log_dir, ignore_errors=True)
    return 0 if all(v in ("ok", "not built") or v.startswith("ran") for v in status.values()) else 1


_FP32_SKIPS = "fp32*"
"""The fp32 run that leaves out the steps whose update the fp16 run skipped (an overflow of its loss scale)."""


def _ds_summary(runs: dict[str, dict[str, Any] | None], cpu: bool) -> tuple[dict[str, float], bool]:
    """Print the dtype table and the section's line; the relative held-out gaps and the verdict.

    bf16's gap is to fp32; fp16's to fp32 with fp16's skipped steps left out (``_FP32_SKIPS``, when it skipped
    any): dynamic loss scaling skips the first steps by design (its scale starts at 2^16 and halves on each
    overflow), and the gap should measure fp16's arithmetic, not those few missing updates.  The gap to plain
    fp32 is printed beside it.
    """
    want = {"fp32": "torch.float32", _FP32_SKIPS: "torch.float32", "bf16": "torch.bfloat16",
            "fp16": "torch.float16"}
    device = "cpu" if cpu else "cuda"
    base = runs.get("fp32")
    reference = {"bf16": "fp32", "fp16": _FP32_SKIPS if _FP32_SKIPS in runs else "fp32"}
    gaps = {"bf16": math.nan, "fp16": math.nan}

    def gap(res: dict[str, Any], ref: dict[str, Any] | None) -> float:
        return abs(res["val_loss"] - ref["val_loss"]) / ref["val_loss"] if ref is not None else math.nan

    print(f"  {'run':<5} {'ZeRO':>4} {'layers in':<9} {'device':<7} {'updates':>7} {'final train':>11} "
          f"{'held-out':>9} {'skipped at':<11} {'gap':>7}  to")
    ok = base is not None
    for name, res in runs.items():
        if res is None:
            print(f"  {name:<5} FAILED (no result)")
            ok = False
            continue
        ref_name = reference.get(name, "")
        g = gap(res, runs.get(ref_name)) if ref_name else math.nan
        if name in gaps:
            gaps[name] = g
            ok = ok and math.isfinite(g) and g <= GAP_BOUND
        ok = ok and res["param_dtype"] == want[name] and res["device"].startswith(device)
        updates = len(res["losses"]) - res["skipped"]
        final = f"{res['losses'][-1]:.4f}" if res["losses"] else "-"
        note = ref_name
        if name == "fp16" and ref_name == _FP32_SKIPS:
            note += f" ({gap(res, base):.2%} to fp32)"
        elif name == _FP32_SKIPS:
            note = f"(fp32 without steps {res['left_out']})"
        print(f"  {name:<5} {res['zero']:>4} {res['param_dtype'].replace('torch.', ''):<9} {res['device']:<7} "
              f"{updates:>7} {final:>11} {res['val_loss']:>9.4f} {str(res['skipped_at'] or '-'):<11} "
              f"{'' if math.isnan(g) else f'{g:.2%}':>7}  {note}")
    fp16 = runs.get("fp16")
    if fp16 is not None and fp16["skipped"] * 2 > len(fp16["losses"]):
        print(f"  fp16 skipped {fp16['skipped']} of {len(fp16['losses'])} steps: its loss scaling is not settling")
        ok = False
    print(f"SECTION deepspeed dtypes: {'ok' if ok else 'FAILED'}; held-out loss gap: bf16 {gaps['bf16']:.2%} "
          f"(to fp32), fp16 {gaps['fp16']:.2%} (to {reference['fp16']}); bound {GAP_BOUND:.0%}; layers in "
          f"their dtype on {device}")
    return gaps, ok


if __name__ == "__main__":
    sys.exit(main())
