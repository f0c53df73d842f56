"""Two emulated nodes joined by a 100 Mbit/s link: hierarchical compressed allreduce vs flat adaptive vs DDP.

4 gloo ranks, 2 per node, each node a network namespace (``emulation/node_network.py``): ranks of one node
talk over its loopback (fast, unshaped), ranks of different nodes cross a veth link shaped to
``--rate-mbit`` each way.  Every rank trains three replicas of the main job's char GPT (4 blocks, hidden
128, 0.87 M parameters; 4 sequences of 64 bytes per rank per step) on the same batches:

- ``none``: plain DDP (its built-in fp32 allreduce, no hook);
- ``flat``: ``compression_hook`` in ``adaptive`` mode over all four ranks (every rank's bytes compressed,
  the controller measuring the whole ring);
- ``hier``: ``hierarchical_hook``: node sum uncompressed, ``adaptive`` (or ``--hier-method q4``: one
  quantizer) among the two node leaders (the controller measuring the inter-node link only), broadcast
  within the node.

Steps alternate between the replicas (and their order), so machine noise falls on all alike; each step
starts after a barrier and its time is the slowest rank's.  Means leave out the first ``--skip`` steps
(the adaptive warm-up).  After training, each replica's validation loss on the same held-out batches.

Last line: ``RESULT hier_vs_none=<none/hier step time> hier_vs_flat=<flat/hier> loss_gap=<|hier - none| /
none validation loss>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compression_common import char_batches, char_gpt, interleaved_steps, lm_loss, wrap  # noqa: E402

LABELS = ("none", "flat", "hier")


def _replicas(rank: int, seed: int, hier_method: str) -> dict:
    from het_strategy.compression import CompressionConfig
    from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    base = char_gpt()
    groups = node_groups(int(os.environ["LOCAL_WORLD_SIZE"]))
    out = {}
    for label in LABELS:
        module = char_gpt()
        module.load_state_dict(base.state_dict())
        if label == "hier":
            model = DDP(module)
            config = CompressionConfig(method="adaptive", verbose=False) if hier_method == "adaptive" else \
                CompressionConfig(method="quantize", bits=int(hier_method[1:]))
            state = HierarchicalState(model, config, groups)
            model.register_comm_hook(state, hierarchical_hook)
        else:
            model, state = wrap(module, None if label == "none" else {"method": "adaptive", "verbose": False})
        out[label] = (model, state, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def _worker(out_path: str, steps: int, seed: int, val_batches: int, batch: int, hier_method: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = _replicas(rank, seed, hier_method)
    batches = char_batches(64, batch, rank, world, steps, seed)
    times = interleaved_steps(replicas, batches)
    val = char_batches(64, 8, rank, world, val_batches, seed + 1000, split="val")
    losses = {}
    for label, (model, _, _) in replicas.items():
        model.eval()
        with torch.no_grad():
            total = torch.tensor([sum(float(lm_loss(model.module, b)) for b in val) / len(val)])
        dist.all_reduce(total)
        losses[label] = float(total) / world
    flat_state, hier_state = replicas["flat"][1], replicas["hier"][1]
    inter = torch.tensor([float(hier_state.bytes_inter)])
    dist.all_reduce(inter)
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "times": times, "val_loss": losses, "flat_wire_ratio": flat_state.wire_ratio,
            "flat_choices": sorted(set(flat_state.choices.values())),
            "hier_choices": sorted(set(hier_state.inter.choices.values())),
            "hier_link": None if hier_state.inter.link is None else hier_state.inter.link.bytes_per_s,
            "flat_link": None if flat_state.link is None else flat_state.link.bytes_per_s,
            "hier_inter_bytes": float(inter), "flat_bytes": float(flat_state.bytes_sent) * world}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=60, help="training steps per replica")
    parser.add_argument("--skip", type=int, default=15, help="steps left out of the means (warm-up)")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4, help="sequences of 64 bytes per rank per step")
    parser.add_argument("--hier-method", default="adaptive", help="the hierarchical replica's method: adaptive "
                        "or q<bits> (one quantizer everywhere)")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        _worker(args.out, args.steps, args.seed, args.val_batches, args.batch, args.hier_method)
        return
    from het_strategy.emulation.local_ranks import run_script_ranks
    from het_strategy.emulation.netshape import LinkShape, netns_available
    from het_strategy.emulation.node_network import emulated_nodes

    ok, reason = netns_available()
    if not ok:
        raise SystemExit(f"two_node_compression needs network namespaces with tc: {reason}")
    print(f"2 nodes x 2 ranks, char GPT, {args.rate_mbit:g} Mbit/s between nodes (each way), loopback within; "
          f"{args.steps} steps per replica, {args.batch} sequences per rank per step", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
               "--seed", str(args.seed), "--val-batches", str(args.val_batches), "--batch", str(args.batch),
               "--hier-method", args.hier_method]
        with emulated_nodes(2, LinkShape(args.rate_mbit)) as net:
            tx0 = [net.uplink_tx_bytes(n) for n in range(2)]
            codes = run_script_ranks(cmd, 4, Path(tmp), 3000, nodes=net)
            crossed = sum(net.uplink_tx_bytes(n) - tx0[n] for n in range(2))
        if codes != [0, 0, 0, 0]:
            logs = "\n".join((Path(tmp) / f"log{r}.txt").read_text()[-2000:] for r in range(4))
            raise SystemExit(f"ranks exited {codes}:\n{logs}")
        result = json.loads(out.read_text())
    means = {k: statistics.fmean(v[args.skip:]) for k, v in result["times"].items()}
    losses = result["val_loss"]
    for label in LABELS:
        print(f"  {label:5s} {means[label] * 1e3:8.1f} ms/step   validation loss {losses[label]:.4f}", flush=True)
    mbit = lambda bps: "-" if bps is None else f"{bps * 8 / 1e6:.0f} Mbit/s"  # noqa: E731
    print(f"  flat: methods {result['flat_choices']}, wire saving {result['flat_wire_ratio']:.2f}x, link measured "
          f"{mbit(result['flat_link'])}; hier: methods {result['hier_choices']} on the inter-node hop, link measured "
          f"{mbit(result['hier_link'])}", flush=True)
    print(f"  bytes over the veth links in all: {crossed / 1e6:.1f} MB (hier leaders' hook count "
          f"{result['hier_inter_bytes'] / 1e6:.1f} MB)", flush=True)
    hier_vs_none, hier_vs_flat = means["none"] / means["hier"], means["flat"] / means["hier"]
    gap = abs(losses["hier"] - losses["none"]) / losses["none"]
    print(f"  hierarchical vs uncompressed {hier_vs_none:.2f}x, vs flat adaptive {hier_vs_flat:.2f}x; "
          f"validation loss gap {gap * 100:.2f}%", flush=True)
    print(f"RESULT hier_vs_none={hier_vs_none:.3f} hier_vs_flat={hier_vs_flat:.3f} loss_gap={gap:.4f}")


if __name__ == "__main__":
    main()
