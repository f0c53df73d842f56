"""One rank of the emulated-nodes test: ``python _node_network_worker.py OUT_DIR``.

Ranks 0, 1 sit on node 0 and ranks 2, 3 on node 1 (``run_script_ranks(..., nodes=...)``).  Each rank
allreduces a tensor (the sum must be exact), then rank 0 sends ``MIB`` MiB to rank 1 (same node) and to
rank 2 (the other node), timed; every rank writes ``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

MIB = 4


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1 << 16,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(x)
    result = {"rank": rank, "node": int(os.environ["NODE_RANK"]), "allreduce": float(x[0]),
              "allreduce_exact": bool(torch.all(x == world * (world + 1) / 2))}
    payload = torch.ones(MIB << 18, dtype=torch.float32)  # MIB MiB
    for peer, key in ((1, "same_node_s"), (2, "other_node_s")):
        dist.barrier()
        if rank == 0:
            start = time.perf_counter()
            dist.send(payload, dst=peer)
            dist.recv(torch.zeros(1), src=peer)  # the peer's receipt: the whole payload has arrived
            result[key] = time.perf_counter() - start
        elif rank == peer:
            buf = torch.empty_like(payload)
            dist.recv(buf, src=0)
            dist.send(torch.zeros(1), dst=0)
            result["received_ok"] = bool(torch.all(buf == 1))
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
