"""The data-parallel step picture: shares and the cost model's compute | idle | sync | update per rank, the measured
split beside it, StepTelemetry's measured means and RunReport's end-of-training picture."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from het_strategy.core.cluster import cluster_from_dict, load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.plan_score import DeviceStepTimes, dp_step_times
from het_strategy.core.workload import load_workload
from het_strategy.planning.strategy_plans import data_parallel_plan, data_parallel_settings

pytest.importorskip("matplotlib")

from het_strategy.report.picture import PARTS, plan_figure, plot_plan  # noqa: E402


@pytest.fixture(scope="module")
def planned() -> tuple[Any, Any, Plan, Any]:
    """The planner's dp plan of the tiny GPT on the shipped 4-rank mixed-speed CPU cluster, and its score."""
    cluster, workload = load_cluster("local_cpu4_mixed"), load_workload("tiny_gpt", dtype="fp32")
    plan = data_parallel_plan(cluster, workload, 32, "fp32")
    score = CostModel(cluster, workload, data_parallel_settings(32, "fp32")).score(plan)
    return cluster, workload, plan, score


def _bars(fig: Any, axes: str) -> dict[str, list[Any]]:
    """Bar series of the axes labelled ``axes``, by label: their rectangles, one per row."""
    (ax,) = [a for a in fig.axes if a.get_label() == axes]
    return {c.get_label(): list(c.patches) for c in ax.containers}


def test_the_dp_picture_shows_each_ranks_share_and_the_cost_models_split(planned) -> None:
    cluster, _, plan, score = planned
    fig = plan_figure(plan, cluster, figures=score)
    shares = [r.get_width() for r in _bars(fig, "shares")["share"]]
    assert shares == [plan.rank_shares()[d.name] for d in cluster.devices] == [11, 12, 6, 3]
    bars = _bars(fig, "times")
    assert set(bars) == {f"predicted {p}" for p, _, _ in PARTS if p != "data"}
    width = {part: [r.get_width() for r in rects] for part, rects in bars.items()}
    step_ms = score.step_time_s * 1e3
    for r, dev in enumerate(cluster.devices):
        compute = score.pipeline_times_s[r] * 1e3
        sync, update = score.device_sync_s[dev.name] * 1e3, score.device_update_s[dev.name] * 1e3
        assert width["predicted compute"][r] == pytest.approx(compute)
        assert width["predicted sync"][r] == pytest.approx(sync)
        assert width["predicted update"][r] == pytest.approx(update)
        assert width["predicted idle"][r] == pytest.approx(step_ms - compute - sync - update)
        end = bars["predicted update"][r]
        assert end.get_x() + end.get_width() == pytest.approx(step_ms)  # every bar is the predicted step long
    # rank 0 (speed 1, 11 samples) finishes its compute first and waits for the others: the only idle in the plan
    assert width["predicted idle"][0] == pytest.approx((max(score.pipeline_times_s) - score.pipeline_times_s[0]) * 1e3)
    assert width["predicted idle"][0] > 50 and max(width["predicted idle"][1:]) < 1e-6


