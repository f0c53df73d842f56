"""The plan picture: a Gantt-like PNG of who holds which layers.

``plot_plan`` draws one row per device (or per group of identical pipelines
beyond 64 devices), a bar over the layer range each holds, coloured by device
type and labelled with its batch share (and the experts it holds per MoE
layer).  matplotlib is imported inside ``plot_plan`` only, so importing this
module stays light.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from het_strategy.core.atomic_file import replacing
from het_strategy.report.table import compress_devices, compress_indices, group_pipelines

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.core.plan import Plan

__all__ = ["plot_plan"]

_MAX_DEVICE_ROWS = 64


def plot_plan(plan: "Plan", cluster: "ClusterSpec", path: str | Path) -> Path:
    """Save a Gantt-like PNG of ``plan``: rows of devices (or pipeline groups), bars over layer ranges.

    Rows are devices in rank order when the cluster has at most 64 of them;
    otherwise one row per group of identical pipelines.  Bars are coloured by
    device type and labelled with the batch share (and experts held per MoE
    layer); idle devices get an empty row.
    The file is written atomically.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_layers = int(plan.model.get("num_layers") or max(p.stages[-1].layers[1] for p in plan.pipelines))
    types = list(cluster.device_types)
    palette = plt.get_cmap("tab10")
    color = {t: palette(i % 10) for i, t in enumerate(types)}

    # rows: (label, [(start, stop, device type, text)])
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
        ylabel = "device"
    else:
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
        ylabel = "group of identical pipelines"

    height = max(2.5, 0.32 * len(rows) + 1.6)
    fig, ax = plt.subplots(figsize=(11, height), dpi=110)
    try:
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
        with replacing(path, suffix=".tmp.png") as tmp:
            fig.savefig(tmp, format="png")
        return Path(path)
    finally:
        plt.close(fig)

