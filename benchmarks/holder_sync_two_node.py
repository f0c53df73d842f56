"""The holder-set gradient sync of plans whose replicas differ, measured on two emulated nodes against the cost model,
and the planner's pick (which prices such plans by holder sets) against the best aligned plan, both trained.

What it checks: ``core/holder_sync.py``'s schedule (the sets, their bytes, their shared order, which sets run at once
and how they share the node interfaces) against what ``hetero_deepspeed``'s real ``HolderSetReducer`` does over gloo,
TCP and a ``tc htb``-shaped link; and that the plan ``search_plan`` picks with that pricing trains at least as fast
as the best aligned plan.  What it cannot: compute is emulated (every stage padded to its emulated device's time,
``emulation.stage_padding``: 4 CPU processes on a 2-core machine), so part 2 checks the schedule, not a GPU, and the
links are gloo over veth, not NCCL over NVLink / InfiniBand.

The cluster (``cluster_dict``): node ``A`` holds ``a0``, ``a1`` (speed 1), node ``B`` holds ``b0`` (speed 1) and
``b1`` (speed ``--slow-speed``); every device 30 MB of emulated memory (no device holds the whole model at tp 1),
one link shaped to ``--rate-mbit`` (200) each way between the nodes (``node_network.emulated_nodes``), loopback inside a
node.  The model: the char GPT (``demo/char_gpt.py``: 6 blocks, hidden 128, seq 64, fp32; 4.8 MB of gradients).
The cluster file declares the link as it behaves: its bandwidth the shaped rate's TCP goodput (``TCP_PAYLOAD``:
0.936 of the rate), its latency and the loopback's bandwidth measured at the start of the first run (``_probe``: a
2-rank allreduce of one float across the link, a 2-rank allreduce of 16 MB inside node A; the link's own goodput,
1 MB across it, is printed beside the declared figure as a cross-check).

1. **Sync, measured against predicted.**  Two plans whose replicas differ: ``tp`` (replica 0: ``a0`` [0,k) ->
   ``a1`` [k,L) at tp 1; replica 1: ``b0 + b1`` at tp 2 over every layer: a tp-1 rank holds both units of its
   layers and runs two sets in turn) and ``bounds`` (replica 0 cut at k1, replica 1 at k2 != k1: the sets split
   at both boundaries, each crosses the link).  Each trains ``--steps`` steps after ``--warmup`` on the real
   runtime (``PlanRunner``); the worker wraps the engine's reducer: a barrier over every rank first (so every set
   may start at once, the model's rule: sync after the slowest pipeline), then per rank the wall time at entry and
   exit, and of each set's allreduce.  Measured sync per step = the last rank's exit - the last rank's entry; the
   figure is the mean over the steps after the warm-up.  Predicted: ``CostModel.holder_sync_schedule(plan).sync_s``.
   Printed beside the model's sets: the runtime's, with their bytes and mean start / end; on ``tp`` both have the
   3-rank sets of the replicated parameters (LayerNorms, row-parallel biases, the embedding: whole on both ranks
   of the tp stage).
2. **The pick against the best aligned plan.**  ``search_plan(mode="hybrid", max_tp=2)`` on the same cluster; the
   best aligned plan is the fastest by ``CostModel.score`` of the ``pipeline`` planner's plan and every hand-made
   aligned plan (one or two replicas, each the same shape: tp 2 over one node's pair, or two stages of tp 1 cut
   at the same layer, any device pairing and order, every sample split in micro-batches).  Both train (no
   instrumentation); ``pick_vs_aligned`` = aligned s/step / pick s/step; the noise is the larger of the two runs'
   step-time standard errors over their means (printed).  If the pick is itself aligned, the best unaligned
   candidate runs too.

Last line: ``RESULT sync_max_err=... sync_err_tp=... sync_err_bounds=... pick_vs_aligned=... pick_aligned=0|1``.
Needs root (network namespaces, ``tc``) and DeepSpeed.  About 3 minutes here (2 cores).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emulated_nodes import require_netns  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = {"num_layers": 6, "hidden_size": 128, "num_heads": 4, "seq_len": 64, "vocab_size": 256}
NODES = (("A", ("a0", "a1")), ("B", ("b0", "b1")))
TCP_PAYLOAD = 2 * 1448 / (2 * 1514 + 66)
"""The link's goodput over its shaped rate: a frame of 1514 bytes (with the Ethernet header) carries 1448 of TCP
payload (MTU 1500 - IP 20 - TCP 20 - timestamps 12), and in a ring allreduce both directions carry data at once, so
each direction also carries the other's acks (66 bytes per two segments): 0.936."""
MEMORY_GB = 0.03
TFLOPS = 0.004
"""A speed-1 device's declared fp32 TFLOPS: low enough that 4 ranks on 2 cores stay inside their emulated time."""


