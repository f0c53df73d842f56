"""One rank of the hierarchical-hook test: ``python _hierarchical_worker.py OUT_DIR METHOD STEPS``.

Started by ``run_script_ranks(..., nodes=...)`` on 2 emulated nodes x 2 ranks.  A DDP model of one bias-free
``Linear`` (one eligible 2-D gradient: the quantized exchange's flat is exactly that layer) gets the
hierarchical hook; after the first backward the gradient is compared with the mean of every rank's own
gradient (all-gathered), and, for a ``q<bits>`` method, with the two-phase quantizer's bound over the node
sums the leaders exchange.  Then ``STEPS`` more backward passes run while the leader reads its uplink's
transmit counter (inside the node's namespace).  Every rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from het_strategy.compression import CompressionConfig
from het_strategy.compression.config import quantizer_for
from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups
from het_strategy.compression.quantize import error_bound
from het_strategy.emulation.node_network import UPLINK


def two_phase_bound(inputs: list[torch.Tensor], spec) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of ``inputs`` over the exchanging ranks and the per-element bound of the two-phase quantized
    exchange (each input's rounding / W, plus re-quantizing the chunk mean, whose bucket range widens by
    twice the first phase's error), as tests/test_compression_hooks.py derives it."""
    world, n = len(inputs), inputs[0].numel()
    chunk = math.ceil(n / (world * spec.bucket_size)) * spec.bucket_size
    padded = [torch.cat([x, torch.zeros(chunk * world - n)]) for x in inputs]
    true = sum(padded) / world
    first = sum(error_bound(x, spec) for x in padded) / world
    rows = true.reshape(-1, spec.bucket_size)
    widen = first.reshape(-1, spec.bucket_size).amax(dim=1, keepdim=True)
    if spec.scaling == "maxmin":
        step = (rows.amax(1, keepdim=True) - rows.amin(1, keepdim=True) + 2 * widen) / (2 ** spec.bits - 1)
    else:
        step = (rows.abs().amax(1, keepdim=True) + widen) / (2 ** (spec.bits - 1) - 1)
    second = (step * (1.0 if spec.stochastic else 0.5)).expand_as(rows).reshape(-1)
    return true[:n], (first + second + 1e-6)[:n]


def uplink_tx() -> int:
    return int(Path(f"/sys/class/net/{UPLINK}/statistics/tx_bytes").read_text())


def main() -> None:
    out_dir, method, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = node_groups(int(os.environ["LOCAL_WORLD_SIZE"]))
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 256, bias=False)
    reference = torch.nn.Linear(64, 256, bias=False)
    reference.load_state_dict(layer.state_dict())
    model = DDP(layer)
    config = CompressionConfig(method="none" if method == "none" else "quantize",
                               bits=4 if method == "none" else int(method[1:]), warmup_steps=0, min_numel=1024)
    state = HierarchicalState(model, config, groups)
    model.register_comm_hook(state, hierarchical_hook)

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(16, 64, generator=g) * (1 + rank)

    model(batch(0)).square().mean().backward()
    got = layer.weight.grad.reshape(-1).clone()
    reference(batch(0)).square().mean().backward()
    own = [torch.zeros_like(got) for _ in range(world)]
    dist.all_gather(own, reference.weight.grad.reshape(-1).clone())
    everyone = [torch.zeros_like(got) for _ in range(world)]
    dist.all_gather(everyone, got)
    per_node = groups.ranks_per_node
    node_sums = [sum(own[n * per_node:(n + 1) * per_node]) for n in range(groups.num_nodes)]
    result = {"rank": rank, "node": groups.node, "identical": all(torch.equal(e, everyone[0]) for e in everyone),
              "max_error": float((got - sum(own) / world).abs().max()),
              "scale": float((sum(own) / world).abs().max())}
    if method != "none":
        true, bound = two_phase_bound(node_sums, quantizer_for(method, config))
        result["excess"] = float(((got * per_node - true).abs() - bound).max())
        result["used_of_bound"] = float(((got * per_node - true).abs() / bound).max())
    dist.barrier()
    tx0, inter0 = uplink_tx(), state.bytes_inter
    for step in range(1, steps + 1):
        layer.zero_grad()
        model(batch(step)).square().mean().backward()
    dist.barrier()
    result["uplink_tx"] = uplink_tx() - tx0
    result["hook_inter_bytes"] = state.bytes_inter - inter0
    result["bucket_bytes"] = got.numel() * 4
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
