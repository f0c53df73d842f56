"""The plan table: a Plan and its cost-model figures as fixed-width text, and the formatter behind it.

``plan_table`` prints one row per stage of each pipeline; pipelines that are
identical (same device types, stage layout and batch) are folded into one row
with a count, so the table of a 512-device plan stays a screen long.
``format_table`` lays out any header and rows in aligned columns (the probe's
table uses it too); ``group_pipelines`` and ``compress_devices`` are shared
with the picture (``picture.py``).
"""

from __future__ import annotations

import re
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Collection, Sequence

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan_score import PlanScore
    from het_strategy.core.plan import Plan

__all__ = ["plan_table", "format_table", "compress_devices", "compress_indices", "PipelineGroup",
           "group_pipelines"]

GiB = 2**30
_DEVICES_WIDTH = 30
_MAX_SHARE_RUNS = 16


@dataclass(frozen=True)
class PipelineGroup:
    """Pipelines with the same device types, stage layout and batch, shown as one row set."""

    indices: tuple[int, ...]
    """Indices of the pipelines in ``plan.pipelines``."""
    signature: tuple
    """What makes them identical: per stage (device types, layers), micro-batch size, samples."""

    @property
    def count(self) -> int:
        return len(self.indices)


def group_pipelines(plan: "Plan", cluster: "ClusterSpec") -> list[PipelineGroup]:
    """Fold identical pipelines (device types per stage, layer ranges, micro-batch, samples) together."""
    groups: "OrderedDict[tuple, list[int]]" = OrderedDict()
    for i, pipe in enumerate(plan.pipelines):
        sig = (tuple((tuple(cluster.device(d).type for d in st.devices), st.layers) for st in pipe.stages),
               pipe.micro_batch_size, pipe.samples)
        groups.setdefault(sig, []).append(i)
    return [PipelineGroup(tuple(ix), sig) for sig, ix in groups.items()]


# -- device names ------------------------------------------------------------------------------

_INDEXED = re.compile(r"^(?P<node>.+)/(?P<idx>\d+)$")


def compress_indices(values: Sequence[int]) -> str:
    """``[0,1,2,3,7,9,10]`` -> ``0-3,7,9-10``."""
    out: list[str] = []
    vals = sorted(set(values))
    start = prev = vals[0]
    for v in vals[1:] + [None]:  # type: ignore[operator]
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def _name_runs(names: Sequence[str]) -> list[str]:
    """Per node, ``node0/0``, ``node0/1``, ... -> ``node0/0-1``; other names as they are."""
    by_node: "OrderedDict[str, list[int]]" = OrderedDict()
    loose: list[str] = []
    for n in names:
        m = _INDEXED.match(n)
        if m:
            by_node.setdefault(m["node"], []).append(int(m["idx"]))
        else:
            loose.append(n)
    pieces = [f"{node}/{compress_indices(ix)}" for node, ix in by_node.items()]
    return pieces + loose


def compress_devices(names: Sequence[str], cluster: "ClusterSpec", width: int = _DEVICES_WIDTH) -> str:
    """A short text for a set of devices: ``node0/0-3``, or ``12x V100-16GB @node1`` when long."""
    if not names:
        return "-"
    text = ", ".join(_name_runs(names))
    if len(text) <= width:
        return text
    types = Counter(cluster.device(d).type for d in names)
    nodes = list(dict.fromkeys(cluster.device(d).node for d in names))
    what = " + ".join(f"{n}x {t}" for t, n in types.items())
    where = f"@{nodes[0]}" if len(nodes) == 1 else f"@{len(nodes)} nodes"
    return f"{what} {where}"


# -- the table ---------------------------------------------------------------------------------

