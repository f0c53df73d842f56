"""One rank of the DeepSpeed integration test: emitted config + parts -> deepspeed.initialize -> train.

Run as ``python _deepspeed_worker.py {pipe|dp} OUT_DIR`` with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT and DS_ACCELERATOR=cpu in the environment;
writes ``OUT_DIR/rank{r}.json`` with the losses and this rank's parameters.
The model and data helpers are shared with the single-process reference.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

WIDTH = 8
NUM_LAYERS = 6
STEPS = 3
LR = 0.5
CLIP = 0.2


def build_layers():
    """Six small Linear+Tanh blocks, identical on every rank (fixed seed)."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x):
            return torch.tanh(self.linear(x))

    torch.manual_seed(0)
    return [Block() for _ in range(NUM_LAYERS)]


def batch(num: int = 4):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(num, WIDTH, generator=g), torch.randn(num, WIDTH, generator=g) * 0.5


def pipe_plan(zero_stage: int = 0):
    """1 pipeline of 2 stages, uneven boundaries [0, 4, 6]; 4 samples as 2 micro-batches of 2."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1"), model={"name": "mlp6", "num_layers": NUM_LAYERS},
                global_batch_size=4, dtype="fp32", mode="manual", zero_stage=zero_stage,
                pipelines=(Pipeline((Stage(("cpu0",), (0, 4)), Stage(("cpu1",), (4, 6))), micro_batch_size=2,
                                    samples=4),))


def dp_plan(zero_stage: int = 0):
    """Uneven pure data parallelism: rank 0 takes 3 samples (micro-batches 2 + 1), rank 1 takes 1."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1"), model={"name": "mlp6", "num_layers": NUM_LAYERS},
                global_batch_size=4, dtype="fp32", mode="manual", zero_stage=zero_stage,
                pipelines=(Pipeline((Stage(("cpu0",), (0, NUM_LAYERS)),), micro_batch_size=2, samples=3),
                           Pipeline((Stage(("cpu1",), (0, NUM_LAYERS)),), micro_batch_size=1, samples=1)))


def _no_shm_op() -> None:
    """Keep DeepSpeed's CPU shared-memory allreduce op from being JIT-compiled (~1 min).

    ``deepspeed.comm.torch.build_shm_op`` builds it only when
    ``deepspeed.ops.__compatible_ops__`` marks ``deepspeed_shm_comm`` usable;
    that dict is the only place DeepSpeed reads it, and filling it ourselves
    also skips the probe of every other op.  Collectives then go to gloo.
    """
    import deepspeed.ops

    compat = deepspeed.ops.__dict__.get("__compatible_ops__")
    if compat is None:
        compat = {}
        deepspeed.ops.__compatible_ops__ = compat
    compat["deepspeed_shm_comm"] = False


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    zero_stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    rank = int(os.environ["RANK"])
    import torch
    import deepspeed

    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.ds_runtime.ds_config import deepspeed_config, hetero_pipeline_module, pipeline_parts, rank_batches

    _no_shm_op()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    x, y = batch()
    result: dict = {"rank": rank, "losses": []}

    if mode == "pipe":
        plan = pipe_plan(zero_stage)
        cfg = deepspeed_config(plan, TrainSettings(global_batch_size=4, dtype="fp32", zero_stage=zero_stage), rank=rank,
                               gradient_clipping=CLIP)
        if zero_stage:
            cfg["zero_allow_untested_optimizer"] = True  # the user's optimizer choice (torch SGD), not the plan's
        parts = pipeline_parts(plan)
        module = hetero_pipeline_module(build_layers(), parts, loss_fn=torch.nn.functional.mse_loss)
        optimizer = torch.optim.SGD([p for p in module.parameters()], lr=LR)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=cfg)
        mbs = cfg["train_micro_batch_size_per_gpu"]
        for _ in range(STEPS):
            micro = iter([(x[i:i + mbs], y[i:i + mbs]) for i in range(0, 4, mbs)])
            result["losses"].append(float(engine.train_batch(data_iter=micro)))
        result["parts"] = list(module.parts)
        result["local_layers"] = sorted(int(name) for name, _ in module.named_children() if name.isdigit())
        result["config"] = cfg
    else:
        plan = dp_plan(zero_stage)
        cfg = deepspeed_config(plan, TrainSettings(global_batch_size=4, dtype="fp32", zero_stage=zero_stage), rank=rank,
                               gradient_clipping=CLIP)
        if zero_stage:
            cfg["zero_allow_untested_optimizer"] = True
        rb = rank_batches(plan)[rank]
        model = torch.nn.Sequential(*build_layers())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
        start = sum(p.samples for p in plan.pipelines[:rank])
        for _ in range(STEPS):
            k = start
            for m, w in zip(rb.micro_batch_sizes, rb.micro_loss_weights):
                loss = torch.nn.functional.mse_loss(engine(x[k:k + m]), y[k:k + m]) * w
                engine.backward(loss)
                engine.step()
                k += m
        result["config"] = cfg
        result["gas"] = engine.gradient_accumulation_steps()
        result["global_steps"] = engine.global_steps
    result["params"] = {n: p.detach().flatten().tolist() for n, p in engine.module.named_parameters()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
