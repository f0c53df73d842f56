"""How much the ``hetero_deepspeed`` runtime's rules cost: the runnable best against the unconstrained best.

For every shipped cluster and each training dtype (fp32, bf16, fp16 and per_device at ZeRO 0: tensor-parallel stages
run there, fp16 at ZeRO 0 runs per replica, where the runtime scales the loss, and per_device per replica over the
runtime's own fp32 masters; each at ZeRO 1 too: per-replica plans shard the optimizer state, and the 16-bit dtypes'
fp32 masters, within their holder sets), ``planning.plan`` with
``PlanRequest(runtime="deepspeed")`` plans the best plan the runtime runs and reports its predicted slowdown
against the best plan of any runtime (the cost model's figures; ``settings.max_tp`` at its default, 8).  0.0%: the
runtime runs the winning plan.
Last line: ``RESULT max_slowdown_fp32=... max_slowdown_bf16=... max_slowdown_fp16=... max_slowdown_per_device=...
max_slowdown_fp32_zero1=... max_slowdown_bf16_zero1=... max_slowdown_fp16_zero1=... max_slowdown_per_device_zero1=...
clusters=N``.
"""

from __future__ import annotations

import argparse

from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.core.shipped import shipped_names
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.planning import PlanRequest, plan

DTYPES = (("fp32", 0), ("bf16", 0), ("fp16", 0), ("per_device", 0), ("fp32", 1), ("bf16", 1), ("fp16", 1),
          ("per_device", 1))
"""(dtype, ZeRO stage) of each column."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_small", help="shipped model name")
    ap.add_argument("--batch", type=int, default=64, help="global batch size")
    args = ap.parse_args()
    worst = {column: 0.0 for column in DTYPES}
    names = shipped_names("cluster")
    print(f"model {args.model}, global batch {args.batch}; predicted slowdown of the best plan hetero_deepspeed "
          "runs against the unconstrained best")
    print(f"{'cluster':<26}" + "".join(f"{f'{d} (ZeRO {z})':>21}" for d, z in DTYPES))
    for name in names:
        cluster = load_cluster(name)
        cells = []
        for dtype, zero in DTYPES:
            settings = TrainSettings(global_batch_size=args.batch, dtype=dtype, zero_stage=zero)
            try:
                result = plan(cluster, load_workload(args.model, dtype=dtype), settings, PlanRequest(runtime="deepspeed"))
            except ConfigError as exc:
                cells.append("no plan")
                print(f"  {name} {dtype} ZeRO {zero}: {exc}")
                worst[(dtype, zero)] = float("inf")
                continue
            slowdown = result.runtime_slowdown or 0.0
            worst[(dtype, zero)] = max(worst[(dtype, zero)], slowdown)
            cells.append(f"{slowdown * 100:.1f}%")
        print(f"{name:<26}" + "".join(f"{c:>21}" for c in cells), flush=True)
    print("RESULT " + " ".join(f"max_slowdown_{d}{'_zero1' if z else ''}={worst[(d, z)] * 100:.1f}%" for d, z in DTYPES)
          + f" clusters={len(names)}")


if __name__ == "__main__":
    main()
