"""Step time with adaptive compression vs uncompressed DDP, over a real 100 Mbit/s link and over loopback.

4 gloo ranks train the main job's char GPT (4 blocks, hidden 128, 0.87 M
parameters; 4 sequences of 64 bytes per rank per step) inside a private
network namespace.  In the first run its loopback is shaped with ``tc`` to
100 Mbit/s (all four ranks share that one link); in the second it is not shaped
(same namespace setup otherwise).

Each rank holds two replicas of the same model: one wrapped in plain DDP (its
built-in fp32 allreduce, no hook) and one with ``compression_hook`` in
``adaptive`` mode (the shipped defaults: 10 warm-up steps, re-solve every 50).
Steps alternate between them (and which goes first), so machine noise falls on
both alike; every step starts after a barrier and its time is the slowest
rank's.  The mean over the steps after ``--skip`` is compared:

    speedup = mean uncompressed step / mean adaptive step

Last line: ``RESULT speedup_100mbit=... ratio_fast_link=...`` where
``ratio_fast_link`` = adaptive / uncompressed step time on the unshaped link
(1.0 = equal; must be <= 1.03).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _compression_common import char_batches, char_gpt, interleaved_steps, run_worker_in_namespace, wrap  # noqa: E402


def _rank_main(rank: int, world: int, steps: int, seed: int) -> dict:
    torch.manual_seed(seed)
    base = char_gpt()
    replicas = {}
    for label, compression in (("uncompressed", None), ("adaptive", {"method": "adaptive", "verbose": rank == 0})):
        module = char_gpt()
        module.load_state_dict(base.state_dict())
        model, state = wrap(module, compression)
        replicas[label] = (model, state, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batches = char_batches(64, 4, rank, world, steps, seed)
    times = interleaved_steps(replicas, batches)
    state = replicas["adaptive"][1]
    return {"times": times, "wire_ratio": state.wire_ratio, "choices": dict(state.choices),
            "link": None if state.controller.link is None else [state.controller.link.latency_s,
                                                                 state.controller.link.bytes_per_s]}


def _worker(args: argparse.Namespace) -> None:
    from het_strategy.emulation.local_ranks import run_local_ranks

    results = run_local_ranks(_rank_main, args.world, args.steps, args.seed, timeout_s=3000)
    Path(args.out).write_text(json.dumps(results[0]))


def _run_in_namespace(shape, args: argparse.Namespace, out: Path) -> dict:
    return run_worker_in_namespace(__file__, shape, ["--steps", str(args.steps), "--world", str(args.world),
                                                     "--seed", str(args.seed)], out)


def _report(label: str, result: dict, skip: int) -> float:
    unc = statistics.fmean(result["times"]["uncompressed"][skip:])
    ada = statistics.fmean(result["times"]["adaptive"][skip:])
    link = result["link"]
    link_s = f"measured link {link[1] * 8 / 1e6:.0f} Mbit/s" if link else "link not measured"
    kinds = sorted(set(result["choices"].values()))
    print(f"{label}: uncompressed {unc * 1e3:.1f} ms/step, adaptive {ada * 1e3:.1f} ms/step -> "
          f"speed-up {unc / ada:.2f}x; wire saving {result['wire_ratio']:.2f}x; {link_s}; methods used {kinds}",
          flush=True)
    return unc / ada


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50, help="steps per replica on the shaped link")
    parser.add_argument("--fast-steps", type=int, default=260, help="steps per replica on the unshaped link")
    parser.add_argument("--skip", type=int, default=12, help="steps left out of the means (warm-up)")
    parser.add_argument("--rate-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    from het_strategy.emulation.netshape import LinkShape, netns_available

    ok, reason = netns_available()
    if not ok:
        raise SystemExit(f"compression_speed needs a private network namespace with tc: {reason}")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"4 ranks, char GPT, shaped loopback {args.rate_mbit:g} Mbit/s, {args.steps} steps per replica",
              flush=True)
        slow = _run_in_namespace(LinkShape(rate_mbit=args.rate_mbit), args, Path(tmp) / "slow.json")
        speedup = _report(f"{args.rate_mbit:g} Mbit/s", slow, args.skip)
        fast_args = argparse.Namespace(**{**vars(args), "steps": args.fast_steps})
        print(f"same, unshaped loopback, {args.fast_steps} steps per replica", flush=True)
        fast = _run_in_namespace(None, fast_args, Path(tmp) / "fast.json")
        fast_speedup = _report("unshaped", fast, args.skip)
    print(f"RESULT speedup_100mbit={speedup:.3f} ratio_fast_link={1 / fast_speedup:.4f}")


if __name__ == "__main__":
    main()