def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _stage_rows(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec", group: PipelineGroup) -> list[list[str]]:
    rows = []
    first = plan.pipelines[group.indices[0]]
    pipe_label = str(group.indices[0]) if group.count == 1 else f"{compress_indices(group.indices)} x{group.count}"
    for s, stage in enumerate(first.stages):
        members = [plan.pipelines[i].stages[s] for i in group.indices]
        devices = [d for st in members for d in st.devices]
        types = " + ".join(dict.fromkeys(cluster.device(d).type for d in stage.devices))
        if plan.dtype == "per_device":  # the dtype each type computes in, beside it
            types = " + ".join(dict.fromkeys(f"{cluster.device(d).type} {plan.compute_dtype(d)}" for d in devices))
        compute = max(score.stage_costs[i][s].compute_s for i in group.indices)
        send = max(score.stage_costs[i][s].send_s for i in group.indices)
        used = max(score.memory_bytes[d] for d in devices)
        cap = min(score.memory_capacity_bytes[d] for d in devices)
        worst = min((score.memory_capacity_bytes[d] - score.memory_bytes[d]) / score.memory_capacity_bytes[d]
                    for d in devices)
        batch = f"{first.micro_batch_size}x{first.num_micro_batches} ({first.samples})"
        rows.append([
            pipe_label if s == 0 else "",
            str(s),
            compress_devices(devices, cluster),
            types,
            str(stage.tp),
            f"[{stage.layers[0]},{stage.layers[1]})",
            batch if s == 0 else "",
            _fmt_ms(compute),
            _fmt_ms(send) if s + 1 < len(first.stages) else "-",
            f"{used / GiB:.1f}/{cap / GiB:.0f}",
            f"{worst * 100:.0f}%" + (" OVER" if worst < 0 else ""),
        ])
    return rows


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """Lines of an aligned table: the header, a rule of dashes, one line per row; two spaces between columns.

    Columns whose index is in ``right`` are right-aligned (numbers), the others
    left-aligned; trailing blanks are dropped.
    """
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        return "  ".join(r[c].rjust(widths[c]) if c in right else r[c].ljust(widths[c])
                         for c in range(len(header))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [fmt(header), rule, *(fmt(r) for r in rows)]


def _shares_lines(plan: "Plan", cluster: "ClusterSpec") -> list[str]:
    """Per-rank batch shares of a pure-DP plan, runs of equal shares folded."""
    shares = plan.rank_shares()
    runs: list[tuple[int, list[str]]] = []
    for dev in cluster.devices:
        share = shares.get(dev.name, 0)
        if runs and runs[-1][0] == share and cluster.device(runs[-1][1][-1]).node == dev.node:
            runs[-1][1].append(dev.name)
        else:
            runs.append((share, [dev.name]))
    if len(runs) <= _MAX_SHARE_RUNS:
        parts = [f"{', '.join(_name_runs(names))}: {share}" + (" each" if len(names) > 1 else "")
                 for share, names in runs]
        return ["per-rank batch shares (samples):"] + [f"  {p}" for p in parts]
    by_kind: "OrderedDict[tuple[str, int], int]" = OrderedDict()
    for dev in cluster.devices:
        key = (dev.type, shares.get(dev.name, 0))
        by_kind[key] = by_kind.get(key, 0) + 1
    return ["per-rank batch shares (samples), by device type:"] + [
        f"  {dtype}: {n} rank{'s' if n > 1 else ''} x {share}" for (dtype, share), n in by_kind.items()]


def _shard_lines(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec") -> list[str]:
    """Per rank of an fsdp plan: its fraction of every flat parameter and its memory by part (ranks alike in type,
    node, fraction and memory folded)."""
    runs: list[tuple[tuple, list[str]]] = []
    for dev in cluster.devices:
        if dev.name not in plan.shards:
            continue
        parts = score.memory_parts.get(dev.name, {})
        key = (round(plan.shards[dev.name], 4), tuple(round(v / GiB, 2) for v in parts.values()),
               round(score.memory_bytes.get(dev.name, 0.0) / GiB, 2), dev.type)
        if runs and runs[-1][0] == key and cluster.device(runs[-1][1][-1]).node == dev.node:
            runs[-1][1].append(dev.name)
        else:
            runs.append((key, [dev.name]))
    lines = ["per-rank shards (fraction of every flat parameter) and memory (GiB):"]
    for _, names in runs:
        d = names[0]
        parts = score.memory_parts.get(d, {})
        detail = " + ".join(f"{k} {v / GiB:.2f}" for k, v in parts.items())
        cap = score.memory_capacity_bytes.get(d, 0.0)
        lines.append(f"  {', '.join(_name_runs(names))}: {plan.shards[d]:.4f}"
                     + (" each" if len(names) > 1 else "")
                     + f"; {detail} = {score.memory_bytes.get(d, 0.0) / GiB:.2f} of {cap / GiB:.1f}")
    return lines


def plan_table(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec") -> str:
    """A readable fixed-width table of ``plan`` with the cost model's figures from ``score``."""
    used = set(plan.used_devices)
    header_lines = [
        f"plan for cluster `{cluster.name}` ({cluster.num_devices} devices, {len(used)} used), "
        f"model `{plan.model.get('name', '?')}` ({plan.model.get('num_layers', '?')} layers, "
        f"{_fmt_params(plan.model.get('total_params'))} params)",
        f"mode {plan.mode}, global batch {plan.global_batch_size}, {plan.dtype}, ZeRO-{plan.zero_stage}, "
        f"{plan.num_pipelines} pipeline{'s' if plan.num_pipelines != 1 else ''}",
        "",
    ]
    header = ["pipeline", "stage", "devices", "type", "tp", "layers", "micro-batch x n (samples)",
              "ms/mb", "send ms", "mem GiB used/cap", "headroom"]
    rows: list[list[str]] = []
    for group in group_pipelines(plan, cluster):
        rows.extend(_stage_rows(plan, score, cluster, group))
    lines = header_lines + format_table(header, rows, right={1, 4, 7, 8, 9, 10})
    slowest = max(score.pipeline_times_s)
    lines += [
        "",
        f"predicted step time: {score.step_time_s * 1e3:.1f} ms   throughput: {score.samples_per_s:.1f} samples/s",
        f"  = slowest pipeline {slowest * 1e3:.1f} ms + gradient sync {score.sync_time_s * 1e3:.1f} ms"
        f" ({score.grad_dtype} gradients) + optimizer update {score.update_time_s * 1e3:.1f} ms",
    ]
    if score.compute:
        lines.append(f"  compute priced by: {score.compute}")
    if score.network:
        lines.append(f"  communication priced by: {score.network}")
    if plan.compression.get("inter_node"):
        lines.append(f"  gradient compression: {plan.compression['inter_node']} between nodes (hierarchical: node sums "
                     "uncompressed, the node leaders' exchange compressed; compression=planned runs it)")
    lines += _money_lines(plan, score, cluster)
    dev, need, cap = score.worst_memory()
    verdict = "fits" if score.fits else "DOES NOT FIT"
    lines.append(f"memory: {verdict}; least headroom on {dev} ({cluster.device(dev).type}): "
                 f"{need / GiB:.1f} of {cap / GiB:.1f} GiB ({(cap - need) / cap * 100:.0f}% free)")
    lines += _idle_lines(plan, cluster, used)
    if plan.is_pure_dp:
        lines += _shares_lines(plan, cluster)
    if plan.shards:
        lines += _shard_lines(plan, score, cluster)
    if plan.experts:
        lines += _expert_lines(plan, cluster)
    lines += _dtype_rate_lines(plan, cluster, used)
    return "\n".join(lines)


def _money_lines(plan: "Plan", score: "PlanScore", cluster: "ClusterSpec") -> list[str]:
    """The used devices' price ($/hour: idle devices are not rented) and $/iteration, and the objective."""
    from het_strategy.core.pricing import plan_price

    price = plan_price(plan, cluster, score.step_time_s)
    goal = plan.predicted.get("objective")
    goal = goal if isinstance(goal, dict) else {"objective": "time"}
    limits = []
    if goal.get("budget_per_hour"):
        limits.append(f"budget ${goal['budget_per_hour']:g}/hour")
    if goal.get("min_throughput"):
        limits.append(f"floor {goal['min_throughput']:g} samples/s")
    objective = f"objective: {goal.get('objective', 'time')}" + (f" ({', '.join(limits)})" if limits else "")
    if price.dollars_per_hour is None or price.dollars_per_iteration is None:
        return [f"cost: unknown (no price_per_hour for {', '.join(price.unpriced_types)}); {objective}"]
    return [f"cost: ${price.dollars_per_hour:.2f}/hour for the {price.num_used} used device"
            f"{'s' if price.num_used != 1 else ''} (list prices), ${_fmt_money(price.dollars_per_iteration)}"
            f"/iteration; {objective}"]


def _fmt_money(dollars: float) -> str:
    return f"{dollars:.2f}" if dollars >= 1 else f"{dollars:.3g}"


def _idle_lines(plan: "Plan", cluster: "ClusterSpec", used: Collection[str]) -> list[str]:
    """Idle devices, those with the same reason on one line (``plan.idle_reasons``; older plans have none)."""
    idle = [d.name for d in cluster.devices if d.name not in used]
    if not idle:
        return []
    if not any(name in plan.idle_reasons for name in idle):  # a hand-made or older plan: no reasons recorded
        return [f"idle devices ({len(idle)}): {', '.join(_name_runs(idle))}"]
    by_reason: "OrderedDict[str, list[str]]" = OrderedDict()
    for name in idle:
        by_reason.setdefault(plan.idle_reasons.get(name, "no reason recorded in the plan"), []).append(name)
    lines = [f"idle devices ({len(idle)}):"]
    for reason, names in by_reason.items():
        lines.append(f"  {compress_devices(names, cluster, width=60)}: {reason}")
    return lines


def _dtype_rate_lines(plan: "Plan", cluster: "ClusterSpec", used: Collection[str]) -> list[str]:
    """A note for device types without a rate for the dtype they compute in: the cost model runs them at their
    fp32 rate."""
    slow: dict[str, list[str]] = {}  # dtype -> the types without its rate
    for d in cluster.devices:
        dtype = plan.compute_dtype(d.name) if d.name in used else None
        if dtype is not None and dtype not in d.tflops and d.type not in slow.get(dtype, []):
            slow.setdefault(dtype, []).append(d.type)
    return [f"note: {dtype} runs at the fp32 rate on {', '.join(sorted(types))} (no {dtype} figure for "
            f"{'that type' if len(types) == 1 else 'those types'}: no {dtype} units in the catalog)"
            for dtype, types in slow.items()]


def _expert_lines(plan: "Plan", cluster: "ClusterSpec") -> list[str]:
    """Experts per device of each MoE layer; layers with the same counts share a line."""
    by_counts: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for layer in sorted(plan.experts):
        mapping = plan.experts[layer]
        key = tuple((d.name, len(mapping.get(d.name, []))) for d in cluster.devices if d.name in mapping)
        by_counts.setdefault(key, []).append(layer)
    lines = [f"expert placement ({len(plan.experts)} MoE layer(s); ids in plan.json `experts`):"]
    for key, layers in by_counts.items():
        groups: dict[int, list[str]] = {}
        for name, n in key:
            groups.setdefault(n, []).append(name)
        parts = [f"{', '.join(_name_runs(names))}: {n} expert{'s' if n != 1 else ''}" for n, names in groups.items()]
        lines.append(f"  layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}: " + "; ".join(parts))
    return lines


def _fmt_params(n: object) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))
