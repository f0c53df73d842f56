"""The plan picture: what each device does in a step, as a PNG.

``plot_plan`` saves the figure ``plan_figure`` builds (atomically):

* a pure data-parallel plan (one single-device stage per replica, every layer
  on each): one row per device in rank order, a panel of each device's share of
  the global batch (samples) and a time axis of its predicted step split into
  compute | idle (waiting for the slowest rank) | gradient sync | optimizer
  update, from the cost model's figures (``core.plan_score.dp_step_times``);
  given a run's measured split per rank, a hatched measured bar (with data
  loading) under each predicted one;
* any other plan: a Gantt-like picture, a bar over the layer range each device
  holds, coloured by device type and labelled with its batch share (and the
  experts it holds per MoE layer).

Beyond 64 devices a row stands for a group of identical pipelines
(``table.group_pipelines``; a dp group's bars are its members' means).  Each bar
series carries a label (``"predicted compute"``, ``"measured sync"``, ``"share"``)
so the figure reads back before it is saved.  matplotlib is imported inside the
functions that draw only, so importing this module stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from het_strategy.core.atomic_file import replacing
from het_strategy.core.plan_score import DeviceStepTimes, dp_step_times
from het_strategy.report.table import compress_devices, compress_indices, group_pipelines

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan import Plan
    from het_strategy.core.plan_score import PlanScore

__all__ = ["plot_plan", "plan_figure", "dp_figure", "can_draw", "PARTS"]

_MAX_DEVICE_ROWS = 64

PARTS = (("compute", "compute_s", "#4c72b0"), ("idle", "idle_s", "#d9d9d9"), ("sync", "sync_s", "#dd8452"),
         ("update", "update_s", "#55a868"), ("data", "data_s", "#8172b3"))
"""The parts of a dp step, left to right: (name, ``DeviceStepTimes`` field, colour)."""


def can_draw() -> bool:
    """Whether matplotlib (an optional dependency) is installed; importing it here, on use only."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_plan(plan: "Plan", cluster: "ClusterSpec", path: str | Path,
              measured: Sequence[DeviceStepTimes] | None = None,
              figures: "PlanScore | Mapping[str, Any] | None" = None) -> Path:
    """Save the picture of ``plan`` (``plan_figure``) as a PNG at ``path``, atomically; returns the path."""
    fig = plan_figure(plan, cluster, measured, figures)
    with replacing(path, suffix=".tmp.png") as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)


def plan_figure(plan: "Plan", cluster: "ClusterSpec", measured: Sequence[DeviceStepTimes] | None = None,
                figures: "PlanScore | Mapping[str, Any] | None" = None) -> "Figure":
    """The picture of ``plan``: the dp step picture for a pure data-parallel plan, else the layer picture.

    ``figures``: the cost model's figures of the plan (default: ``plan.predicted``); ``measured``: a run's
    measured split per rank, in rank order (dp plans only).
    """
    if not plan.is_pure_dp:
        return _layer_figure(plan, cluster)
    names = [d.name for d in cluster.devices]
    predicted = dp_step_times(plan, plan.predicted if figures is None else figures, names)
    return dp_figure(plan, cluster, predicted, measured)


# -- the data-parallel step picture -------------------------------------------------------------

def _dp_rows(plan: "Plan", cluster: "ClusterSpec") -> tuple[list[tuple[str, list[int]]], str]:
    """(label, ranks) per row, and the rows' axis label: ranks in order, or groups beyond 64 devices."""
    if cluster.num_devices <= _MAX_DEVICE_ROWS:
        used = set(plan.used_devices)
        return [(f"{r}: {d.name} ({d.type})" + ("" if d.name in used else ", idle"), [r])
                for r, d in enumerate(cluster.devices)], "rank"
    rank = {d.name: r for r, d in enumerate(cluster.devices)}
    rows = []
    for group in group_pipelines(plan, cluster):
        names = [plan.pipelines[i].stages[0].devices[0] for i in group.indices]
        rows.append((f"{compress_devices(names, cluster)} (x{group.count})", [rank[n] for n in names]))
    used = set(plan.used_devices)
    idle = [d.name for d in cluster.devices if d.name not in used]
    if idle:
        rows.append((f"idle: {compress_devices(idle, cluster)}", [rank[n] for n in idle]))
    return rows, "group of identical devices (means)"


def _mean(times: Sequence[DeviceStepTimes], ranks: list[int], field: str) -> float:
    return sum(float(getattr(times[r], field)) for r in ranks) / len(ranks)


