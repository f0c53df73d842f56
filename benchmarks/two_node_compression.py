"""Two emulated nodes joined by a 100 Mbit/s link: hierarchical compressed allreduce vs flat adaptive vs DDP.

4 gloo ranks, 2 per node, each node a network namespace (``emulation/node_network.py``): ranks of one node
talk over its loopback (fast, unshaped), ranks of different nodes cross a veth link shaped to
``--rate-mbit`` each way.  Every rank trains four replicas of a char GPT (4 blocks, hidden ``--hidden``
= 256: 3.3 M parameters, 13 MB of fp32 gradients; ``--batch`` 1 sequence of ``--seq-len`` 32 bytes per
rank per step, so that the gradient exchange, not the four ranks' compute on two cores, sets the pace, as it
does for a large model on a slow link) on the same batches:

- ``none``: plain DDP (its built-in fp32 allreduce, no hook);
- ``flat``: ``compression_hook`` in ``adaptive`` mode over all four ranks (every rank's bytes compressed,
  the controller measuring the whole ring and choosing among none/q8/q4/q3 per layer);
- ``hier``: ``hierarchical_hook``: node sum uncompressed (reduce to the node's leader), ``--hier-method``
  (``powersgd``, rank 4, with error feedback; or ``adaptive``, or ``q<bits>``) among the two node
  leaders, broadcast within the node;
- ``flat_same``: ``--hier-method`` flat over all four ranks (the same codec without the hierarchy: what
  the hierarchy itself buys; left out for ``adaptive``, which ``flat`` already is).

Steps alternate between the replicas (and their order), so machine noise falls on all alike; each step
starts after a barrier and its time is the slowest rank's.  Means leave out the first ``--skip`` steps
(the compression warm-up).  After training, each replica's validation loss on the same held-out batches.

Last line: ``RESULT hier_vs_none=<none/hier step time> hier_vs_flat=<flat/hier> loss_gap=<|hier - none| /
none validation loss> hier_vs_flat_same=<flat_same/hier>``.
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

LABELS = ("none", "flat", "hier", "flat_same")


def _link_rate(state) -> float | None:  # type: ignore[no-untyped-def]
    """Bytes/s of the link an adaptive state's controller last fitted (None: none fitted, or no controller)."""
    link = state.controller.link if state.controller is not None else None
    return None if link is None else link.bytes_per_s


def _hier_config(hier_method: str):
    from het_strategy.compression import CompressionConfig

    if hier_method in ("adaptive", "powersgd", "topk"):
        return CompressionConfig(method=hier_method, verbose=False)
    return CompressionConfig(method=hier_method)


def _labels(hier_method: str) -> tuple[str, ...]:
    return LABELS[:3] if hier_method == "adaptive" else LABELS


