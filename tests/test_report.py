"""The plan table and picture: stage rows, predicted figures, shares, grouping, PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.report.picture import plot_plan
from het_strategy.report.table import compress_devices, group_pipelines, plan_table
from het_strategy.core.workload import TransformerConfig, transformer_workload

WORKLOAD = transformer_workload(TransformerConfig("toy", num_layers=6, hidden_size=256, num_heads=4, seq_len=128,
                                                  vocab_size=1000))  # 8 layers: embedding, 6 blocks, head


def _cluster(num_nodes_each: int = 1, per_node: int = 2):
    nodes = [{"name": f"a{i}", "devices": [{"type": "A100-40GB", "count": per_node}]} for i in range(num_nodes_each)]
    nodes += [{"name": f"v{i}", "devices": [{"type": "V100-16GB", "count": per_node}]} for i in range(num_nodes_each)]
    return cluster_from_dict({"name": "toy_cluster", "nodes": nodes})


def _plan(cluster, pipelines, gbs):
    return Plan(cluster=cluster.name, cluster_devices=[d.name for d in cluster.devices], model=WORKLOAD.fingerprint(),
                global_batch_size=gbs, pipelines=pipelines, mode="manual")


def _score(cluster, plan):
    return CostModel(cluster, WORKLOAD, TrainSettings(global_batch_size=plan.global_batch_size)).score(plan)


def _dp(device, samples, mbs=4):
    return Pipeline((Stage((device,), (0, 8)),), mbs, samples)


def test_pure_dp_table_lists_stages_step_time_shares_and_idle():
    cluster = _cluster()  # a0/0-1 (A100), v0/0-1 (V100)
    plan = _plan(cluster, [_dp("a0/0", 24), _dp("a0/1", 24), _dp("v0/0", 16)], 64)
    score = _score(cluster, plan)
    text = plan_table(plan, score, cluster)
    lines = text.splitlines()
    # the two identical A100 pipelines fold into one row; the V100 one has its own
    a_row = next(ln for ln in lines if ln.startswith("0-1 x2"))
    assert "a0/0-1" in a_row and "A100-40GB" in a_row and "[0,8)" in a_row and "4x6 (24)" in a_row
    v_row = next(ln for ln in lines if ln.startswith("2 "))
    assert "v0/0" in v_row and "V100-16GB" in v_row and "4x4 (16)" in v_row
    assert f"predicted step time: {score.step_time_s * 1e3:.1f} ms" in text
    assert f"throughput: {score.samples_per_s:.1f} samples/s" in text
    assert "idle devices (1): v0/1" in text
    shares = text[text.index("per-rank batch shares"):]
    assert "a0/0-1: 24 each" in shares and "v0/0: 16" in shares and "v0/1: 0" in shares
    # memory column: used/capacity of the V100 row, from the score
    used = score.memory_bytes["v0/0"] / 2**30
    assert f"{used:.1f}/16" in v_row


def test_pipeline_table_has_one_row_per_stage_with_its_time():
    cluster = _cluster()
    pipes = [Pipeline((Stage(("a0/0",), (0, 5)), Stage(("v0/0",), (5, 8))), 2, 16),
             Pipeline((Stage(("a0/1",), (0, 5)), Stage(("v0/1",), (5, 8))), 2, 16)]
    plan = _plan(cluster, pipes, 32)
    score = _score(cluster, plan)
    lines = plan_table(plan, score, cluster).splitlines()
    first = next(ln for ln in lines if "[0,5)" in ln)
    second = next(ln for ln in lines if "[5,8)" in ln)
    assert first.startswith("0-1 x2") and "a0/0-1" in first and "2x8 (16)" in first
    assert "v0/0-1" in second and "V100-16GB" in second
    stage1_ms = score.stage_costs[0][1].compute_s * 1e3
    assert f"{stage1_ms:.3g}" in second.split()
    assert not any("per-rank batch shares" in ln for ln in lines)  # not a pure-DP plan


def test_512_devices_stay_a_short_table_and_picture(tmp_path: Path):
    pytest.importorskip("matplotlib")
    cluster = _cluster(num_nodes_each=32, per_node=8)  # 256 A100 + 256 V100
    pipes = [Pipeline((Stage((f"a{n}/{j}",), (0, 5)), Stage((f"v{n}/{j}",), (5, 8))), 1, 2)
             for n in range(32) for j in range(8)]
    plan = _plan(cluster, pipes, 512)
    score = _score(cluster, plan)
    groups = group_pipelines(plan, cluster)
    assert [g.count for g in groups] == [256]
    text = plan_table(plan, score, cluster)
    assert len(text.splitlines()) < 16  # the table, its totals and the rates each type was priced at
    assert "0-255 x256" in text and "256x A100-40GB @32 nodes" in text and "256x V100-16GB @32 nodes" in text
    png = plot_plan(plan, cluster, tmp_path / "big.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compress_devices():
    cluster = _cluster(per_node=8)
    assert compress_devices(["a0/0", "a0/1", "a0/2", "a0/3", "a0/6"], cluster) == "a0/0-3,6"
    assert compress_devices(["a0/0", "v0/7"], cluster) == "a0/0, v0/7"
    assert compress_devices([f"v0/{i}" for i in range(0, 8, 2)], cluster, width=8) == "4x V100-16GB @v0"


def test_plot_writes_png_atomically(tmp_path: Path):
    pytest.importorskip("matplotlib")
    cluster = _cluster()
    plan = _plan(cluster, [_dp("a0/0", 24), _dp("a0/1", 24), _dp("v0/0", 16)], 64)
    plan.predicted = _score(cluster, plan).to_dict()
    out = plot_plan(plan, cluster, tmp_path / "sub" / "plan.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert sorted(p.name for p in out.parent.iterdir()) == ["plan.png"]  # no temporary file left


def test_the_table_says_when_a_dtype_runs_at_the_fp32_rate() -> None:
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import load_workload
    from het_strategy.planning.dp_split import equal_split_plan
    from het_strategy.report.table import plan_table

    cluster = load_cluster("amp_v100_t4")
    for dtype, note in (("bf16", True), ("fp16", False)):
        cm = CostModel(cluster, load_workload("gpt2_amp", dtype), TrainSettings(global_batch_size=16, dtype=dtype))
        plan = equal_split_plan(cm)
        text = plan_table(plan, cm.score(plan), cluster)
        assert ("note: bf16 runs at the fp32 rate on T4, V100-16GB" in text) == note
