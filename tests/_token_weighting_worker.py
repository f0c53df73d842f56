"""One rank of the token-weighted PlanRunner test: ``python _token_weighting_worker.py {dp|asym} OUT_DIR WEIGHTING``.

RANK, WORLD_SIZE, MASTER_* and DS_ACCELERATOR=cpu come from the environment.  Trains ``STEPS`` steps of a tiny
CharGPT (its ``pipeline_layers()`` and ``pipeline_loss``, a mean over the labels ``!= -100``) on one padded batch of
variable-length samples, weighted by ``samples`` or ``tokens``, and writes ``OUT_DIR/rank{r}.json`` (losses, this
rank's parameters).  Model, data, plans and optimizer are shared with the reference in ``test_token_weighting.py``.
"""

from __future__ import annotations

import json
import os
import sys

STEPS = 3
BATCH = 8
SEQ = 8
VOCAB = 16


def padded_pairs(n: int = BATCH, seq: int = SEQ, vocab: int = VOCAB, seed: int = 3):
    """``(x, y)`` of ``n`` samples of 1 to ``seq`` tokens, right-padded: ``x`` with 0, the targets ``y`` with -100."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, seq + 1, (n,), generator=g)
    tokens = torch.randint(1, vocab, (n, seq + 1), generator=g)
    x, y = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    for i, length in enumerate(lengths.tolist()):
        x[i, length:], y[i, length:] = 0, -100
    return x, y


def char_gpt(dtype):
    """A one-block CharGPT, the same weights in every process (seed 0)."""
    import torch

    from het_strategy.demo.char_gpt import CharGPT

    torch.manual_seed(0)
    return CharGPT(num_layers=2, hidden_size=16, num_heads=2, seq_len=SEQ, vocab_size=VOCAB).to(dtype)


def plan(mode: str):
    """dp: two one-stage replicas, 5 samples as 2+2+1 and 3 as 3 (DeepSpeed's grid, float32).  asym: a one-stage
    replica (5 as 2+2+1) and a 2-stage pipeline (3 as 1+1+1) on ranks 1 -> 2 (per-replica engines, float64)."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    layers = 4  # embedding, 2 blocks, head
    whole = Pipeline((Stage(("cpu0",), (0, layers)),), micro_batch_size=2, samples=5)
    other = (Pipeline((Stage(("cpu1",), (0, layers)),), micro_batch_size=3, samples=3) if mode == "dp" else
             Pipeline((Stage(("cpu1",), (0, 2)), Stage(("cpu2",), (2, layers))), micro_batch_size=1, samples=3))
    devices = ("cpu0", "cpu1") if mode == "dp" else ("cpu0", "cpu1", "cpu2")
    return Plan(cluster="local", cluster_devices=devices, model={"name": "char_gpt", "num_layers": layers},
                global_batch_size=BATCH, dtype="fp32", mode="manual", pipelines=(whole, other))


def dtype_of(mode: str):
    import torch

    return torch.float64 if mode == "asym" else torch.float32  # DeepSpeed's CPU grid allreduce has no float64


def optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=0.5)


def main() -> None:
    mode, out_dir, weighting = sys.argv[1], sys.argv[2], sys.argv[3]
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.strategy.loss_tokens import LossTokens

    torch.set_num_threads(1)
    model = char_gpt(dtype_of(mode))
    tokens = LossTokens(shifted=False) if weighting == "tokens" else None
    runner = PlanRunner(plan(mode), model.pipeline_layers(), model.pipeline_loss, optimizer, timeout_s=60,
                        loss_tokens=tokens)
    x, y = padded_pairs()
    result = {"rank": runner.rank, "losses": [runner.train_step(x, y) for _ in range(STEPS)],
              "eval_loss": runner.eval_step(x, y),
              "params": {n: p.double().flatten().tolist() for n, p in runner.named_parameters().items()}}
    with open(os.path.join(out_dir, f"rank{runner.rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