def _replicas(rank: int, seed: int, hier_method: str, hidden: int, seq_len: int) -> dict:
    from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(seed)
    base = char_gpt(seq_len, hidden)
    groups = node_groups(int(os.environ["LOCAL_WORLD_SIZE"]))
    out = {}
    for label in _labels(hier_method):
        module = char_gpt(seq_len, hidden)
        module.load_state_dict(base.state_dict())
        if label == "hier":
            model = DDP(module)
            config = _hier_config(hier_method)
            state = HierarchicalState(model, config, groups)
            model.register_comm_hook(state, hierarchical_hook)
        elif label == "flat_same":
            model, state = wrap(module, _hier_config(hier_method))
        else:
            model, state = wrap(module, None if label == "none" else {"method": "adaptive", "verbose": False})
        out[label] = (model, state, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return out


def _worker(out_path: str, steps: int, seed: int, val_batches: int, batch: int, hier_method: str,
            hidden: int, seq_len: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    replicas = _replicas(rank, seed, hier_method, hidden, seq_len)
    batches = char_batches(seq_len, batch, rank, world, steps, seed)
    times = interleaved_steps(replicas, batches)
    val = char_batches(seq_len, 8, rank, world, val_batches, seed + 1000, split="val")
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
            "hier_link": _link_rate(hier_state.inter), "flat_link": _link_rate(flat_state),
            "hier_inter_bytes": float(inter), "flat_bytes": float(flat_state.bytes_sent) * world}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help="training steps per replica")
    parser.add_argument("--skip", type=int, default=12, help="steps left out of the means (warm-up)")
    parser.add_argument("--val-batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    parser.add_argument("--hier-method", default="powersgd", help="the inter-node hop's method in the hierarchical "
                        "replica: powersgd, topk, adaptive or q<bits>")
    parser.add_argument("--hidden", type=int, default=256, help="the char GPT's hidden size")
    parser.add_argument("--seq-len", type=int, default=32, help="bytes per sequence")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        _worker(args.out, args.steps, args.seed, args.val_batches, args.batch, args.hier_method, args.hidden,
                args.seq_len)
        return
    from het_strategy.emulation.local_ranks import run_script_ranks
    from het_strategy.emulation.netshape import LinkShape, netns_available
    from het_strategy.emulation.node_network import emulated_nodes

    ok, reason = netns_available()
    if not ok:
        raise SystemExit(f"two_node_compression needs network namespaces with tc: {reason}")
    if args.hier_method not in ("adaptive", "powersgd", "topk") and not args.hier_method[1:].isdigit():
        parser.error(f"--hier-method {args.hier_method!r}: be powersgd, topk, adaptive or q<bits>")
    print(f"2 nodes x 2 ranks, char GPT hidden {args.hidden}, {args.rate_mbit:g} Mbit/s between nodes (each way), "
          f"loopback within; {args.steps} steps per replica, {args.batch} x {args.seq_len} bytes per rank per step; "
          f"hier and flat_same: {args.hier_method}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", "--out", str(out), "--steps", str(args.steps),
               "--seed", str(args.seed), "--val-batches", str(args.val_batches), "--batch", str(args.batch),
               "--hier-method", args.hier_method, "--hidden", str(args.hidden), "--seq-len", str(args.seq_len)]
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
    for label in _labels(args.hier_method):
        print(f"  {label:9s} {means[label] * 1e3:8.1f} ms/step   validation loss {losses[label]:.4f}", flush=True)
    mbit = lambda bps: "-" if bps is None else f"{bps * 8 / 1e6:.0f} Mbit/s"  # noqa: E731
    print(f"  flat: methods {result['flat_choices']}, wire saving {result['flat_wire_ratio']:.2f}x, link measured "
          f"{mbit(result['flat_link'])}; hier: methods {result['hier_choices'] or [args.hier_method]} on the inter-node "
          f"hop, link measured {mbit(result['hier_link'])} (- : a fixed method, no controller)", flush=True)
    print(f"  bytes over the veth links in all: {crossed / 1e6:.1f} MB (hier leaders' hook count "
          f"{result['hier_inter_bytes'] / 1e6:.1f} MB)", flush=True)
    hier_vs_none, hier_vs_flat = means["none"] / means["hier"], means["flat"] / means["hier"]
    gap = abs(losses["hier"] - losses["none"]) / losses["none"]
    print(f"  hierarchical vs uncompressed {hier_vs_none:.2f}x, vs flat adaptive {hier_vs_flat:.2f}x; "
          f"validation loss gap {gap * 100:.2f}%", flush=True)
    same = ""
    if "flat_same" in means:
        same = f" hier_vs_flat_same={means['flat_same'] / means['hier']:.3f}"
        print(f"  hierarchical vs flat {args.hier_method} (the same codec over all four ranks) "
              f"{means['flat_same'] / means['hier']:.2f}x", flush=True)
    print(f"RESULT hier_vs_none={hier_vs_none:.3f} hier_vs_flat={hier_vs_flat:.3f} loss_gap={gap:.4f}{same}")


if __name__ == "__main__":
    main()
