"""One rank of the re-sharding test: ``python _reshard_worker.py PHASE OUT_DIR PLAN CKPT [DTYPE [ZERO]]`` (DTYPE
fp32, bf16, fp16 or per_device: ``_ds_engine_worker.PER_DEVICE_DTYPES``).

PHASE ``save``: train ``STEPS`` steps of PLAN (``pipe``, ``asym`` or ``dp`` of ``_ds_engine_worker``) with Adam
and write a checkpoint to CKPT the way ``hetero_deepspeed`` does (``save_plan_checkpoint``).  PHASE ``load``:
build PLAN (another plan, maybe another world size), load CKPT into it (``load_plan_checkpoint``), then train
``STEPS`` more steps.  Each rank writes ``OUT_DIR/rank{r}.json``: its losses, its parameters, and (load) the
client state it got back and its engine's step counter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import _ds_engine_worker as base

STEPS = 2
LR = 0.01


def adam(params):
    import torch

    return torch.optim.Adam(params, lr=LR)


def main() -> None:
    phase, out_dir, plan_name, ckpt = sys.argv[1:5]
    dtype = sys.argv[5] if len(sys.argv) > 5 else "fp32"
    zero = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    import torch

    from het_strategy.ds_runtime.engine import PlanRunner
    from het_strategy.strategy.deepspeed_checkpoint import load_plan_checkpoint, save_plan_checkpoint

    plan = {"pipe": base.pipe_plan, "dp": base.dp_plan, "asym": base.asym_plan}[plan_name](zero)
    # per_device: bf16 and fp16 ranks, as _ds_engine_worker runs them
    dtypes = ({d: base.PER_DEVICE_DTYPES[i % 2] for i, d in enumerate(plan.cluster_devices)}
              if dtype == "per_device" else {})
    plan = dataclasses.replace(plan, dtype=dtype, device_dtypes=dtypes)
    layers = [layer.float() for layer in base.build_layers()]
    runner = PlanRunner(plan, layers, torch.nn.functional.mse_loss, adam, timeout_s=60)
    x, y = (t.float() for t in base.batch("pipe"))
    result: dict = {"rank": runner.rank}
    if phase == "load":
        client = load_plan_checkpoint(runner, plan, ckpt)
        result["client"] = {k: v for k, v in client.items() if isinstance(v, (int, float, str))}
        result["global_steps_loaded"] = int(runner.engine.global_steps)
        if dtype == "bf16" or runner.sharding is not None:  # the fp32 master weights the optimizer steps on
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            named = list(runner.engine.module.named_parameters())
            if runner.sharding is not None:  # ZeRO 1 within the holder sets: gathered from them (collectives)
                values, states = runner.sharding.full_values(), runner.sharding.full_state()
                masters = {n: values[id(q)] for n, q in named}
                moments = {n: states[id(q)]["exp_avg_sq"] for n, q in named}
            else:
                masters = {n: safe_get_full_fp32_param(q) for n, q in named}
                moments = {n: safe_get_full_optimizer_state(q, "exp_avg_sq") for n, q in named}
            result["masters"] = {n: v.double().flatten().tolist() for n, v in masters.items()}
            result["moments"] = {n: v.double().flatten().tolist() for n, v in moments.items()}
            result["loss_scale"] = runner.sharding.scaler_state() if runner.sharding is not None else None
    elif runner.sharding is not None and runner.sharding.scaler is not None:
        runner.sharding.scaler.cur_scale = 1024.0  # fp16: a scale the load must bring back (not the first one)
    result["losses"] = [runner.train_step(x, y) for _ in range(STEPS)]
    if phase == "save":
        save_plan_checkpoint(runner, plan, {"epoch": 0, "global_step": STEPS, "marker": "saved"}, ckpt)
    result["params"] = {n: p.double().flatten().tolist() for n, p in runner.named_parameters().items()}
    with open(os.path.join(out_dir, f"rank{runner.rank}.json"), "w") as fh:
        json.dump(result, fh)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
