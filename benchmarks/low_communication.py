"""Training across a 10 Mbit/s link: heterogeneity-aware DiLoCo vs DDP, the best synchronous compressed plan, and
DiLoCo with an even split, measured on two emulated nodes.

The cluster (``emulation/node_network.py``: a network namespace per node, ``--rate-mbit`` each way between them,
loopback within): node ``fast`` holds two devices of speed 1, node ``slow`` two of speed ``--slow-speed`` (CPU
processes whose compute the strategies pad to the emulated device's time, so emulated time, not four processes
on two cores, sets the pace).  The model is the main job's char GPT (``configs/model/tiny_gpt.yaml``: 0.87 M
parameters, 3.5 MB in fp32).  Every run trains the same number of steps of the same global batch (so the same
samples), from the same initial weights, ranks launched into their node's namespace:

- ``ddp`` — uncompressed DDP: the global batch split evenly, gradients all-reduced in fp32 every step
  (``HeteroStrategy`` with an equal-split plan, no compression);
- ``sync`` — the best synchronous plan with compression: the joint planner's placement and inter-node codec
  (``planning/joint.py``), run with ``compression="planned"`` (node sum, the codec between node leaders);
- ``diloco_even`` — DiLoCo with equal inner steps and an even split: every device the same samples per inner
  step, so the fast node waits for the slow one at every outer step (``HeteroDiLoCoStrategy``, ``split=even``);
- ``diloco`` — heterogeneity-aware DiLoCo: H, the codec and the split planned
  (``planning/low_communication.py``); the fast node takes more samples per inner step.

Both DiLoCo runs use the H and codec planned for ``diloco``; the step count is rounded up to a multiple of H.
The outer optimizer is plain averaging (SGD, lr 1, no momentum: ``--outer-lr``, ``--outer-momentum``): a run
this short has five outer steps, too few for DiLoCo's Nesterov momentum (0.7 / 0.9, the strategy's default) to
build on; measured with it, the loss is 8.7% above DDP's.  The DiLoCo pair runs ``--seeds`` seeds (each seed
its own initial weights and data order, the same for both); ``ddp`` and ``sync`` run seed 0 (DDP alone takes
11 minutes).  Reported per run: the training wall time (rank 0, from the first step to the last), the bytes
that crossed the inter-node link (both directions, headers, the rendezvous and the initial broadcast
included), and the validation loss of the final model (the outer parameters for DiLoCo) on held-out text.
Losses are compared between runs of one seed: from seed to seed the loss moves by up to 9% this early.
What this cannot show: emulated compute checks the schedule and the link, not a GPU's speed; the run is
short (the loss compared is early in training).

Last line: ``RESULT vs_ddp=<ddp wall / diloco wall> vs_sync_compressed=<sync / diloco> vs_equal_h=<diloco_even /
diloco> loss_gap=<(diloco - ddp) / ddp validation loss, seed 0> bytes_ratio=<ddp bytes / diloco bytes>
loss_gap_vs_equal_h=<mean over seeds of (diloco - diloco_even) / diloco_even> ...`` (DiLoCo walls: means over
the seeds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emulated_nodes import add_link_options, require_netns, run_on_nodes  # noqa: E402
from joint_planning import _workload, cluster_dict  # noqa: E402

LABELS = ("ddp", "sync", "diloco_even", "diloco")


def _plans(cluster: Any, workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Each run's plan: the equal split, the joint plan, and the two low-communication plans."""
    from het_strategy.core.cost_model import CostModel
    from het_strategy.planning import PlanRequest, plan
    from het_strategy.planning.dp_split import equal_split_plan
    from het_strategy.planning.low_communication import OuterSyncBudget, plan_low_communication
    from het_strategy.planning.strategy_plans import data_parallel_settings

    settings = data_parallel_settings(args.batch, "fp32")
    sync = plan(cluster, workload, settings, PlanRequest(compression="joint", mode="dp")).joint.plan
    budget = OuterSyncBudget(max_inner_steps=args.max_inner_steps, max_sync_overhead=args.max_sync_overhead)
    hetero = plan_low_communication(cluster, workload, settings, budget).plan
    sync_h = hetero.outer_sync
    even = plan_low_communication(cluster, workload, settings, OuterSyncBudget(
        max_inner_steps=args.max_inner_steps, max_sync_overhead=args.max_sync_overhead, split="even"),
        inner_steps=sync_h.inner_steps, codec=str(sync_h.codec)).plan
    cm = CostModel(cluster, workload, settings)
    ddp = equal_split_plan(cm)
    ddp.predicted = {**ddp.predicted, "step_time_s": cm.score(ddp).step_time_s}
    return {"ddp": ddp, "sync": sync, "diloco_even": even, "diloco": hetero}


