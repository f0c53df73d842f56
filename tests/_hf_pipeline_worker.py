"""One rank of the Hugging Face pipeline tests: ``python _hf_pipeline_worker.py CASES OUT_DIR [padded]``.

A tiny Llama (``CONFIG``: 4 layers, hidden 32, GQA 4:2, float64) is cut by ``hf_pipeline_units`` and trained
``STEPS`` steps with AdamW through ``PlanRunner`` on the whole global batch (a dict batch's ``input_ids``,
``attention_mask``, ``labels``), once per case of ``CASES`` (comma-separated, each in a fresh model, all on the same
3 ranks):

- ``aligned``: one replica of three stages ``[0, 2) [2, 4) [4, 6)``, micro-batches 4 + 2, in float64: run per
  replica (``core.runtime_rules.runs_per_replica``: DeepSpeed's grid reduces no float64 gradient);
- ``asym``: replica 0 one device (3 samples as 2 + 1), replica 1 two stages ``[0, 2) [2, 6)`` (3 samples);
- ``tp``: a tp-2 stage ``[0, 4)`` sending to a tp-1 stage ``[4, 6)``, micro-batches 4 + 2;
- ``dp``: three one-stage replicas taking 3, 2 and 1 samples (on DeepSpeed's own grid, so float32);
- ``qwen3_tp``: the same plan as ``tp`` for a tiny Qwen3 (per-head q/k norms: replicated, their gradients summed
  over the tp group).

``padded``: rows of different lengths, right-padded (``attention_mask`` 0, ``labels`` -100 there); each micro-batch's
loss is weighted by its counted tokens (``strategy.loss_tokens.LossTokens``), so the step is the single process's mean
over the global batch's tokens.  Each rank writes
``OUT_DIR/rank{r}.json``: per case the losses, and the largest difference of each of its parameters (its tp shard)
from the single-process Hugging Face model trained on the same batch (``reference``).
"""

from __future__ import annotations

import json
import os
import sys

STEPS = 3
BATCH = 6
SEQ = 8
LR = 1e-2
CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
LENGTHS = (8, 5, 8, 3, 6, 7)
"""Tokens of each row in the padded case (the rest is padding)."""


FLOAT32 = ("dp",)
"""The cases run in float32 (the others in float64)."""


def model(dtype: str = "fp64", family: str = "llama"):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"head_dim": 8} if family == "qwen3" else {}
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **CONFIG, **extra))
    return m.float() if dtype == "fp32" else m.double()


def batch(padded: bool) -> dict:
    import torch

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        for row, n in enumerate(LENGTHS):
            mask[row, n:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def reference(padded: bool, dtype: str = "fp64", family: str = "llama"):
    """Losses and parameters (by Hugging Face name) of one process: the model's own forward, the mean next-token
    cross-entropy over every counted token of the batch (ForCausalLMLoss, in float64)."""
    return train_one_process(model(dtype, family), batch(padded))


def train_one_process(m, b, after_step=None):
    """``STEPS`` AdamW steps of ``m`` on the batch ``b`` in one process (the mean next-token cross-entropy over
    every counted token); ``after_step(m)`` after each.  Returns the losses and the parameters by name."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, m.config.vocab_size), b["labels"][:, 1:].reshape(-1),
                               ignore_index=-100)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(m)
    return losses, {n: q.detach().clone() for n, q in m.state_dict().items()}


def _family(case: str) -> str:
    return "qwen3" if case.startswith("qwen3") else "llama"


def plan(case: str):
    from het_strategy.core.plan import Pipeline, Plan, Stage

    if case == "aligned":
        pipes = [Pipeline((Stage(("a",), (0, 2)), Stage(("b",), (2, 4)), Stage(("c",), (4, 6))),
                          micro_batch_size=4, samples=BATCH)]
    elif case == "asym":
        pipes = [Pipeline((Stage(("a",), (0, 6)),), micro_batch_size=2, samples=3),
                 Pipeline((Stage(("b",), (0, 2)), Stage(("c",), (2, 6))), micro_batch_size=2, samples=3)]
    elif case == "dp":
        pipes = [Pipeline((Stage((d,), (0, 6)),), micro_batch_size=m, samples=n)
                 for d, m, n in (("a", 2, 3), ("b", 1, 2), ("c", 1, 1))]
    elif case in ("tp", "qwen3_tp"):
        pipes = [Pipeline((Stage(("a", "b"), (0, 4)), Stage(("c",), (4, 6))), micro_batch_size=4, samples=BATCH)]
    else:
        raise SystemExit(f"unknown case {case}")
    return Plan(cluster="local", cluster_devices=("a", "b", "c"), model={"name": "tiny_llama", "num_layers": 6},
                global_batch_size=BATCH, dtype="fp32", mode="manual", zero_stage=0, pipelines=tuple(pipes))


def run_case(case: str, padded: bool, ref_losses, ref_params) -> dict:
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.hf.causal_lm_loss import CausalLMLoss
    from het_strategy.hf.pipeline_units import hf_pipeline_units
    from het_strategy.strategy.global_batches import batch_pair
    from het_strategy.strategy.loss_tokens import LossTokens
    from het_strategy.tensor_parallel.layers import shard_of

    m = model("fp32" if case in FLOAT32 else "fp64", _family(case))
    units = hf_pipeline_units(m)
    names = [u.hf_names() for u in units]
    specs = [u.tensor_parallel_plan().shard_specs() if getattr(u, "tensor_parallel_plan", lambda: None)() else {}
             for u in units]
    runner = PlanRunner(plan(case), units, CausalLMLoss(m), lambda params: torch.optim.AdamW(params, lr=LR),
                        timeout_s=120, loss_tokens=LossTokens(shifted=True))
    inputs, labels = batch_pair(batch(padded), "batch")
    losses = [runner.train_step(inputs, labels) for _ in range(STEPS)]
    group = runner.layout.group_of(runner.rank)
    tp, tp_rank = len(group), group.index(runner.rank)
    diffs = {}
    for name, value in runner.named_parameters().items():
        layer, _, local = name.partition(".")
        want = ref_params[names[int(layer)][local]]
        spec = specs[int(layer)].get(local)
        if spec is not None and tp > 1:
            want = shard_of(want, spec, tp, tp_rank)
        diffs[names[int(layer)][local]] = float((value.double() - want).abs().max())
    return {"losses": losses, "ref_losses": ref_losses, "param_diffs": diffs, "tp": tp,
            "per_replica": runner.layout.per_replica}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    cases, out = sys.argv[1].split(","), sys.argv[2]
    padded = len(sys.argv) > 3 and sys.argv[3] == "padded"
    refs = {}
    for case in cases:
        key = ("fp32" if case in FLOAT32 else "fp64", _family(case))
        if key not in refs:
            refs[key] = reference(padded, *key)
    result = {case: run_case(case, padded, *refs["fp32" if case in FLOAT32 else "fp64", _family(case)])
              for case in cases}
    import deepspeed.comm as dist

    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
