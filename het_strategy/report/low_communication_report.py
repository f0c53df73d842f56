"""The low-communication report: a ``hetero_diloco`` plan beside the synchronous plan, as fixed-width text.

``low_communication_report`` prints, for ``het-plan planner.mode=low_communication``:

1. the groups: per group and device kind, the samples per inner step, the
   micro-batch, the compute and the group's sync + update (devices alike in
   one group folded into one row);
2. the outer sync: H, codec, the inner step (and the even split's), the
   exchange, the round, the sync overhead against its budget, the bytes that
   cross nodes per round and per sample;
3. every codec's candidate (``H_c``, exchange, round, overhead, feasible);
4. the synchronous plan (joint compression) and the low-communication plan
   side by side, and the recommendation line (``PlanResult.summary``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from het_strategy.report.table import compress_devices, format_table

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.planning.planner import PlanResult

__all__ = ["low_communication_report"]


def _time(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms" if seconds < 10 else f"{seconds:.4g} s"


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def low_communication_report(result: "PlanResult", cluster: "ClusterSpec") -> str:
    """The report of a ``mode=low_communication`` result (module docstring)."""
    low = result.low_communication
    assert low is not None and low.plan.outer_sync is not None
    plan, sync, cost, fig = result.plan, low.plan.outer_sync, low.cost, result.plan.predicted
    shares = {pipe.stages[0].devices[0]: (pipe.samples, pipe.micro_batch_size) for pipe in plan.pipelines}
    lines = [f"low-communication plan for cluster `{cluster.name}` ({cluster.num_devices} devices in "
             f"{len(sync.groups)} groups), model `{plan.model.get('name', '?')}`, global batch "
             f"{plan.global_batch_size}, {plan.dtype}", ""]
    rows = []
    for g, group in enumerate(sync.groups):
        kinds: dict[tuple, list[str]] = {}
        for d in group:
            kinds.setdefault((cluster.device(d).type, *shares[d]), []).append(d)
        for (kind, samples, mb), names in kinds.items():
            rows.append([str(g), compress_devices(names, cluster), kind, str(samples), str(mb),
                         _time(cost.compute_s(names[0], samples)), _time(cost.post_s(g)),
                         _time(cost.device_step_s(names[0], samples))])
    lines += format_table(["group", "devices", "type", "samples/step", "micro-batch", "compute",
                           "sync+update", "inner step"], rows, right={0, 3, 4, 5, 6, 7})
    budget = low.budget
    lines += [
        "",
        f"inner split {fig.get('inner_split', budget.split)}: inner step {_time(fig['inner_step_s'])} "
        f"(even split: {_time(low.even_inner_step_s)})",
        f"outer sync: every H={sync.inner_steps} inner steps, codec {sync.codec}: exchange {_time(fig['exchange_s'])} "
        f"(payload {_bytes(fig['payload_bytes'])} per group; {_bytes(fig['exchange_bytes_per_round'])} across "
        "nodes per round)",
        f"round: {sync.inner_steps} x {_time(fig['inner_step_s'])} + {_time(fig['exchange_s'])} = "
        f"{_time(fig['round_s'])}; sync overhead {fig['sync_overhead'] * 100:.1f}% (budget "
        f"{budget.max_sync_overhead * 100:g}%); {_bytes(fig['bytes_per_sample'])} across nodes per sample",
        "",
        f"candidates (max H {budget.max_inner_steps}, max sync overhead {budget.max_sync_overhead * 100:g}%):",
    ]
    lines += format_table(["codec", "H_c", "exchange", "round", "overhead", "feasible"],
                          [[str(c.codec), str(c.inner_steps), _time(c.exchange_s), _time(c.round_s),
                            f"{c.sync_overhead * 100:.1f}%", "yes" if c.feasible else "no"]
                           for c in low.candidates], right={1, 2, 3, 4})
    if low.splits:
        lines += ["", "group splits (groups=planned; the least time per sample, ties to the fewest groups):"]
        lines += format_table(["groups", "split", "time per step", "chosen"],
                              [[str(len(split)), " | ".join(compress_devices(list(g), cluster) for g in split),
                                _time(step_s), "yes" if split == sync.groups else ""]
                               for split, step_s in low.splits], right={0, 2})
    lines += ["", *_side_by_side(result)]
    line = result.summary()
    if line:
        lines.append(line)
    return "\n".join(lines)


def _side_by_side(result: "PlanResult") -> list[str]:
    plan = result.plan
    low_step = plan.predicted["step_time_s"]
    sync_plan = None if result.joint is None else result.joint.plan
    header = ["", "synchronous (joint compression)", "low_communication"]
    if sync_plan is None:
        return ["synchronous plan: none fits (joint search over data parallelism x inter-node compression)"]
    s_step = sync_plan.predicted["step_time_s"]
    B = plan.global_batch_size
    assert plan.outer_sync is not None
    h = plan.outer_sync.inner_steps
    rows = [
        ["plan", f"{len(sync_plan.used_devices)} devices, {sync_plan.compression.get('inter_node', 'none')} "
                 "between nodes", f"H={plan.outer_sync.inner_steps}, {plan.outer_sync.codec}, "
                 f"{len(plan.outer_sync.groups)} groups"],
        ["time per step", _time(s_step), _time(low_step) + " (round / H)"],
        ["time per sample", _time(s_step / B), _time(low_step / B)],
        ["samples/s", f"{B / s_step:.1f}", f"{B / low_step:.1f}"],
        ["synced", "every step", f"every {h} step{'s' if h != 1 else ''} ({_time(plan.predicted['round_s'])} "
                                 "per round)"],
    ]
    return format_table(header, rows)
