"""One rank of the PlanRunner test: ``python _ds_engine_worker.py {pipe|dp|asym} OUT_DIR [ZERO [CLIP [DTYPE [INF]]]]``.

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


def dtype_of(mode: str):
    """The asymmetric runtime reduces in the model's dtype, so it is checked in float64; DeepSpeed's CPU
    allreduce (the aligned grid's) has no float64."""
    import torch

    return torch.float64 if mode == "asym" else torch.float32


def layers(mode: str):
    return [layer.to(dtype_of(mode)) for layer in build_layers()]


def batch(mode: str = "pipe"):
    import torch

    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float32)
    y = torch.randn(BATCH, WIDTH, generator=g, dtype=torch.float32) * 0.5
    return x.to(dtype_of(mode)), y.to(dtype_of(mode))


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


def asym_plan(zero_stage: int = 0):
    """3 replicas of different shapes on 4 ranks (plan order): rank 0 holds all 6 layers (3 samples as 2+1);
    ranks 1 -> 2 are a pipeline split at [0, 2, 6] (4 samples as 2+2); rank 3 holds all 6 (1 sample).
    Layers 0-1 are reduced over ranks (0, 1, 3), layers 2-5 over (0, 2, 3)."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1", "cpu2", "cpu3"),
                model={"name": "mlp6", "num_layers": NUM_LAYERS}, global_batch_size=BATCH, dtype="fp32",
                mode="manual", zero_stage=zero_stage,
                pipelines=(Pipeline((Stage(("cpu0",), (0, NUM_LAYERS)),), micro_batch_size=2, samples=3),
                           Pipeline((Stage(("cpu1",), (0, 2)), Stage(("cpu2",), (2, NUM_LAYERS))),
                                    micro_batch_size=2, samples=4),
                           Pipeline((Stage(("cpu3",), (0, NUM_LAYERS)),), micro_batch_size=1, samples=1)))


def dp_plan(zero_stage: int = 0):
    """Pure DP on 2 ranks: rank 0 takes 5 samples as 2+2+1, rank 1 takes 3 as one micro-batch."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1"), model={"name": "mlp6", "num_layers": NUM_LAYERS},
                global_batch_size=BATCH, dtype="fp32", mode="manual", zero_stage=zero_stage,
                pipelines=(Pipeline((Stage(("cpu0",), (0, NUM_LAYERS)),), micro_batch_size=2, samples=5),
                           Pipeline((Stage(("cpu1",), (0, NUM_LAYERS)),), micro_batch_size=3, samples=3)))


PER_DEVICE_DTYPES = ("bf16", "fp16")
"""A ``per_device`` run's dtypes: even plan devices compute in bf16, odd ones in fp16."""


def inject_inf(runner, rank: int) -> None:
    """Make ``rank``'s first backward put an inf into one of its gradients (a hook on its first parameter)."""
    import torch

    if runner.rank != rank:
        return
    param = next(q for q in runner.engine.module.parameters() if q.requires_grad)
    fired = []

    def poison(grad):
        if fired:
            return grad
        fired.append(True)
        return torch.full_like(grad, float("inf"))

    param.register_hook(poison)


def main() -> None:
    """argv: mode out_dir [zero_stage [clip [dtype [inf_rank]]]]; dtype fp32 | bf16 | fp16 | per_device (layers
    stay fp32 and DeepSpeed runs them in the plan's dtype; per_device: ``PER_DEVICE_DTYPES``); inf_rank: that rank's first backward yields an inf gradient."""
    import dataclasses

    mode, out_dir = sys.argv[1], sys.argv[2]
    zero_stage = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    clip = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    dtype = sys.argv[5] if len(sys.argv) > 5 else "fp32"
    inf_rank = int(sys.argv[6]) if len(sys.argv) > 6 else None
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner

    plan = {"pipe": pipe_plan, "dp": dp_plan, "asym": asym_plan}[mode](zero_stage)
    if dtype == "per_device":  # bf16 and fp16 ranks, and a pipeline whose two stages differ (asym: cpu1 -> cpu2)
        plan = dataclasses.replace(plan, dtype=dtype, device_dtypes={d: PER_DEVICE_DTYPES[i % 2] for i, d in
                                                                     enumerate(plan.cluster_devices)})
    elif dtype != "fp32":
        plan = dataclasses.replace(plan, dtype=dtype)
    # ZeRO 3: shard every parameter (the default keeps small ones whole, which these are)
    overrides = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}} if zero_stage == 3 else None
    model = layers(mode) if dtype == "fp32" else [layer.float() for layer in build_layers()]
    runner = PlanRunner(plan, model, torch.nn.functional.mse_loss, optimizer, gradient_clipping=clip,
                        timeout_s=60, ds_config_overrides=overrides)
    if inf_rank is not None:
        inject_inf(runner, inf_rank)
    x, y = batch(mode) if dtype == "fp32" else (t.float() for t in batch("pipe"))
    result: dict = {"rank": runner.rank, "losses": [runner.train_step(x, y) for _ in range(STEPS)]}
    result["skipped_steps"] = int(runner.engine.skipped_steps)
    result["eval_loss"] = runner.eval_step(x, y)
    result["micro_batch_sizes"] = list(runner.batch.micro_batch_sizes)
    result["gas"] = runner.engine.gradient_accumulation_steps()
    result["global_steps"] = runner.engine.global_steps
    result["sharded"] = any(getattr(q, "ds_tensor", None) is not None and q.ds_tensor.numel() < q.ds_numel
                            for q in runner.engine.module.parameters())
    result["params"] = {n: p.double().flatten().tolist() for n, p in runner.named_parameters().items()}
    result["param_numel"] = sum(q.numel() for q in runner.engine.module.parameters())
    result["state_numel"] = sum(v.numel() for st in runner.engine.optimizer.state.values() for v in st.values()
                                if torch.is_tensor(v) and v.dim() > 0)
    result["master_numel"] = (sum(c.numel() for c in runner.sharding.chunks) if runner.sharding is not None
                              else None)
    if runner.sharding is not None and runner.sharding.scaler is not None:
        # fp16 at ZeRO 1: a checkpoint round trip brings back the fp32 master chunks and the loss scaler's state
        sharding = runner.sharding
        masters = [c.clone() for c in sharding.chunks]
        sharding.scaler.cur_scale, sharding.scaler.cur_hysteresis = 1234.0, 1
        runner.save_checkpoint(os.path.join(out_dir, "ckpt"), "t", {})
        with torch.no_grad():
            for c in sharding.chunks:
                c.zero_()
        sharding.scaler.cur_scale, sharding.scaler.cur_hysteresis = 1.0, 2
        runner.load_checkpoint(os.path.join(out_dir, "ckpt"), "t")
        result["restored"] = {"scale": sharding.scaler.cur_scale, "hysteresis": sharding.scaler.cur_hysteresis,
                              "masters": all(torch.equal(a, b) for a, b in zip(masters, sharding.chunks))}
    result["param_dtype"] = str(next(runner.engine.module.parameters()).dtype)
    if dtype == "per_device":  # the fp32 master weights of this rank's parameters, whole (a collective)
        names = {id(q): n for n, q in runner.engine.module.named_parameters()}
        result["masters"] = {names[i]: v.double().flatten().tolist()
                             for i, v in runner.sharding.full_values().items()}
        result["rank_params"] = {n: q.double().flatten().tolist() for n, q in runner.engine.module.named_parameters()}
    with open(os.path.join(out_dir, f"rank{runner.rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