# -- the cluster and the plans ----------------------------------------------------------------------------------------

def cluster_dict(rate_mbit: float, slow_speed: float, latency_us: float, intra_gbs: float) -> dict[str, Any]:
    speeds = {"a0": 1.0, "a1": 1.0, "b0": 1.0, "b1": slow_speed}
    return {"name": "holder_sync_two_nodes", "inter_node_bandwidth_gbs": rate_mbit * TCP_PAYLOAD / 8e3,
            "latency_us": latency_us,
            "nodes": [{"name": node, "intra_bandwidth_gbs": intra_gbs, "devices": [
                {"name": d, "type": "CPU", "tflops": {"fp32": TFLOPS}, "efficiency": 1.0, "emulated_speed": speeds[d],
                 "memory_gb": MEMORY_GB} for d in devices]} for node, devices in NODES]}


def _settings(batch: int, micro: int) -> Any:
    from het_strategy.core.train_settings import TrainSettings

    return TrainSettings(global_batch_size=batch, dtype="fp32", micro_batch_sizes=(micro,), max_tp=2,
                         memory_reserve_gb=0.0)


def make_plan(base: Any, replicas: list[tuple[list[tuple[tuple[str, ...], int, int]], int]], micro: int) -> Any:
    """A manual plan on ``base``'s cluster and model: per replica ``([(devices, start, stop), ...], samples)``."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    pipes = tuple(Pipeline(tuple(Stage(tuple(d), (a, b)) for d, a, b in stages), micro_batch_size=micro,
                           samples=samples) for stages, samples in replicas)
    return Plan(cluster=base.cluster, cluster_devices=base.cluster_devices, model=base.model,
                global_batch_size=sum(s for _, s in replicas), dtype="fp32", mode="manual", zero_stage=0,
                pipelines=pipes)


def sync_plans(base: Any, layers: int, batch: int, micro: int) -> dict[str, Any]:
    """Part 1's plans (module docstring)."""
    half = batch // 2
    return {"tp": make_plan(base, [([(("a0",), 0, 3), (("a1",), 3, layers)], half),
                                   ([(("b0", "b1"), 0, layers)], batch - half)], micro),
            "bounds": make_plan(base, [([(("a0",), 0, 3), (("a1",), 3, layers)], half),
                                       ([(("b0",), 0, 5), (("b1",), 5, layers)], batch - half)], micro)}


def aligned_candidates(base: Any, layers: int, batch: int, micro: int) -> list[Any]:
    """Every hand-made aligned plan (module docstring, part 2): one or two replicas of one shape."""
    devices = [d for _, ds in NODES for d in ds]
    pairs = [p for p in itertools.permutations(devices, 2)]
    out = []
    shapes: list[Any] = [("tp", None)] + [("cut", k) for k in range(1, layers)]
    for kind, k in shapes:
        def replica(pair: tuple[str, str]) -> list[tuple[tuple[str, ...], int, int]]:
            if kind == "tp":
                return [(tuple(sorted(pair)), 0, layers)]
            return [((pair[0],), 0, k), ((pair[1],), k, layers)]

        usable = [p for p in pairs if kind != "tp" or (p[0] < p[1] and p[0][0] == p[1][0])]  # tp: within a node
        for p in usable:
            out.append(make_plan(base, [(replica(p), batch)], micro))
        for p, q in itertools.combinations(usable, 2):
            if set(p) & set(q) or (kind == "tp" and p > q):
                continue
            for s in range(micro, batch, micro):
                out.append(make_plan(base, [(replica(p), s), (replica(q), batch - s)], micro))
    return out