def dp_figure(plan: "Plan", cluster: "ClusterSpec", predicted: Sequence[DeviceStepTimes] | None,
              measured: Sequence[DeviceStepTimes] | None = None) -> "Figure":
    """The dp step picture: shares (samples) beside each rank's step split (ms), predicted and measured.

    ``predicted`` / ``measured``: one entry per device of ``cluster`` in rank order (None: not drawn; without
    predicted times the panel says so).  Bar series are labelled ``"share"``, ``"predicted <part>"`` and
    ``"measured <part>"`` (parts: ``PARTS``), one bar per row, widths in samples and milliseconds.
    """
    from matplotlib.figure import Figure

    for name, times in (("predicted", predicted), ("measured", measured)):
        if times is not None and [t.device for t in times] != [d.name for d in cluster.devices]:
            raise ValueError(f"{name} step times must list the devices of cluster `{cluster.name}` in rank order")
    rows, ylabel = _dp_rows(plan, cluster)
    both = predicted is not None and measured is not None
    height = max(2.8, (0.5 if both else 0.32) * len(rows) + 1.9)
    fig = Figure(figsize=(12, height), dpi=110)
    share_ax, time_ax = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [1, 4]})
    share_ax.set_label("shares")
    time_ax.set_label("times")
    _draw_shares(share_ax, plan, cluster, rows)
    series = [s for s in (("predicted", predicted), ("measured", measured)) if s[1] is not None]
    offsets = {"predicted": -0.2, "measured": 0.2} if both else {s[0]: 0.0 for s in series}
    longest = max((t.step_s for _, times in series for t in times or ()), default=0.0) * 1e3
    for kind, times in series:
        assert times is not None
        _draw_split(time_ax, kind, times, rows, offsets[kind], 0.38 if both else 0.7, longest)
    time_ax.set_xlim(0, longest * 1.25 or 1.0)  # room for the text at the bars' ends
    if not series:
        time_ax.text(0.5, 0.5, "no predicted times: the plan was never scored (het-plan score=<plan.json>)",
                     transform=time_ax.transAxes, ha="center", va="center", fontsize=8, color="grey")
    share_ax.set_yticks(range(len(rows)))
    share_ax.set_yticklabels([label for label, _ in rows], fontsize=7)
    share_ax.set_ylim(len(rows) - 0.5, -0.5)  # rank 0 on top
    share_ax.set_ylabel(ylabel)
    time_ax.set_xlabel("milliseconds of one training step" + (" (solid: predicted, hatched: measured)" if both
                                                               else ""))
    time_ax.legend(handles=_legend(series), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   frameon=False)
    fig.suptitle(_dp_title(plan, predicted, measured), fontsize=9)
    fig.tight_layout()
    return fig


def _draw_shares(ax: Any, plan: "Plan", cluster: "ClusterSpec", rows: list[tuple[str, list[int]]]) -> None:
    """Samples of each global batch per row (a group's: each member's mean), the value beside the bar."""
    shares = plan.rank_shares()
    per_rank = [float(shares.get(d.name, 0)) for d in cluster.devices]
    values = [sum(per_rank[r] for r in ranks) / len(ranks) for _, ranks in rows]
    ax.barh(range(len(rows)), values, height=0.7, color="#8c8c8c", label="share")
    for y, v in enumerate(values):
        ax.text(v, y, f" {v:g}", va="center", fontsize=7)
    ax.set_xlim(0, max(values + [1.0]) * 1.35)
    ax.set_xlabel(f"samples of {plan.global_batch_size}")


def _draw_split(ax: Any, kind: str, times: Sequence[DeviceStepTimes], rows: list[tuple[str, list[int]]],
                offset: float, height: float, longest_ms: float) -> None:
    """One stacked bar per row: the parts of ``PARTS`` left to right, in ms, a part's value written in it where
    it is wide enough; the step's length and the idle time at the bar's end."""
    ys = [y + offset for y in range(len(rows))]
    left = [0.0] * len(rows)
    for part, field, color in PARTS:
        if part == "data" and kind == "predicted":
            continue  # the cost model does not price data loading
        widths = [_mean(times, ranks, field) * 1e3 for _, ranks in rows]
        ax.barh(ys, widths, left=left, height=height, color=color, edgecolor="black", linewidth=0.4,
                hatch="///" if kind == "measured" else None, label=f"{kind} {part}")
        for y, x, w in zip(ys, left, widths):
            if w > 0.12 * longest_ms:
                ax.text(x + w / 2, y, f"{part} {w:.4g}", ha="center", va="center", fontsize=6,
                        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.7, "pad": 1})
        left = [a + w for a, w in zip(left, widths)]
    for y, end, (_, ranks) in zip(ys, left, rows):
        idle = _mean(times, ranks, "idle_s") * 1e3
        idle = idle if idle > 1e-6 * end else 0.0  # rounding of the parts' sum, not a wait
        ax.text(end, y, f" {end:.4g} ms (idle {idle:.3g})", va="center", fontsize=6)


def _legend(series: list[tuple[str, Any]]) -> list[Any]:
    from matplotlib.patches import Patch

    measured = any(kind == "measured" for kind, _ in series)
    handles = [Patch(facecolor=color, edgecolor="black", label=part) for part, _, color in PARTS
               if part != "data" or measured]
    if len(series) == 2:
        handles += [Patch(facecolor="white", edgecolor="black", label="predicted"),
                    Patch(facecolor="white", edgecolor="black", hatch="///", label="measured")]
    return handles


