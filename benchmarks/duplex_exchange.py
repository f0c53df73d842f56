"""Both directions of a slow link at once over gloo: gloo's own all-to-all and all-gather against
``compression/duplex.py``'s, which post every receive before any send.

Two emulated nodes (``emulation/node_network.py``: a network namespace each, ``--rate-mbit`` each way between
them), one gloo rank on each.  Every round, after a barrier and an idle spell, times on each rank:

- ``one way``: rank 0 sends ``--mib`` MiB, rank 1 answers with one element (the line's reference);
- ``all_to_all``: ``dist.all_to_all_single`` of ``2 x --mib`` MiB, so ``--mib`` MiB crosses each way, against
  ``duplex.all_to_all`` of the same tensors;
- ``all_gather``: ``dist.all_gather_into_tensor`` of ``--mib`` MiB per rank against ``duplex.all_gather``.

The two forms of each collective alternate within a round, so that both see the same link and the same
machine.  Reported: per form, the median and the worst round over both ranks, in seconds and in units of the
one-way time; the results are checked equal.  What this checks: the order in which gloo's TCP transport lets
two ranks' messages cross one connection (``duplex.py``'s docstring).  What it cannot: NCCL, whose collectives
drive both directions of a link at once either way; a link with a delay (this kernel has no ``netem``).

Last line: ``RESULT all_to_all_worst=<gloo's worst / duplex's worst> all_gather_worst=<...>
all_to_all_median=<gloo's median / duplex's median> all_gather_median=<...> duplex_vs_one_way=<duplex's worst
round over both collectives / the median one-way time>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _emulated_nodes import require_netns  # noqa: E402

FORMS = ("gloo all_to_all", "duplex all_to_all", "gloo all_gather", "duplex all_gather")


def _worker(out_dir: str, mib: float, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from het_strategy.compression import duplex

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, group = dist.get_rank(), dist.group.WORLD
    n = int(mib * (1 << 20)) // 4
    msg, got, receipt = torch.full((n,), float(rank)), torch.empty(n), torch.zeros(1)
    send = torch.cat([torch.full((n,), 10.0 * rank), torch.full((n,), 10.0 * rank + 1)])
    out_native, out_duplex = torch.empty(2 * n), torch.empty(2 * n)
    gather_native, gather_duplex = torch.empty(2 * n), torch.empty(2 * n)

    def one_way() -> None:
        if rank == 0:
            dist.send(msg, 1)
            dist.recv(receipt, 1)
        else:
            dist.recv(got, 0)
            dist.send(receipt, 0)

    ops = {"one way": one_way,
           "gloo all_to_all": lambda: dist.all_to_all_single(out_native, send),
           "duplex all_to_all": lambda: duplex.all_to_all(out_duplex, send, group).wait(),
           "gloo all_gather": lambda: dist.all_gather_into_tensor(gather_native, msg),
           "duplex all_gather": lambda: duplex.all_gather(gather_duplex, msg, group).wait()}
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(rounds + 1):  # round 0 warms the connections up and is not kept
        order = list(ops) if r % 2 == 0 else ["one way", *reversed(list(ops)[1:])]
        for name in order:
            dist.barrier()
            time.sleep(0.3)  # the link idles between timings
            start = time.perf_counter()
            ops[name]()
            if r > 0:
                times[name].append(time.perf_counter() - start)
    equal = bool(torch.equal(out_native, out_duplex) and torch.equal(gather_native, gather_duplex))
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"times": times, "equal": equal}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--rate-mbit", type=float, default=10.0, help="the link between the two nodes, each way")
    ap.add_argument("--mib", type=float, default=1.0, help="MiB each rank sends the other per collective")
    ap.add_argument("--rounds", type=int, default=8, help="timed rounds (each form once per round)")
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker, args.mib, args.rounds)
        return
    if args.rate_mbit <= 0 or args.mib <= 0 or args.rounds < 1:
        raise SystemExit("--rate-mbit and --mib must be > 0 and --rounds >= 1")
    require_netns("duplex_exchange.py")
    from het_strategy.emulation.local_ranks import run_script_ranks
    from het_strategy.emulation.netshape import LinkShape
    from het_strategy.emulation.node_network import emulated_nodes

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", tmp, "--mib", str(args.mib), "--rounds",
               str(args.rounds)]
        with emulated_nodes(2, LinkShape(args.rate_mbit)) as net:
            codes = run_script_ranks(cmd, 2, Path(tmp), 60 + args.rounds * 20 * args.mib * 80 / args.rate_mbit,
                                     nodes=net)
        if codes != [0, 0]:
            raise SystemExit(f"ranks exited {codes}:\n" + "\n".join(
                (Path(tmp) / f"log{r}.txt").read_text()[-2000:] for r in range(2)))
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(2)]
    if not all(r["equal"] for r in ranks):
        raise SystemExit("duplex's results differ from gloo's")
    times = {name: ranks[0]["times"][name] + ranks[1]["times"][name] for name in ranks[0]["times"]}
    line = statistics.median(times["one way"])
    print(f"two emulated nodes at {args.rate_mbit:g} Mbit/s each way, one gloo rank each; {args.mib:g} MiB each "
          f"way per collective, {args.rounds} rounds x 2 ranks")
    print(f"  {'one way':<18} median {line:6.3f} s (line time without headers "
          f"{args.mib * (1 << 20) * 8 / (args.rate_mbit * 1e6):.3f} s)")
    for name in FORMS:
        t = times[name]
        print(f"  {name:<18} median {statistics.median(t):6.3f} s ({statistics.median(t) / line:4.2f} x one way)"
              f"  worst {max(t):6.3f} s ({max(t) / line:4.2f} x)  rounds: {' '.join(f'{x:.2f}' for x in t)}")
    ratio = {kind: (max(times[f"gloo {kind}"]) / max(times[f"duplex {kind}"]),
                    statistics.median(times[f"gloo {kind}"]) / statistics.median(times[f"duplex {kind}"]))
             for kind in ("all_to_all", "all_gather")}
    worst_duplex = max(max(times["duplex all_to_all"]), max(times["duplex all_gather"]))
    print(f"RESULT all_to_all_worst={ratio['all_to_all'][0]:.2f} all_gather_worst={ratio['all_gather'][0]:.2f} "
          f"all_to_all_median={ratio['all_to_all'][1]:.2f} all_gather_median={ratio['all_gather'][1]:.2f} "
          f"duplex_vs_one_way={worst_duplex / line:.2f}")


if __name__ == "__main__":
    main()
