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
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from het_strategy.compression import CompressionConfig
from het_strategy.compression.config import quantizer_for
from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups
from het_strategy.emulation.node_network import UPLINK

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _quantizer_bounds import two_phase_bound  # noqa: E402


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
    config = CompressionConfig(method=method, warmup_steps=0, min_numel=1024)
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
