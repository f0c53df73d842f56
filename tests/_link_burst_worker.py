"""One rank of the shaped-link timing test: ``python _link_burst_worker.py OUT_DIR`` (two ranks, one per node).

After the link has been idle, rank 0 sends 256 KiB to rank 1 and waits for its one-element receipt; rank 0
writes the time (``short_s``) to ``OUT_DIR/times.json``.  A shaper whose bucket holds the whole message after
the idle spell lets it through at once.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

SHORT_BYTES = 256 << 10


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    receipt, short = torch.zeros(1), torch.full((SHORT_BYTES // 4,), 7.0)
    dist.barrier()
    time.sleep(0.5)  # the link idles: a shaper's bucket refills
    start = time.perf_counter()
    if rank == 0:
        dist.send(short, dst=1)
        dist.recv(receipt, src=1)
    else:
        dist.recv(short.zero_(), src=0)
        dist.send(receipt, dst=0)
    short_s = time.perf_counter() - start
    ok = bool(torch.all(short == 7.0))
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as fh:
        json.dump({"short_s": short_s, "received_ok": ok}, fh)


if __name__ == "__main__":
    main()
