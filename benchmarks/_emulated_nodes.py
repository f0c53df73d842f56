"""Training runs on emulated nodes for the benchmarks that shape a link (``joint_planning.py``,
``low_communication.py``): the cluster's shared command-line options, and one run of a script's ``--worker``
on a network namespace per node."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_link_options(ap: argparse.ArgumentParser, rate_mbit: float, slow_speed: float) -> None:
    """``--rate-mbit``, ``--slow-speed`` and ``--intra-gbs`` (``joint_planning.cluster_dict``'s inputs)."""
    ap.add_argument("--rate-mbit", type=float, default=rate_mbit, help="the inter-node link, each way")
    ap.add_argument("--slow-speed", type=float, default=slow_speed, help="the slow node's devices' speed")
    ap.add_argument("--intra-gbs", type=float, default=1.0, help="the loopback's bandwidth as declared")


def require_netns(benchmark: str) -> None:
    """Exit with the reason when this machine cannot make shaped network namespaces."""
    from het_strategy.emulation.netshape import netns_available

    ok, reason = netns_available()
    if not ok:
        raise SystemExit(f"{benchmark} needs network namespaces with tc: {reason}")


def run_on_nodes(script: str, source: dict[str, Any], plan: Any, run_dir: Path, rate_mbit: float,
                 worker_args: list[str], timeout_s: float = 3000) -> dict[str, Any]:
    """Run ``script --worker --cluster C --plan P --out O <worker_args>`` once per device of ``source`` (a cluster
    mapping), each rank in its node's namespace (a one-node cluster: on loopback); the JSON rank 0 wrote to ``O``
    with ``crossed_mb``, the bytes that left every node's uplink."""
    import yaml

    from het_strategy.emulation.local_ranks import run_script_ranks
    from het_strategy.emulation.netshape import LinkShape
    from het_strategy.emulation.node_network import emulated_nodes

    run_dir.mkdir()
    cluster_path, plan_path, out = run_dir / "cluster.yaml", run_dir / "plan.json", run_dir / "summary.json"
    cluster_path.write_text(yaml.safe_dump(source, sort_keys=False))
    plan.save(plan_path)
    world = sum(len(n["devices"]) for n in source["nodes"])
    cmd = [sys.executable, script, "--worker", "--cluster", str(cluster_path), "--plan", str(plan_path), "--out",
           str(out), *worker_args]
    env = {"PYTHONWARNINGS": "ignore"}
    if len(source["nodes"]) == 1:  # one node: its ranks talk over loopback, as inside that node's namespace
        codes, crossed = run_script_ranks(cmd, world, run_dir, timeout_s, env), 0
    else:
        with emulated_nodes(len(source["nodes"]), LinkShape(rate_mbit)) as net:
            tx0 = [net.uplink_tx_bytes(n) for n in range(len(net.nodes))]
            codes = run_script_ranks(cmd, world, run_dir, timeout_s, env, nodes=net)
            crossed = sum(net.uplink_tx_bytes(n) - tx0[n] for n in range(len(net.nodes)))
    if codes != [0] * world:
        logs = "\n".join((run_dir / f"log{r}.txt").read_text()[-3000:] for r in range(world))
        raise SystemExit(f"{run_dir.name}: ranks exited {codes}:\n{logs}")
    summary = json.loads(out.read_text())
    summary["crossed_mb"] = crossed / 1e6
    return summary
