"""Hugging Face causal LMs end to end: planned from their config.json, trained exactly, fast, saved back.

One run of three sections, each also runnable alone (``python benchmarks/_hf_<section>.py``):

- ``_hf_planning.py``: the workload read from a ``config.json`` against the model transformers builds from it
  (parameter counts, FLOPs per token, activation bytes per block) and ``het-plan``'s planning time for a
  published 8B and a 47B MoE config;
- ``_hf_training.py``: float64 equality of our pipelines, tp and data parallelism with the single-process HF
  model, and the planned pipeline of a Llama-shaped model against DeepSpeed's ``partition_method="parameters"``
  split on emulated unequal devices, with its step time against the prediction;
- ``_hf_round_trip.py``: a trained run saved as a ``save_pretrained`` directory, reloaded by
  ``from_pretrained``, its validation loss against the run's.

Emulated compute checks the schedule and the plan, not a GPU's speed.  Last line: ``RESULT params_exact=...
flops_worst_err=... act_worst_err=... exact_max_diff=... ratio=... model_error=... reload_diff=... plan_8b_s=...
plan_moe_s=...``.
"""

from __future__ import annotations

import importlib

SECTIONS = ("_hf_planning", "_hf_training", "_hf_round_trip")
"""The section modules, in the order they run."""
KEYS = ("params_exact", "flops_worst_err", "act_worst_err", "exact_max_diff", "ratio", "model_error",
        "reload_diff", "plan_8b_s", "plan_moe_s")
"""The RESULT keys, in the issue's order; a section's other keys follow them."""


def main() -> None:
    results: dict[str, str] = {}
    for name in SECTIONS:
        print(f"== {name}")
        results.update(importlib.import_module(name).run())
    ordered = [k for k in KEYS if k in results] + [k for k in results if k not in KEYS]
    missing = [k for k in KEYS if k not in results]
    if missing:
        print(f"keys no section measured: {', '.join(missing)}")
    print("RESULT " + " ".join(f"{k}={results[k]}" for k in ordered))


if __name__ == "__main__":
    main()