def _dp_title(plan: "Plan", predicted: Sequence[DeviceStepTimes] | None,
              measured: Sequence[DeviceStepTimes] | None) -> str:
    plural = "s" if plan.num_pipelines != 1 else ""
    title = (f"{plan.cluster} / {plan.model.get('name', '?')}: global batch {plan.global_batch_size}, "
             f"mode {plan.mode}, data parallel over {plan.num_pipelines} device{plural}")
    parts = []
    if predicted:
        step = predicted[0].step_s
        parts.append(f"predicted {step * 1e3:.1f} ms/step, {plan.global_batch_size / step:.1f} samples/s"
                     if step > 0 else "predicted 0 ms/step")
    if measured:
        step = sum(t.step_s for t in measured) / len(measured)
        parts.append(f"measured {step * 1e3:.1f} ms/step (mean over ranks and steps)")
    return title + ("\n" + "; ".join(parts) if parts else "")


# -- the layer picture (pipelines) --------------------------------------------------------------

def _layer_rows(plan: "Plan", cluster: "ClusterSpec") -> tuple[list[tuple[str, list[tuple[int, int, str, str]]]], str]:
    """Rows (label, [(start, stop, device type, text)]) and the rows' axis label."""
    rows: list[tuple[str, list[tuple[int, int, str, str]]]] = []
    if cluster.num_devices <= _MAX_DEVICE_ROWS:
        where: dict[str, tuple[int, int]] = {}
        for p, pipe in enumerate(plan.pipelines):
            for s, st in enumerate(pipe.stages):
                for d in st.devices:
                    where[d] = (p, s)
        for dev in cluster.devices:
            if dev.name not in where:
                rows.append((f"{dev.name} ({dev.type})", []))
                continue
            p, s = where[dev.name]
            pipe, st = plan.pipelines[p], plan.pipelines[p].stages[s]
            text = f"p{p} s{s}" + (f" tp{st.tp}" if st.tp > 1 else "") + \
                f" | {pipe.micro_batch_size}x{pipe.num_micro_batches} = {pipe.samples} samples"
            held = [len(plan.experts[layer].get(dev.name, [])) for layer in sorted(plan.experts)]
            if any(held):
                text += " | experts " + "+".join(map(str, held))
            rows.append((f"{dev.name} ({dev.type})", [(st.layers[0], st.layers[1], dev.type, text)]))
        return rows, "device"
    for group in group_pipelines(plan, cluster):
        pipe = plan.pipelines[group.indices[0]]
        label = (f"pipe {group.indices[0]}" if group.count == 1
                 else f"pipes {compress_indices(group.indices)} (x{group.count})")
        bars = []
        for s, st in enumerate(pipe.stages):
            dtype = cluster.device(st.devices[0]).type
            share = f" | {pipe.samples} samples" + (" each" if group.count > 1 else "")
            text = f"s{s} " + (f"{st.tp}x " if st.tp > 1 else "") + dtype + (share if s == 0 else "")
            bars.append((st.layers[0], st.layers[1], dtype, text))
        rows.append((label, bars))
    used = set(plan.used_devices)
    idle = [d for d in cluster.devices if d.name not in used]
    if idle:
        rows.append((f"idle: {compress_devices([d.name for d in idle], cluster)}", []))
    return rows, "group of identical pipelines"


def _layer_figure(plan: "Plan", cluster: "ClusterSpec") -> "Figure":
    """Rows of devices (or pipeline groups), bars over the layer ranges they hold, coloured by device type."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    num_layers = int(plan.model.get("num_layers") or max(p.stages[-1].layers[1] for p in plan.pipelines))
    types = list(cluster.device_types)
    palette = colormaps["tab10"]
    color = {t: palette(i % 10) for i, t in enumerate(types)}
    rows, ylabel = _layer_rows(plan, cluster)
    fig = Figure(figsize=(11, max(2.5, 0.32 * len(rows) + 1.6)), dpi=110)
    ax = fig.subplots()
    for y, (label, bars) in enumerate(rows):
        for start, stop, dtype, text in bars:
            ax.barh(y, stop - start, left=start, height=0.8, color=color.get(dtype, "grey"),
                    edgecolor="black", linewidth=0.5)
            ax.text((start + stop) / 2, y, text, ha="center", va="center", fontsize=7, clip_on=True)
        if not bars:
            ax.text(num_layers / 2, y, "idle", ha="center", va="center", fontsize=7, color="grey")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r[0] for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)  # first row on top, every row (idle ones too) in view
    ax.set_xlim(0, num_layers)
    ax.set_xlabel(f"layer (0 = embedding, {num_layers - 1} = head)")
    ax.set_ylabel(ylabel)
    title = f"{plan.cluster} / {plan.model.get('name', '?')}: global batch {plan.global_batch_size}, mode {plan.mode}"
    pred = plan.predicted or {}
    if "step_time_s" in pred:
        title += f"\npredicted {pred['step_time_s'] * 1e3:.1f} ms/step, {pred.get('samples_per_s', 0):.1f} samples/s"
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(color=color[t], label=t) for t in types], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig
