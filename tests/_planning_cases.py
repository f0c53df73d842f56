"""Small models and devices of given figures, for the planner tests that compare with brute force."""

from __future__ import annotations

from het_strategy.core.workload import TransformerConfig, WorkloadSpec, transformer_workload

MODEL = {"num_layers": 2, "hidden_size": 512, "num_heads": 8, "seq_len": 128, "vocab_size": 4096}


def small_workload(**over: int) -> WorkloadSpec:
    """A 2-block transformer (``MODEL``, fields overridden by ``over``)."""
    return transformer_workload(TransformerConfig(name="m", **{**MODEL, **over}))


def device(name: str, tflops: float, memory_gb: float = 40.0) -> dict:
    """A device of its own type with these figures (cluster YAML schema)."""
    return {"name": name, "type": f"t{tflops:g}", "tflops": tflops, "memory_gb": memory_gb,
            "memory_bandwidth_gbs": 1000, "efficiency": 1.0}
