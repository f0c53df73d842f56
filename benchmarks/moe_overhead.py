"""The cost of ``HeteroMoE`` where there is nothing uneven: ours vs DeepSpeed's ``deepspeed.moe.layer.MoE``.

Both layers in the same small model, on the same 4 gloo ranks forked on this
machine (one thread each, no emulation, every rank at full speed):
``Linear -> GELU -> [x + MoE(x)] x --layers -> Linear head``, MSE loss plus
0.01 x the MoE auxiliary loss, forward + backward + an Adam step.  Each MoE
layer has 12 experts (``hidden -> 4 hidden -> hidden`` FFNs), 3 per rank
(DeepSpeed: ``ep_size`` = world size; ours: the uniform placement, i.e.
rank r holds experts 3r .. 3r+2 in both), top-2, ``capacity_factor=1.0``,
``min_capacity=4``, ``drop_tokens=True`` in both.  DeepSpeed is run with
``use_rts=False`` and ``top2_2nd_expert_sampling=False`` so that its routing
is the same deterministic positional top-2 as ours; the two models start
from the same weights (our gate and experts copied into DeepSpeed's) and the
benchmark checks that their first outputs agree.  Both send and compute
every expert's full capacity buffer (``E x C`` rows per rank, zero rows where
a slot is empty: ours in its default ``dispatch="capacity"`` layout); ours
also tells every rank its capacity first (one small all-to-all per layer,
started before the gate), because under uneven data parallelism ranks route
different numbers of tokens, where DeepSpeed assumes equal shapes.
Non-expert parameters are not allreduced across ranks (each rank steps its
own copy) in either variant, so the step time is the MoE layers plus a small
dense trunk.

Timing: both models live on every rank; after a warm-up of each, blocks of
``--block`` steps alternate ours / DeepSpeed in pairs (ABBAABBA...: every
other pair starts with DeepSpeed), ``--blocks`` blocks per variant.  A step's
time is the mean over the ranks of that step's wall time (its CPU time, the
mean of the ranks' ``time.process_time``, is printed too).  Per-step times on
this shared 2-core machine vary 20-30%, so the mean, the median over all
steps and the median of the per-pair ratios are printed.  overhead = median
ours / median DeepSpeed - 1 (negative: ours faster).  If DeepSpeed's layer
cannot be built or run here, the benchmark says why and prints ``RESULT
overhead=unavailable``.

What DeepSpeed needs on this machine: ``DS_ACCELERATOR=cpu`` before it is
imported, ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False``
(else the first collective JIT-builds its shared-memory allreduce op, 1-2
min), ``deepspeed.init_distributed(dist_backend="gloo")`` over the process
group the forked ranks already have, and ``MoE.set_deepspeed_parallelism()``
(normally done by ``deepspeed.initialize``) to create its ``ep_size_4``
groups; no engine is needed.

Run: ``.venv/bin/python benchmarks/moe_overhead.py`` (about 1.5-2 minutes; see
``--help``).  Last line: ``RESULT overhead=... ours_ms=... deepspeed_ms=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import time
import traceback
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (here or by a forked rank)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from het_strategy.emulation.local_ranks import run_local_ranks  # noqa: E402
from het_strategy.moe import HeteroMoE  # noqa: E402

AUX_WEIGHT = 0.01


def _import_deepspeed() -> str | None:
    """Import DeepSpeed for the CPU (in the parent, so the forked ranks share it); an error text, or None."""
    try:
        import deepspeed
        import deepspeed.ops
        from deepspeed.moe.layer import MoE  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        return f"import deepspeed failed: {type(exc).__name__}: {exc}"
    # Keep DeepSpeed's CPU shared-memory allreduce op from being JIT-compiled (1-2 min); collectives use gloo.
    compat = deepspeed.ops.__dict__.get("__compatible_ops__")
    if compat is None:
        compat = deepspeed.ops.__compatible_ops__ = {}
    compat["deepspeed_shm_comm"] = False
    return None


def _expert(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


class _Net(nn.Module):
    """``Linear -> GELU -> [x + MoE(x)] x L -> Linear``; returns (prediction, summed aux loss)."""

    def __init__(self, hidden: int, moes: list[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, hidden)
        self.moes = nn.ModuleList(moes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.gelu(self.inp(x))
        aux = h.new_zeros(())
        for moe in self.moes:
            out, layer_aux, _ = moe(h)
            h = h + out
            aux = aux + layer_aux
        return self.head(h), aux


def _build(rank: int, world: int, args: argparse.Namespace) -> tuple[_Net, _Net]:
    from deepspeed.moe.layer import MoE

    ours_layers, ds_layers = [], []
    for layer in range(args.layers):
        torch.manual_seed(10 + layer)  # the gate
        ours = HeteroMoE(args.hidden, lambda: _expert(args.hidden), num_experts=args.experts, k=2,
                         capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True,
                         expert_seed=1000 * (layer + 1))
        ds = MoE(args.hidden, _expert(args.hidden), num_experts=args.experts, ep_size=world, k=2,
                 capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True, use_rts=False,
                 top2_2nd_expert_sampling=False)
        with contextlib.redirect_stdout(io.StringIO()):  # "No existing process group found, creating ..."
            ds.set_deepspeed_parallelism()
        local = ours.local_experts
        assert local == list(range(rank * len(local), (rank + 1) * len(local))), local  # DeepSpeed's layout
        with torch.no_grad():
            ds.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
            for mine, theirs in zip(local, ds.deepspeed_moe.experts.deepspeed_experts):
                theirs.load_state_dict(ours.experts[str(mine)].state_dict())
        ours_layers.append(ours)
        ds_layers.append(ds)
    ours_net, ds_net = _Net(args.hidden, ours_layers), _Net(args.hidden, ds_layers)
    ds_net.inp.load_state_dict(ours_net.inp.state_dict())
    ds_net.head.load_state_dict(ours_net.head.state_dict())
    return ours_net, ds_net


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from datetime import timedelta

    import deepspeed

    try:
        # torch.distributed is already up (gloo); DeepSpeed's comm wraps that process group.
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False,
                                   timeout=timedelta(seconds=120))
        ours, ds = _build(rank, world, args)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(args.tokens, args.hidden, generator=g)
        y = torch.randn(args.tokens, args.hidden, generator=g)
        with torch.no_grad():
            out_ours, aux_ours = ours(x)
            out_ds, aux_ds = ds(x)
        failure = None
    except Exception:  # noqa: BLE001 - the reason DeepSpeed's layer cannot run here, reported by the caller
        failure = traceback.format_exc()
    failed = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(failed)  # every rank stops if one failed (instead of waiting in a collective)
    if int(failed):
        return {"error": failure or "(failed on another rank)"}
    check = {"out_diff": float((out_ours - out_ds).abs().max()), "aux_diff": float((aux_ours - aux_ds).abs()),
             "out_scale": float(out_ours.abs().max())}
    variants = {"ours": ours, "deepspeed": ds}
    optims = {name: torch.optim.Adam(net.parameters(), lr=1e-3) for name, net in variants.items()}

    def step(name: str) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        pred, aux = variants[name](x)
        loss = F.mse_loss(pred, y) + AUX_WEIGHT * aux
        optims[name].zero_grad(set_to_none=True)
        loss.backward()
        optims[name].step()
        return time.perf_counter() - wall, time.process_time() - cpu

    for name in variants:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for b in range(2 * args.blocks):
        pair = ("ours", "deepspeed") if (b // 2) % 2 == 0 else ("deepspeed", "ours")
        name = pair[b % 2]
        dist.barrier()
        for wall, used in [step(name) for _ in range(args.block)]:
            times[name].append(wall)
            cpu[name].append(used)
    return {"check": check, "times": times, "cpu": cpu, "version": deepspeed.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--experts", type=int, default=12)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    ap.add_argument("--warmup", type=int, default=10, help="steps of each variant before timing")
    ap.add_argument("--block", type=int, default=5, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=60, help="timed blocks per variant")
    args = ap.parse_args()
    print(f"{args.world} gloo ranks x 1 thread, {args.layers} MoE layer(s): hidden {args.hidden}, {args.experts} "
          f"experts ({args.experts // args.world} per rank), top-2, capacity_factor 1.0, drop_tokens=True, "
          f"{args.tokens} tokens per rank; {args.blocks} blocks x {args.block} steps per variant after "
          f"{args.warmup} warm-up steps", flush=True)
    error = _import_deepspeed()
    results = None
    if error is None:
        started = time.perf_counter()
        results = run_local_ranks(_rank, args.world, args, timeout_s=600.0)
        print(f"  ranks finished in {time.perf_counter() - started:.1f} s")
        errors = sorted((r["error"] for r in results if "error" in r), key=lambda e: e.startswith("(failed"))
        if errors:
            error = "DeepSpeed's MoE layer could not be built or run on CPU/gloo (rank traceback below):\n" + errors[0]
    if error is not None:
        print(error)
        print("RESULT overhead=unavailable ours_ms=nan deepspeed_ms=nan")
        return
    assert results is not None
    diff = max(r["check"]["out_diff"] for r in results)
    scale = max(r["check"]["out_scale"] for r in results)
    aux_diff = max(r["check"]["aux_diff"] for r in results)
    print(f"  same weights, first forward: max |ours - deepspeed| = {diff:.2e} (output scale {scale:.2e}), "
          f"aux loss diff {aux_diff:.2e}")
    print(f"  deepspeed {results[0]['version']}, torch {torch.__version__}")
    stats, per_block = {}, {}
    for name in ("ours", "deepspeed"):
        per_step = [statistics.fmean(s) for s in zip(*(r["times"][name] for r in results))]  # mean over ranks
        cpu = [statistics.fmean(s) for s in zip(*(r["cpu"][name] for r in results))]
        per_block[name] = [statistics.fmean(per_step[i:i + args.block]) for i in range(0, len(per_step), args.block)]
        stats[name] = (statistics.fmean(per_step), statistics.median(per_step), statistics.median(cpu))
        print(f"  {name:>9}: {len(per_step)} steps, wall mean {1e3 * stats[name][0]:.2f} ms/step, median "
              f"{1e3 * stats[name][1]:.2f} ms/step; cpu median {1e3 * stats[name][2]:.2f} ms/step per rank")
    pairs = [o / d for o, d in zip(per_block["ours"], per_block["deepspeed"])]
    mean_ratio = stats["ours"][0] / stats["deepspeed"][0]
    median_ratio = stats["ours"][1] / stats["deepspeed"][1]
    print(f"  ours / deepspeed: wall mean {mean_ratio:.4f}, median {median_ratio:.4f}, median of {len(pairs)} "
          f"block pairs {statistics.median(pairs):.4f} (pairs {min(pairs):.3f} .. {max(pairs):.3f}); cpu median "
          f"{stats['ours'][2] / stats['deepspeed'][2]:.4f}")
    print(f"RESULT overhead={median_ratio - 1:.4f} ours_ms={1e3 * stats['ours'][1]:.3f} "
          f"deepspeed_ms={1e3 * stats['deepspeed'][1]:.3f}")


if __name__ == "__main__":
    main()
