"""Planning Hugging Face models from their config.json: counts, FLOPs, activations and planning time.

A section of ``benchmarks/hf_models.py`` (``run()`` returns its RESULT keys); it also runs alone:
``python benchmarks/_hf_planning.py``.

1. ``params_exact``: the worst relative error of ``hf_workload(config).total_params`` (and, for MoE, of
   ``active_params_per_token``) against ``sum(p.numel())`` of ``AutoModelForCausalLM.from_config`` on the meta
   device, over the published configs of ``het_strategy/reference/data/hf_configs`` (Llama-3-8B, Llama-3.2-1B
   tied, Qwen2-7B, Qwen2-0.5B tied, Mistral-7B, Mixtral-8x7B, Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B, GPT-2) and the
   small configs of ``tests/data/hf``.  Active parameters: the total less (E - k)/E of each MoE layer's experts.
2. ``flops_worst_err``: forward FLOPs per token of the workload (the planner's convention: forward counted,
   backward 2x it) against ``torch.utils.flop_counter.FlopCounterMode`` over one forward of the small config of
   each family (batch 2, 64 tokens), worst relative error.
3. ``act_worst_err``: bytes each decoder layer keeps for backward (``LayerCost.activation_bytes_per_sample``)
   against what autograd saves inside that layer in training mode (``saved_tensors_hooks``; each storage once,
   parameters and storages an earlier layer saved left out), bf16 and fp32, worst relative error over layers.
4. ``plan_8b_s`` and ``plan_moe_s``: wall time of ``het-plan model=<config.json> cluster=sailor_a100_v100_32_96``
   in a fresh process (start, compose, plan, write plan.json) for Llama-3-8B and Mixtral-8x7B (model.seq_len
   2048; Mixtral with activation checkpointing, without which no plan fits), the best of two runs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PUBLISHED = ROOT / "het_strategy" / "reference" / "data" / "hf_configs"
SMALL = ROOT / "tests" / "data" / "hf"
_FAMILY_SMALL = ("llama_tiny", "llama_tied_tiny", "mistral_tiny", "qwen2_tiny", "qwen3_tiny", "mixtral_tiny",
                 "qwen2_moe_tiny", "qwen3_moe_tiny", "gpt2_tiny")

_MOE_SETTINGS = ("settings.activation_checkpointing=true",)
"""Mixtral-8x7B fits the 32 A100-40GB of sailor_a100_v100_32_96 only with activation checkpointing (or ZeRO-3)."""

__all__ = ["run", "reference_counts", "measured_flops_per_token", "saved_bytes_per_layer"]


def reference_counts(raw: dict) -> tuple[int, int]:
    """(total, active per token) parameters of the model transformers builds from ``raw`` on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    num = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    k = getattr(cfg, "num_experts_per_tok", 0) or 0
    return total, total - (experts * (num - k) // num if num else 0)


def _small_model(raw: dict, dtype: str, eager: bool = False):
    """The model of ``raw`` in training mode: sdpa attention and transformers' default experts kernel, or
    (``eager``) the matmul attention and the per-expert loop, whose matmuls FlopCounterMode sees."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    kernels = {"attn_implementation": "eager", "experts_implementation": "eager"} if eager else \
        {"attn_implementation": "sdpa"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw), **kernels)
    return model.to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])).train()


def _blocks(model) -> list:
    inner = getattr(model, "model", None) or getattr(model, "transformer")
    return list(getattr(inner, "layers", None) or inner.h)


def measured_flops_per_token(raw: dict, seq_len: int = 64, batch: int = 2) -> float:
    """Forward FLOPs per token FlopCounterMode counts for the model of ``raw`` (fp32)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = _small_model(raw, "fp32", eager=True)
    ids = torch.randint(0, raw["vocab_size"], (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, use_cache=False)
    return counter.get_total_flops() / (batch * seq_len)


def saved_bytes_per_layer(raw: dict, dtype: str, seq_len: int = 64, batch: int = 2) -> list[float]:
    """Bytes per sample autograd saves inside each decoder layer in one training forward (with the loss)."""
    import torch

    model = _small_model(raw, dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per_layer: list[dict[int, int]] = []
    current: list[int | None] = [None]

    def pack(t):
        if current[0] is not None:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in params and key not in seen:
                per_layer[current[0]][key] = storage.nbytes()
        return t

    def enter(i: int):
        def hook(module, args) -> None:
            current[0] = i
        return hook

    def leave(i: int):
        def hook(module, args, output) -> None:
            current[0] = None
            seen.update(per_layer[i])
        return hook

    handles = []
    for i, block in enumerate(_blocks(model)):
        per_layer.append({})
        handles += [block.register_forward_pre_hook(enter(i)), block.register_forward_hook(leave(i))]
    ids = torch.randint(0, raw["vocab_size"], (batch, seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, use_cache=False)
    for h in handles:
        h.remove()
    return [sum(d.values()) / batch for d in per_layer]


def _params_rows() -> tuple[list[str], float]:
    from het_strategy.core.hf_config import hf_workload

    rows, worst = [], 0.0
    for path in sorted(PUBLISHED.glob("*.json")) + sorted(SMALL.glob("*.json")):
        raw = json.loads(path.read_text())
        total, active = reference_counts(raw)
        w = hf_workload(raw, 128)
        err = max(abs(w.total_params - total) / total, abs(w.active_params_per_token - active) / active)
        worst = max(worst, err)
        rows.append(f"  {path.stem:20s} {raw['model_type']:10s} transformers {total:>15,} (active {active:>15,})  "
                    f"ours {w.total_params:>15,} (active {w.active_params_per_token:>15,})  rel err {err:.1e}")
    return rows, worst


def _workload_flops_per_token(w) -> float:
    forward = sum(layer.flops_per_sample + (layer.moe.top_k * layer.moe.flops_per_token_per_expert * w.seq_len
                                            if layer.moe else 0) for layer in w.layers)
    return forward / w.seq_len


def _flops_and_act_rows(seq_len: int = 64) -> tuple[list[str], float, float]:
    from het_strategy.core.hf_config import hf_workload

    rows, worst_f, worst_a = [], 0.0, 0.0
    for name in _FAMILY_SMALL:
        raw = json.loads((SMALL / f"{name}.json").read_text())
        ours = _workload_flops_per_token(hf_workload(raw, seq_len, "fp32"))
        measured = measured_flops_per_token(raw, seq_len)
        err_f = abs(ours - measured) / measured
        worst_f = max(worst_f, err_f)
        acts = []
        for dtype in ("bf16", "fp32"):
            w = hf_workload(raw, seq_len, dtype)
            blocks = [layer for layer in w.layers if layer.name.startswith("block")]
            got = saved_bytes_per_layer(raw, dtype, seq_len)
            errs = [abs(b.activation_bytes_per_sample - m) / m for b, m in zip(blocks, got)]
            worst_a = max(worst_a, *errs)
            acts.append(f"{dtype} ours/measured {blocks[-1].activation_bytes_per_sample / got[-1]:.3f} "
                        f"(worst layer {max(errs):.1%})")
        rows.append(f"  {name:16s} FLOPs/token ours {ours:>10,.0f} counted {measured:>10,.0f} ({err_f:.2%});  "
                    + ";  ".join(acts))
    return rows, worst_f, worst_a


def _plan_seconds(config: str, *extra: str) -> tuple[float, str]:
    """Best of two wall times of the ``het-plan`` command (a fresh process: start, compose, plan, write), and the
    plan's shape and predicted step time."""
    import subprocess

    best, shape = float("inf"), ""
    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "het_strategy.cli.plan_cli", f"model={PUBLISHED / config}",
                   "cluster=sailor_a100_v100_32_96", "model.seq_len=2048", f"output.dir={out}", *extra]
        for _ in range(2):
            start = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True, cwd=ROOT)
            best = min(best, time.perf_counter() - start)
        plan = json.loads((Path(out) / "plan.json").read_text())
        shape = (f"{len(plan['pipelines'])} pipeline(s) of {len(plan['pipelines'][0]['stages'])} stages, "
                 f"{plan['predicted']['step_time_s']:.2f} s/step predicted")
    return best, shape


def run() -> dict[str, str]:
    """Print this section's table; return its RESULT keys."""
    print("Planning from config.json (benchmarks/_hf_planning.py)")
    rows, params_err = _params_rows()
    print("parameters, transformers' meta-device model vs hf_workload:", *rows, sep="\n")
    rows, flops_err, act_err = _flops_and_act_rows()
    print("forward FLOPs per token (FlopCounterMode) and bytes saved per decoder layer (saved_tensors_hooks), "
          "64 tokens:", *rows, sep="\n")
    (plan_8b, shape_8b), (plan_moe, shape_moe) = (_plan_seconds("llama3_8b.json"),
                                                  _plan_seconds("mixtral_8x7b.json", *_MOE_SETTINGS))
    print(f"het-plan model=<config.json> cluster=sailor_a100_v100_32_96 model.seq_len=2048:\n"
          f"  Llama-3-8B    {plan_8b:6.2f} s  ({shape_8b})\n"
          f"  Mixtral-8x7B  {plan_moe:6.2f} s  ({' '.join(_MOE_SETTINGS)}: {shape_moe})")
    return {"params_exact": f"{params_err:.1e}", "flops_worst_err": f"{flops_err:.4f}",
            "act_worst_err": f"{act_err:.4f}", "plan_8b_s": f"{plan_8b:.2f}", "plan_moe_s": f"{plan_moe:.2f}"}


if __name__ == "__main__":
    result = run()
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
