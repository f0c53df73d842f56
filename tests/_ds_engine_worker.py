"""One rank of the PlanRunner test: ``python _ds_engine_worker.py {pipe|dp} OUT_DIR [ZERO_STAGE [CLIP]]``.

RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and DS_ACCELERATOR=cpu
come from the environment.  Trains ``STEPS`` steps through
``het_strategy.ds_runtime.engine.PlanRunner`` on the whole global batch and
writes ``OUT_DIR/rank{r}.json`` (losses, a final eval loss, this rank's
parameters).  Model, data, plans and optimizer are shared with the
single-process reference in ``test_ds_engine.py``.
"""

from __future__ import annotations

import json
import os
import sys

from _deepspeed_worker import NUM_LAYERS, WIDTH, build_layers  # noqa: F401  (the same six blocks, seed 0)

STEPS = 3
LR = 0.2
MOMENTUM = 0.9
BATCH = 8


def batch():
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float32)
    return x, torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float32) * 0.5


def optimizer(params):
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def pipe_plan(zero_stage: int = 0):
    """2 pipelines x 2 stages at [0, 4, 6]; pipeline 0: 5 samples as 2+2+1, pipeline 1: 3 samples as 2+1."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    def pipe(devs, micro, samples):
        return Pipeline((Stage((devs[0],), (0, 4)), Stage((devs[1],), (4, NUM_LAYERS))), micro_batch_size=micro,
                        samples=samples)

    # rank = stage * dp + pipeline: ranks 0, 2 run pipeline 0; ranks 1, 3 run pipeline 1
    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1", "cpu2", "cpu3"),
                model={"name": "mlp6", "num_layers": NUM_LAYERS}, global_batch_size=BATCH, dtype="fp32",
                mode="manual", zero_stage=zero_stage,
                pipelines=(pipe(("cpu0", "cpu2"), 2, 5), pipe(("cpu1", "cpu3"), 2, 3)))


def dp_plan(zero_stage: int = 0):
    """Pure DP on 2 ranks: rank 0 takes 5 samples as 2+2+1, rank 1 takes 3 as one micro-batch."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1"), model={"name": "mlp6", "num_layers": NUM_LAYERS},
                global_batch_size=BATCH, dtype="fp32", mode="manual", zero_stage=zero_stage,
                pipelines=(Pipeline((Stage(("cpu0",), (0, NUM_LAYERS)),), micro_batch_size=2, samples=5),
                           Pipeline((Stage(("cpu1",), (0, NUM_LAYERS)),), micro_batch_size=3, samples=3)))


def main() -> None:
    mode, out_dir = sys.argv[1], sys.argv[2]
    zero_stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    clip = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner

    plan = pipe_plan(zero_stage) if mode == "pipe" else dp_plan(zero_stage)
    runner = PlanRunner(plan, build_layers(), torch.nn.functional.mse_loss, optimizer, gradient_clipping=clip,
                        timeout_s=60)
    x, y = batch()
    result: dict = {"rank": runner.rank, "losses": [runner.train_step(x, y) for _ in range(STEPS)]}
    result["eval_loss"] = runner.eval_step(x, y)
    result["micro_batch_sizes"] = list(runner.batch.micro_batch_sizes)
    result["gas"] = runner.engine.gradient_accumulation_steps()
    result["global_steps"] = runner.engine.global_steps
    result["params"] = {n: p.flatten().tolist() for n, p in runner.named_parameters().items()}
    with open(os.path.join(out_dir, f"rank{runner.rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