def test_the_plans_own_figures_give_the_same_picture_and_a_png_is_written(planned, tmp_path: Path) -> None:
    cluster, _, plan, score = planned
    own = _bars(plan_figure(plan, cluster), "times")  # plan.predicted, as het-plan draws it
    scored = _bars(plan_figure(plan, cluster, figures=score), "times")
    for label in scored:
        assert [r.get_width() for r in own[label]] == pytest.approx([r.get_width() for r in scored[label]])
    out = plot_plan(plan, cluster, tmp_path / "plan.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_dp_step_times_take_each_devices_own_update_and_fall_back_to_the_plan_level_figures() -> None:
    cluster = cluster_from_dict({"name": "av", "nodes": [
        {"name": "a", "devices": [{"type": "A100-40GB", "count": 2}]},
        {"name": "v", "devices": [{"type": "V100-16GB", "count": 2}]}]})
    workload = load_workload("tiny_gpt", dtype="fp32")
    pipes = [Pipeline((Stage((d,), (0, workload.num_layers)),), 4, n) for d, n in (("a/0", 24), ("a/1", 24),
                                                                                     ("v/0", 16))]
    plan = Plan(cluster.name, [d.name for d in cluster.devices], workload.fingerprint(), 64, pipes, mode="manual")
    score = CostModel(cluster, workload, data_parallel_settings(64, "fp32")).score(plan)
    times = dp_step_times(plan, score)
    assert [t.device for t in times] == ["a/0", "a/1", "v/0", "v/1"] and [t.samples for t in times] == [24, 24, 16, 0]
    assert times[0].update_s < times[2].update_s  # the A100's memory is faster: its optimizer update too
    assert times[2].update_s == pytest.approx(score.update_time_s)
    for t in times:
        assert t.compute_s + t.idle_s + t.sync_s + t.update_s == pytest.approx(score.step_time_s)
    assert times[3].compute_s == 0 and times[3].idle_s == pytest.approx(score.step_time_s)  # idle in the plan
    from_json = dp_step_times(plan, score.to_dict())  # a plan file keeps the plan-level sync and update only
    assert [t.update_s for t in from_json[:3]] == pytest.approx([score.update_time_s] * 3)
    assert dp_step_times(plan, {}) is None
    pipeline = Plan(cluster.name, [d.name for d in cluster.devices], workload.fingerprint(), 8, [Pipeline(
        (Stage(("a/0",), (0, 3)), Stage(("v/0",), (3, workload.num_layers))), 2, 8)], mode="manual")
    assert dp_step_times(pipeline, score) is None
    assert {a.get_label() for a in plan_figure(pipeline, cluster).axes} != {"shares", "times"}  # the layer picture


def _measured(cluster: Any) -> list[DeviceStepTimes]:
    figures = [(11, 0.90, 0.020, 0.015, 1.200, 0.040), (12, 1.10, 0.020, 0.015, 1.210, 0.030),
               (6, 1.05, 0.020, 0.015, 1.190, 0.030), (3, 1.12, 0.020, 0.015, 1.205, 0.035)]
    return [DeviceStepTimes(d.name, n, c, s, u, step, data_s=data)
            for d, (n, c, s, u, step, data) in zip(cluster.devices, figures)]


def test_the_measured_split_is_drawn_under_the_predicted_one(planned) -> None:
    cluster, _, plan, score = planned
    measured = _measured(cluster)
    bars = _bars(plan_figure(plan, cluster, measured=measured, figures=score), "times")
    assert {f"measured {p}" for p, _, _ in PARTS} <= set(bars)
    for r, m in enumerate(measured):
        got = {part: bars[f"measured {part}"][r].get_width() for part, _, _ in PARTS}
        assert got == pytest.approx({"compute": m.compute_s * 1e3, "sync": 20.0, "update": 15.0,
                                     "data": m.data_s * 1e3, "idle": (m.step_s - m.compute_s - 0.035 - m.data_s) * 1e3})
        last = bars["measured data"][r]
        assert last.get_x() + last.get_width() == pytest.approx(m.step_s * 1e3)
        # two bars per rank: predicted above, measured below
        assert bars["measured compute"][r].get_y() > bars["predicted compute"][r].get_y()
    assert bars["measured idle"][0].get_width() == pytest.approx(1200 - 900 - 35 - 40)  # the rank that waits longest
    with pytest.raises(ValueError, match="rank order"):
        plan_figure(plan, cluster, measured=measured[::-1], figures=score)


def test_beyond_64_devices_a_row_is_a_group_of_identical_devices(tmp_path: Path) -> None:
    cluster = cluster_from_dict({"name": "big", "nodes": [
        {"name": f"n{i}", "devices": [{"type": "A100-40GB" if i % 2 else "V100-16GB", "count": 8}]}
        for i in range(10)]})  # 40 V100 + 40 A100
    workload = load_workload("tiny_gpt", dtype="fp32")
    names = [d.name for d in cluster.devices]
    shares = {d.name: (3 if d.type == "A100-40GB" else 1) for d in cluster.devices if d.name != "n0/0"}
    pipes = [Pipeline((Stage((d,), (0, workload.num_layers)),), 1, n) for d, n in shares.items()]
    plan = Plan(cluster.name, names, workload.fingerprint(), sum(shares.values()), pipes, mode="manual")
    plan.predicted = CostModel(cluster, workload, data_parallel_settings(plan.global_batch_size, "fp32")).score(
        plan).to_dict()
    fig = plan_figure(plan, cluster)
    share_ax = next(a for a in fig.axes if a.get_label() == "shares")
    labels = [t.get_text() for t in share_ax.get_yticklabels()]
    assert labels == ["39x V100-16GB @5 nodes (x39)", "40x A100-40GB @5 nodes (x40)", "idle: n0/0"]
    assert [r.get_width() for r in _bars(fig, "shares")["share"]] == [1, 3, 0]
    assert plot_plan(plan, cluster, tmp_path / "big.png").stat().st_size > 5000


# -- measured means (StepTelemetry) and the end-of-training picture (RunReport) ------------------

def _window(rows_per_rank: list[list[tuple[float, ...]]]) -> Any:
    """A gathered window [world, steps, FIELDS] from per rank, per step (step, samples, compute, comm, data,
    step_s, share)."""
    import torch

    return torch.tensor([[list(row) + [0.0, 0.0] for row in rank] for rank in rows_per_rank], dtype=torch.float64)


def test_step_telemetry_splits_comm_into_sync_and_waiting_and_restarts_when_the_shares_change() -> None:
    from het_strategy.callbacks.telemetry import StepTelemetry

    telemetry = StepTelemetry(every_n_steps=2, log=False, warmup_steps=1)
    telemetry.runtime = SimpleNamespace(cluster=SimpleNamespace(devices=[SimpleNamespace(name="fast"),
                                                                         SimpleNamespace(name="slow")]))
    assert telemetry.measured_step_times() is None
    # step 0 is warm-up; in steps 1 and 2 the slow rank is ready last, its comm (0.01, 0.03) is the sync
    telemetry._add_to_sums(_window([[(0, 6, 9.0, 9.0, 0.0, 20.0, 6), (1, 6, 0.5, 0.31, 0.02, 0.9, 6)],
                                    [(0, 2, 9.0, 9.0, 0.0, 20.0, 2), (1, 2, 0.8, 0.01, 0.03, 0.9, 2)]]))
    telemetry._add_to_sums(_window([[(2, 6, 0.5, 0.33, 0.02, 0.9, 6), (3, 6, 0.5, 0.3, 0.0, 0.9, 6)],
                                    [(2, 2, 0.8, 0.03, 0.03, 0.9, 2), (3, 2, 0.8, 0.0, 0.0, 0.9, 2)]]))
    fast, slow = telemetry.measured_step_times()
    assert (fast.device, fast.samples, slow.samples) == ("fast", 6, 2)
    assert fast.compute_s == pytest.approx(0.5) and slow.compute_s == pytest.approx(0.8)
    assert fast.sync_s == slow.sync_s == pytest.approx((0.01 + 0.03 + 0.0) / 3)
    assert fast.idle_s == pytest.approx((0.30 + 0.30 + 0.30) / 3) and slow.idle_s == pytest.approx(0.0, abs=1e-12)
    assert fast.data_s == pytest.approx(0.04 / 3) and fast.step_s == pytest.approx(0.9)
    assert fast.update_s == pytest.approx(0.9 - 0.5 - (0.31 + 0.33 + 0.3) / 3 - 0.04 / 3)
    # a rebalance: new shares, the means start again with them
    telemetry._add_to_sums(_window([[(4, 5, 0.4, 0.2, 0.0, 0.7, 5)], [(4, 3, 0.6, 0.0, 0.0, 0.7, 3)]]))
    fast, slow = telemetry.measured_step_times()
    assert (fast.samples, slow.samples, fast.idle_s, fast.compute_s) == (5, 3, pytest.approx(0.2), pytest.approx(0.4))


class WandbLogger:
    """Stands in for Lightning's (recognised by its class name): a run folder and the metrics it got."""

    def __init__(self, folder: Path) -> None:
        self.experiment = SimpleNamespace(dir=str(folder))
        self.metrics: list[dict[str, Any]] = []

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.metrics.append(metrics)


class _Runtime:
    """A ``HeteroRuntime`` with a plan and a cluster (also its own ``run``, as a strategy that holds one)."""

    def __init__(self, plan: Plan, cluster: Any, workload: Any) -> None:
        self.plan, self.cluster, self.workload, self.run = plan, cluster, workload, self
        self.current_local_samples, self.compression_state, self.records = None, None, []

    def current_shares(self) -> list[int]:
        return [self.plan.rank_shares()[d.name] for d in self.cluster.devices]

    def next_safe_step(self) -> int:
        return 0

    def apply_plan(self, plan: Plan, first_step: int) -> None:
        self.plan = plan


def test_run_report_draws_the_measured_split_at_the_end_of_training(planned, tmp_path: Path) -> None:
    from het_strategy.callbacks.run_report import RunReport
    from het_strategy.callbacks.runtime import runtime_of
    from het_strategy.callbacks.telemetry import StepTelemetry

    cluster, workload, plan, _ = planned
    runtime = _Runtime(plan, cluster, workload)
    assert runtime_of(runtime) is runtime
    telemetry = StepTelemetry(log=False, warmup_steps=0)
    telemetry.runtime = runtime
    shares = runtime.current_shares()
    telemetry._add_to_sums(_window([[(0, n, 1.0 + 0.02 * r, 0.1 - 0.02 * r, 0.01, 1.2, n)]
                                    for r, n in enumerate(shares)]))
    wandb_run, csv = WandbLogger(tmp_path / "wandb"), SimpleNamespace(log_dir=str(tmp_path / "csv" / "version_0"))
    (tmp_path / "wandb").mkdir()
    trainer = SimpleNamespace(strategy=runtime, callbacks=[telemetry], loggers=[wandb_run, csv], global_rank=0,
                              global_step=7)
    report = RunReport()
    report._log_step_picture(trainer)
    assert report.step_picture == tmp_path / "csv" / "version_0" / "step_times.png"
    assert report.step_picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "wandb" / "step_times.png").is_file()
    (logged,) = wandb_run.metrics
    assert type(logged["hetero/step_times"]).__name__ == "Image"
    chosen = RunReport(output_dir=tmp_path / "out")
    chosen._log_step_picture(SimpleNamespace(**{**vars(trainer), "loggers": []}))
    assert chosen.step_picture == tmp_path / "out" / "step_times.png" and chosen.step_picture.is_file()
