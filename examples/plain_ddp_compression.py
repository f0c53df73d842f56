"""Gradient compression in a plain PyTorch DDP script, without Lightning.

``compression_hook`` is an ordinary DDP comm hook: register it with a
``CompressionState`` on any ``DistributedDataParallel`` model.  Here two gloo
processes train a small MLP on a small 10-class image set (examples/_digits.py) with 4-bit quantized
gradients after 10 uncompressed warm-up steps (error feedback carries what
quantization drops into the next step); the state reports how many bytes
went on the wire against the fp32 allreduce.

Run (from the repository root)::

    .venv/bin/python examples/plain_ddp_compression.py              # 2 ranks, method q4
    .venv/bin/python examples/plain_ddp_compression.py --method powersgd --steps 50

Under ``torchrun`` the same ``train`` function runs as is (it only needs the
process group); this script starts its two ranks itself.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from _digits import digits  # examples/_digits.py
from het_strategy.compression import CompressionState, compression_hook
from het_strategy.emulation.local_ranks import free_port


def train(rank: int, world: int, method: str, steps: int) -> None:
    torch.manual_seed(0)
    images, y = digits()
    x = images.flatten(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    state = CompressionState(ddp, method)
    ddp.register_comm_hook(state, compression_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        idx = torch.randint(0, 1500, (32,), generator=g)  # each rank its own samples
        loss = F.cross_entropy(ddp(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (model(x[1500:]).argmax(1) == y[1500:]).float().mean().item()
    if rank == 0:
        print(f"method {method}: {steps} steps, held-out accuracy {acc:.3f}, bytes on the wire "
              f"{state.bytes_sent:,} vs {state.bytes_fp32:,} for fp32 ({state.wire_ratio:.1f}x less)")


def _entry(rank: int, world: int, port: int, method: str, steps: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, method, steps)
        dist.barrier()  # both ranks are done before either tears gloo down (a rank leaving early aborts the other)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--method", default="q4", help="q2 ... q8 | powersgd | topk | fp16 | bf16 | none | adaptive")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    mp.start_processes(_entry, args=(args.world, free_port(), args.method, args.steps), nprocs=args.world,
                       start_method="spawn")


if __name__ == "__main__":
    main()
