"""One rank of the tied-embedding pipeline tests: ``python _hf_tied_worker.py CASES OUT_DIR``.

A tiny Llama with ``tie_word_embeddings`` (2 layers, hidden 32: 4 pipeline units, the embedding and the head
sharing one matrix) is trained ``STEPS`` steps with AdamW through ``PlanRunner`` on padded batches (each
micro-batch weighted by its counted tokens), once per case of ``CASES``, on 3 gloo ranks:

- ``aligned``: one replica of three stages ``[0, 1) [1, 3) [3, 4)`` on DeepSpeed's own grid (float32: a float64
  model runs per replica), the tied copies on the first and last stage (DeepSpeed's tied-weight reduction);
- ``asym``: replica 0 one device ``[0, 4)`` (one copy, the shared parameter), replica 1 two stages ``[0, 2)
  [2, 4)`` (a copy on each), float64: the tied matrix is one holder set of the three ranks.

Each rank writes ``OUT_DIR/rank{r}.json``: per case the losses, the largest difference of each of its parameters from
the single-process model trained on the same batch, and after each step the largest difference of its copies of the
tied matrix from the single process's.
"""

from __future__ import annotations

import json
import os
import sys

import _hf_pipeline_worker as base

STEPS = 3
CONFIG = {**base.CONFIG, "num_hidden_layers": 2, "tie_word_embeddings": True}
FLOAT32 = ("aligned",)


def model(dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
    assert m.lm_head.weight is m.model.embed_tokens.weight
    return m.float() if dtype == "fp32" else m.double()


def reference(dtype: str):
    """Losses, the tied matrix after each step and the final parameters (by Hugging Face name) of one process."""
    tied = []
    losses, params = base.train_one_process(model(dtype), base.batch(True),
                                            lambda m: tied.append(m.lm_head.weight.detach().clone()))
    return losses, tied, params


def plan(case: str):
    from het_strategy.core.plan import Pipeline, Plan, Stage

    if case == "aligned":
        pipes = [Pipeline((Stage(("a",), (0, 1)), Stage(("b",), (1, 3)), Stage(("c",), (3, 4))),
                          micro_batch_size=4, samples=base.BATCH)]
    elif case == "asym":
        pipes = [Pipeline((Stage(("a",), (0, 4)),), micro_batch_size=2, samples=3),
                 Pipeline((Stage(("b",), (0, 2)), Stage(("c",), (2, 4))), micro_batch_size=2, samples=3)]
    else:
        raise SystemExit(f"unknown case {case}")
    return Plan(cluster="local", cluster_devices=("a", "b", "c"), model={"name": "tiny_tied", "num_layers": 4},
                global_batch_size=base.BATCH, dtype="fp32", mode="manual", zero_stage=0, pipelines=tuple(pipes))


def run_case(case: str, ref) -> dict:
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.hf.causal_lm_loss import CausalLMLoss
    from het_strategy.hf.pipeline_units import hf_pipeline_units
    from het_strategy.strategy.global_batches import batch_pair
    from het_strategy.strategy.loss_tokens import LossTokens

    ref_losses, ref_tied, ref_params = ref
    m = model("fp32" if case in FLOAT32 else "fp64")
    units = hf_pipeline_units(m)
    names = [u.hf_names() for u in units]
    runner = PlanRunner(plan(case), units, CausalLMLoss(m), lambda params: torch.optim.AdamW(params, lr=base.LR),
                        timeout_s=120, loss_tokens=LossTokens(shifted=True))
    inputs, labels = batch_pair(base.batch(True), "batch")
    losses, tied_diffs = [], []
    for step in range(STEPS):
        losses.append(runner.train_step(inputs, labels))
        copies = [q for n, q in runner.named_parameters().items() if n in ("0.token.weight", "3.lm_head.weight")]
        tied_diffs.append([float((q.double() - ref_tied[step].double()).abs().max()) for q in copies])
    diffs = {}
    for name, value in runner.named_parameters().items():
        layer, _, local = name.partition(".")
        key = names[int(layer)][local]
        diffs[key] = float((value.double() - ref_params[key].double()).abs().max())
    return {"losses": losses, "ref_losses": ref_losses, "param_diffs": diffs, "tied_diffs": tied_diffs,
            "layers": list(runner.layout.layers_of(runner.rank))}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    cases, out = sys.argv[1].split(","), sys.argv[2]
    refs = {dtype: reference(dtype) for dtype in {"fp32" if c in FLOAT32 else "fp64" for c in cases}}
    result = {case: run_case(case, refs["fp32" if case in FLOAT32 else "fp64"]) for case in cases}
    import deepspeed.comm as dist

    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