def _worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from het_strategy import HeteroDiLoCoStrategy, HeteroStrategy
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.plan import Plan
    from het_strategy.demo.moe_gpt import build_char_model
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus

    torch.set_num_threads(1)
    pl.seed_everything(args.seed, verbose=False)
    cfg, workload = _workload()
    cluster = load_cluster(args.cluster)
    plan = Plan.load(args.plan)
    world = cluster.num_devices
    corpus = stdlib_corpus(max_bytes=400_000, val_fraction=0.1, seed=0)
    model = build_char_model(cfg, None, lr=args.lr, weight_decay=0.0)
    if plan.outer_sync is not None:
        strategy: Any = HeteroDiLoCoStrategy(cluster=cluster, workload=workload, plan=plan, verbose=False,
                                             outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    else:
        strategy = HeteroStrategy(cluster=cluster, workload=workload, global_batch_size=args.batch, plan=plan,
                                  compression=args.compression, verbose=False)

    class Wall(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            self.start = time.perf_counter()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.wall_s = time.perf_counter() - self.start

    wall = Wall()
    trainer = pl.Trainer(accelerator="cpu", devices=world // len(cluster.nodes), num_nodes=len(cluster.nodes),
                         strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[wall])
    trainer.fit(model, DataLoader(CharDataset(corpus.train, cfg.seq_len), batch_size=max(1, args.batch // world),
                                  shuffle=True))
    if trainer.global_rank != 0:
        return
    val = CharDataset(corpus.val, cfg.seq_len)
    loader = DataLoader(val, batch_size=32, shuffle=False)
    model.eval()
    losses = []
    with torch.no_grad():
        for i, batch in enumerate(loader):
            if i == args.val_batches:
                break
            losses.append(float(model._loss(batch)))
    outer = getattr(getattr(strategy, "run", None), "extension", None)
    outer = getattr(outer, "outer", None)
    Path(args.out).write_text(json.dumps({
        "wall_s": wall.wall_s, "steps": args.steps, "val_loss": sum(losses) / len(losses),
        "rounds": None if outer is None else outer.rounds}))


def _run(source: dict[str, Any], plan: Any, label: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Train ``plan`` on the two emulated nodes (seed ``args.seed``); rank 0's summary and the bytes that crossed
    the link."""
    return run_on_nodes(__file__, source, plan, tmp / f"{label}_{args.seed}", args.rate_mbit, [
        "--compression", "planned" if label == "sync" else "none", "--steps", str(args.steps), "--batch",
        str(args.batch), "--seed", str(args.seed), "--lr", str(args.lr), "--val-batches", str(args.val_batches),
        "--outer-lr", str(args.outer_lr), "--outer-momentum", str(args.outer_momentum)])


def _plan_text(label: str, plan: Any) -> str:
    p = plan.predicted
    shares = {d: n for d, n in plan.rank_shares().items() if n}
    if plan.outer_sync is not None:
        sync = plan.outer_sync
        how = (f"H {sync.inner_steps}, codec {sync.codec}, predicted {p['inner_step_s'] * 1e3:.0f} ms/inner step, "
               f"{p['exchange_s']:.2f} s/exchange, {p['round_s']:.1f} s/round")
    else:
        how = (f"inter-node {plan.compression.get('inter_node', 'none')}, predicted "
               f"{p['step_time_s'] * 1e3:.0f} ms/step")
    return f"  {label:<12} shares {shares}; {how}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--compression", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=120, help="training steps per run (rounded up to a multiple of H)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences of 128 bytes)")
    ap.add_argument("--lr", type=float, default=1e-3, help="the inner (and DDP) AdamW learning rate")
    add_link_options(ap, rate_mbit=10.0, slow_speed=0.5)
    ap.add_argument("--max-inner-steps", type=int, default=500, help="the planner's largest H")
    ap.add_argument("--max-sync-overhead", type=float, default=0.05, help="the planner's exchange budget")
    ap.add_argument("--outer-lr", type=float, default=1.0, help="the outer SGD's learning rate (the strategy's "
                    "default, DiLoCo's, is 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=0.0, help="its Nesterov momentum (the strategy's "
                    "default, DiLoCo's, is 0.9)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the two DiLoCo runs (ddp and sync: seed 0)")
    ap.add_argument("--first-seed", type=int, default=0, help="the DiLoCo runs' first seed (with --only)")
    ap.add_argument("--val-batches", type=int, default=20, help="held-out batches of 32 sequences")
    ap.add_argument("--only", nargs="*", choices=LABELS, help="run only these (the RESULT line needs all)")
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args)
        return
    from het_strategy.core.cluster import cluster_from_dict

    if args.first_seed and not args.only:
        ap.error("--first-seed goes with --only: the RESULT line compares seed 0's runs with ddp's and sync's")
    require_netns("low_communication")
    source = cluster_dict(args.rate_mbit, args.slow_speed, args.intra_gbs)
    cluster = cluster_from_dict(source)
    _, workload = _workload()
    plans = _plans(cluster, workload, args)
    h = plans["diloco"].outer_sync.inner_steps
    args.steps = math.ceil(args.steps / h) * h
    print(f"cluster: node fast 2 x speed 1, node slow 2 x speed {args.slow_speed:g}, {args.rate_mbit:g} Mbit/s "
          f"between nodes; char GPT ({workload.total_params / 1e6:.2f} M parameters), global batch {args.batch}, "
          f"{args.steps} steps ({args.steps * args.batch} samples) per run", flush=True)
    for label in LABELS:
        print(_plan_text(label, plans[label]), flush=True)
    runs: dict[tuple[str, int], dict[str, Any]] = {}
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    order = [(label, 0) for label in ("ddp", "sync")] + [(label, seed) for seed in seeds
                                                         for label in ("diloco_even", "diloco")]
    with tempfile.TemporaryDirectory(prefix="low_communication_") as tmp:
        for label, seed in order:
            if args.only and label not in args.only:
                continue
            args.seed = seed
            r = runs[label, seed] = _run(source, plans[label], label, args, Path(tmp))
            print(f"  {label:<12} seed {seed}  wall {r['wall_s']:7.1f} s ({r['wall_s'] / args.steps * 1e3:6.0f} "
                  f"ms/step)  {r['crossed_mb']:8.1f} MB over the link  val loss {r['val_loss']:.4f}"
                  + (f"  ({r['rounds']} outer steps)" if r["rounds"] is not None else ""), flush=True)
    paired = [s for s in seeds if ("diloco", s) in runs and ("diloco_even", s) in runs]
    even_gaps = [(runs["diloco", s]["val_loss"] - runs["diloco_even", s]["val_loss"])
                 / runs["diloco_even", s]["val_loss"] for s in paired]
    if len(even_gaps) > 1:
        sd = statistics.stdev(even_gaps)
        print(f"  (diloco - diloco_even) / diloco_even, seeds {seeds[0]}-{seeds[-1]}: "
              + " ".join(f"{g * 100:+.2f}%" for g in even_gaps)
              + f"\n  mean {statistics.mean(even_gaps) * 100:+.2f}%, standard deviation {sd * 100:.2f}%, standard "
              f"error {sd / math.sqrt(len(even_gaps)) * 100:.2f}%; heterogeneity-aware better in "
              f"{sum(g < 0 for g in even_gaps)} of {len(even_gaps)}")
    if args.only:
        return
    d = runs["diloco", 0]
    wall = {label: statistics.mean(runs[label, s]["wall_s"] for s in seeds) for label in ("diloco", "diloco_even")}
    wall.update({label: runs[label, 0]["wall_s"] for label in ("ddp", "sync")})
    vs = {label: wall[label] / wall["diloco"] for label in ("ddp", "sync", "diloco_even")}
    gap = (d["val_loss"] - runs["ddp", 0]["val_loss"]) / runs["ddp", 0]["val_loss"]  # the same seed: init, data
    bytes_ratio = runs["ddp", 0]["crossed_mb"] / d["crossed_mb"]
    predicted_vs_even = plans["diloco_even"].predicted["step_time_s"] / plans["diloco"].predicted["step_time_s"]
    print(f"  diloco vs ddp {vs['ddp']:.1f}x, vs sync compressed {vs['sync']:.2f}x, vs even-split DiLoCo "
          f"{vs['diloco_even']:.2f}x (predicted {predicted_vs_even:.2f}x); val loss {gap * 100:+.2f}% vs ddp (seed 0), "
          f"{statistics.mean(even_gaps) * 100:+.2f}% vs even-split DiLoCo (mean of seeds "
          f"{', '.join(f'{g * 100:+.2f}%' for g in even_gaps)}); {bytes_ratio:.0f}x fewer bytes than ddp")
    print(f"RESULT vs_ddp={vs['ddp']:.2f} vs_sync_compressed={vs['sync']:.2f} vs_equal_h={vs['diloco_even']:.3f} "
          f"loss_gap={gap:.4f} bytes_ratio={bytes_ratio:.1f} loss_gap_vs_equal_h={statistics.mean(even_gaps):.4f} "
          f"loss_gap_vs_equal_h_max={max(even_gaps):.4f} predicted_vs_equal_h={predicted_vs_even:.3f}")

if __name__ == "__main__":
    main()