def is_aligned(plan: Any) -> bool:
    shapes = {(tuple(p.boundaries()), tuple(st.tp for st in p.stages)) for p in plan.pipelines}
    return len(shapes) == 1


def describe(plan: Any) -> str:
    return " | ".join(" -> ".join(f"{'+'.join(s.devices)}[{s.layers[0]},{s.layers[1]})" for s in q.stages)
                      + f" x{q.samples}" for q in plan.pipelines)


def rank_devices(plan: Any) -> list[str]:
    """The device of each global rank, as the runtime numbers them (``ds_config.rank_layout``)."""
    from het_strategy.ds_runtime.ds_config import rank_layout

    return [ra.device for ra in sorted(rank_layout(plan), key=lambda ra: ra.rank)]


def runtime_sets(plan: Any) -> list[tuple[str, ...]]:
    """The runtime's holder sets in its order, as device names (``ds_runtime.replicas.replica_layout``)."""
    from het_strategy.ds_runtime.replicas import replica_layout

    dev = rank_devices(plan)
    return [tuple(dev[r] for r in hs) for hs in replica_layout(plan).holder_sets]


# -- running a plan on the two nodes ----------------------------------------------------------------------------------

def run(plan: Any, cluster: dict[str, Any], args: argparse.Namespace, instrument: bool, probe: bool = False,
        timeout_s: float = 400) -> list[dict[str, Any]]:
    """Train ``plan`` on the two emulated nodes, each rank in the namespace of its device's node; every rank's
    JSON (``_worker``)."""
    from het_strategy.emulation.local_ranks import run_script_ranks
    from het_strategy.emulation.netshape import LinkShape
    from het_strategy.emulation.node_network import emulated_nodes

    devices = rank_devices(plan)
    node_index = {d: i for i, (_, ds) in enumerate(NODES) for d in ds}
    nodes = [node_index[d] for d in devices]
    with tempfile.TemporaryDirectory(prefix="het_holder_") as tmp:
        out = Path(tmp)
        spec = {"plan": json.loads(plan.to_json()), "cluster": cluster, "model": MODEL, "steps": args.steps,
                "warmup": args.warmup, "out": str(out), "instrument": instrument, "probe": probe, "nodes": nodes}
        (out / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(out / "spec.json")]
        base_env = {"DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore",  # run_script_ranks sets OMP_NUM_THREADS=1
                    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        world = len(devices)
        with emulated_nodes(len(NODES), LinkShape(args.rate_mbit)) as net:
            codes = run_script_ranks(cmd, world, out, timeout_s, base_env, nodes=net, rank_nodes=nodes)
        if codes != [0] * world:
            tails = "\n----\n".join((out / f"log{r}.txt").read_text()[-2500:] for r in range(world))
            raise SystemExit(f"{describe(plan)}: ranks exited {codes}:\n{tails}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _probe(nodes: list[int]) -> dict[str, float]:
    """Latency across the link (a 2-rank allreduce of one float: 2 ring steps), the loopback's bandwidth (a 2-rank
    allreduce of 16 MB inside node A: 2 steps of 8 MB) and the link's (1 MiB across it: 2 steps of 0.5 MiB each
    way); collective over the world."""
    import torch
    import torch.distributed as dist

    a = [r for r, n in enumerate(nodes) if n == 0]
    b = [r for r, n in enumerate(nodes) if n == 1]
    cross, intra = dist.new_group([a[0], b[0]]), dist.new_group(a[:2])
    rank = dist.get_rank()

    def timed(group: Any, members: list[int], numel: int, reps: int) -> float:
        if rank not in members:
            return 0.0
        x = torch.zeros(numel)
        dist.all_reduce(x, group=group)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    lat = timed(cross, [a[0], b[0]], 1, 200) / 2
    intra_s = timed(intra, a[:2], 4 * 2**20, 7)
    link_s = timed(cross, [a[0], b[0]], 2**18, 5)
    dist.barrier()
    return {"latency_us": lat * 1e6, "intra_gbs": 16 * 2**20 / 2 / max(intra_s / 2 - lat, 1e-9) / 1e9,
            "link_mbit": 2**20 * 8 / max(link_s - 2 * lat, 1e-9) / 1e6}


class _TimedReducer:
    """The engine's reducer behind a barrier over every rank, timed per step and per set (wall clock: one clock for
    every process of this machine)."""

    def __init__(self, reducer: Any) -> None:
        self.reducer = reducer
        self.steps: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reducer, name)

    def __call__(self, module: Any, optimizer: Any = None) -> None:
        import deepspeed.comm as ds_comm
        import torch.distributed as dist

        dist.barrier()
        sets: list[tuple[int, float, float]] = []
        original = ds_comm.all_reduce

        def timed(tensor: Any, *a: Any, **k: Any) -> Any:
            t0 = time.time()
            out = original(tensor, *a, **k)
            sets.append((int(tensor.numel()), t0, time.time()))
            return out

        ds_comm.all_reduce = timed
        try:
            t0 = time.time()
            self.reducer(module, optimizer)
            t1 = time.time()
        finally:
            ds_comm.all_reduce = original
        hs = [list(h) for h, _ in self.reducer._buckets]
        self.steps.append({"enter": t0, "exit": t1, "sets": [[h, *s] for h, s in zip(hs, sets)]})


def _worker(spec_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import TransformerConfig, transformer_workload
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.ds_runtime.engine import PlanRunner, init_deepspeed_distributed

    spec = json.loads(Path(spec_path).read_text())
    plan = Plan.from_dict(spec["plan"])
    init_deepspeed_distributed(120)
    probed = _probe(spec["nodes"]) if spec["probe"] else {}
    cluster = load_cluster(spec["cluster"])
    cfg = TransformerConfig(name="char_gpt", **spec["model"])
    torch.manual_seed(0)
    model = CharGPT.from_workload_config(cfg)
    runner = PlanRunner(plan, model.pipeline_layers(), CharGPT.pipeline_loss,
                        lambda params: torch.optim.AdamW(params, lr=1e-3), emulated_cluster=cluster,
                        workload=transformer_workload(cfg, dtype="fp32"), timeout_s=120)
    timer = None
    if spec["instrument"]:
        timer = _TimedReducer(runner.engine.plan_reducer)
        object.__setattr__(runner.engine, "plan_reducer", timer)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (plan.global_batch_size, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (plan.global_batch_size, cfg.seq_len), generator=g)
    times = []
    torch.distributed.barrier()
    for _ in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        runner.train_step(x, y)
        times.append(time.perf_counter() - t0)
    torch.distributed.barrier()
    result = {"times": times, "probe": probed, "sync": timer.steps if timer else []}
    Path(spec["out"], f"rank{runner.rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# -- the figures ------------------------------------------------------------------------------------------------------

def measured_sync(ranks: list[dict[str, Any]], warmup: int) -> tuple[float, float, dict[tuple[int, ...], list]]:
    """Mean and standard error over the steps after ``warmup`` of the last exit - the last entry; per set (global
    ranks), its mean start and end after the last entry (the set starts when its last member calls it)."""
    steps = len(ranks[0]["sync"])
    per_step, per_set = [], {}
    for s in range(warmup, steps):
        start = max(r["sync"][s]["enter"] for r in ranks)
        per_step.append(max(r["sync"][s]["exit"] for r in ranks) - start)
        seen: dict[tuple[int, ...], list[float]] = {}
        for r in ranks:
            for hs, _, t0, t1 in r["sync"][s]["sets"]:
                e = seen.setdefault(tuple(hs), [t0, t1])
                e[0], e[1] = max(e[0], t0), max(e[1], t1)
        for hs, (t0, t1) in seen.items():
            per_set.setdefault(hs, []).append((t0 - start, t1 - start))
    mean = statistics.fmean(per_step)
    sem = statistics.stdev(per_step) / len(per_step) ** 0.5 if len(per_step) > 1 else 0.0
    return mean, sem, {hs: [statistics.fmean(v[0] for v in vals), statistics.fmean(v[1] for v in vals)]
                       for hs, vals in per_set.items()}


def step_figures(ranks: list[dict[str, Any]], warmup: int) -> tuple[float, float]:
    times = ranks[0]["times"][warmup:]
    return statistics.fmean(times), statistics.stdev(times) / len(times) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--rate-mbit", type=float, default=200.0, help="the inter-node link, each way")
    ap.add_argument("--slow-speed", type=float, default=0.5, help="b1's emulated speed")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    require_netns("holder_sync_two_node.py")
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.workload import TransformerConfig, transformer_workload
    from het_strategy.planning import search_plan

    started = time.monotonic()
    workload = transformer_workload(TransformerConfig(name="char_gpt", **MODEL), dtype="fp32")
    layers = workload.num_layers
    settings = _settings(args.batch, args.micro)
    draft = load_cluster(cluster_dict(args.rate_mbit, args.slow_speed, 100.0, 1.0))
    base = search_plan(draft, workload, settings, mode="pipeline")
    plans = sync_plans(base, layers, args.batch, args.micro)

    print(f"(1) holder-set sync, char GPT {MODEL['num_layers']} blocks (fp32 gradients), nodes A (a0, a1) and B (b0, "
          f"b1), {args.rate_mbit:g} Mbit/s between them; {args.steps} steps after {args.warmup} warm-up, a barrier "
          f"before each step's reduction", flush=True)
    results, raw = {}, None
    for name, plan in plans.items():
        if raw is None:  # the first run probes the machine (its cluster serves only the emulated compute)
            ranks = run(plan, cluster_dict(args.rate_mbit, args.slow_speed, 100.0, 1.0), args, instrument=True,
                        probe=True)
            probe = ranks[0]["probe"]
            raw = cluster_dict(args.rate_mbit, args.slow_speed, round(probe["latency_us"], 1),
                               round(probe["intra_gbs"], 3))
            print(f"  probed (first run, rank 0): latency across the link {probe['latency_us']:.0f} us, loopback "
                  f"{probe['intra_gbs']:.2f} GB/s, the link {probe['link_mbit']:.1f} Mbit/s of TCP payload "
                  f"(declared {args.rate_mbit * TCP_PAYLOAD:.1f}: {args.rate_mbit:g} x {TCP_PAYLOAD:.3f})", flush=True)
        else:
            ranks = run(plan, raw, args, instrument=True)
        results[name] = ranks
    cluster = load_cluster(raw)
    cm = CostModel(cluster, workload, settings)
    errors = {}
    for name, plan in plans.items():
        sched = cm.holder_sync_schedule(plan)
        mean, sem, per_set = measured_sync(results[name], args.warmup)
        err = mean / sched.sync_s - 1
        errors[name] = err
        print(f"  plan `{name}`: {describe(plan)}; syncs_by_holder_sets: {cm.syncs_by_holder_sets(plan)}")
        print(f"    {'model set':<22} {'MB':>6} {'start':>6} {'end':>6}   {'runtime set':<22} {'MB':>6} {'start':>6} "
              f"{'end':>6}")
        dev = rank_devices(plan)
        bytes_of: dict[tuple[int, ...], int] = {}
        for r in results[name]:
            for hs, numel, _, _ in r["sync"][-1]["sets"]:
                bytes_of[tuple(hs)] = 4 * numel
        rt = sorted(per_set)
        for k in range(max(len(sched.reductions), len(rt))):
            left = right = ""
            if k < len(sched.reductions):
                red = sched.reductions[k]
                left = (f"{'+'.join(red.members):<22} {red.num_bytes / 1e6:6.3f} {sched.start_s[k]:6.3f} "
                        f"{sched.end_s[k]:6.3f}")
            if k < len(rt):
                hs = rt[k]
                right = (f"{'+'.join(dev[r] for r in hs):<22} {bytes_of[hs] / 1e6:6.3f} {per_set[hs][0]:6.3f} "
                         f"{per_set[hs][1]:6.3f}")
            print(f"    {left:<43}   {right}")
        model_sets = [tuple(sorted(r.members)) for r in sched.reductions]
        rt_sets = [tuple(sorted(hs)) for hs in runtime_sets(plan) if len(hs) > 1]
        if [hs for hs in rt_sets if hs in model_sets] != model_sets:
            print(f"    the order differs: model {model_sets}, runtime {rt_sets}")
        extra = [hs for hs in rt_sets if hs not in model_sets]
        if extra:
            names = ", ".join("+".join(hs) for hs in extra)
            print(f"    sets the runtime reduces and the model does not price: {names}")
        print(f"    sync: predicted {sched.sync_s:.3f} s, measured {mean:.3f} +- {sem:.3f} s, error {err:+.1%}",
              flush=True)

    print(f"(2) the planner's pick against the best aligned plan: b1 at speed {args.slow_speed:g}, "
          f"{MEMORY_GB * 1e3:g} MB per device, global batch {args.batch}, micro-batch {args.micro}", flush=True)
    pick = search_plan(cluster, workload, settings, mode="hybrid")
    candidates = [p for p in aligned_candidates(base, layers, args.batch, args.micro)]
    candidates.append(search_plan(cluster, workload, settings, mode="pipeline"))
    scored = [(cm.score(p), p) for p in candidates]
    fitting = [(s, p) for s, p in scored if s.fits and is_aligned(p)]
    aligned = min(fitting, key=lambda sp: sp[0].step_time_s)[1]
    print(f"  aligned candidates: {len(candidates)} ({len(fitting)} fit in memory); the fastest by the cost model "
          f"is the best aligned plan")
    runs = {"pick": pick, "aligned": aligned}
    pick_aligned = is_aligned(pick)
    if pick_aligned:  # then the best unaligned candidate runs too, to show why it lost
        unaligned = [sp for sp in scored if sp[0].fits and not is_aligned(sp[1])]
        if unaligned:
            runs["best unaligned"] = min(unaligned, key=lambda sp: sp[0].step_time_s)[1]
    rows = {}
    for name, plan in runs.items():
        ranks = run(plan, raw, args, instrument=False)
        mean, sem = step_figures(ranks, args.warmup)
        score = cm.score(plan)
        rows[name] = (mean, sem)
        print(f"  {name:<8} {describe(plan)}")
        print(f"  {'':<8} measured {mean:.3f} +- {sem:.3f} s/step, predicted {score.step_time_s:.3f} (sync "
              f"{score.sync_time_s:.3f}{', by holder sets' if cm.syncs_by_holder_sets(plan) else ''})", flush=True)
    ratio = rows["aligned"][0] / rows["pick"][0]
    noise = max(sem / mean for mean, sem in rows.values())
    predicted = cm.score(aligned).step_time_s / cm.score(pick).step_time_s
    print(f"  aligned / pick: measured {ratio:.3f}, predicted {predicted:.3f}; noise (largest step-time standard "
          f"error / mean) {noise:.1%}")
    print(f"  wall {time.monotonic() - started:.0f} s")
    max_err = max(abs(e) for e in errors.values())
    print(f"RESULT sync_max_err={max_err:.3f} " + " ".join(f"sync_err_{k}={abs(e):.3f}" for k, e in errors.items())
          + f" pick_vs_aligned={ratio:.3f} pick_aligned={int(pick_aligned)}")


if __name__ == "__main__":
    main()
