"""The roofline (``core/compute_model.py``) against hand-computed cases, its calibration against the measurements
it was fitted on and, leaving one GPU type out, against those it was not."""

from __future__ import annotations

import json
import statistics

import pytest

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.compute_model import (CALIBRATION_FILE, AttentionKernel, ComputeCalibration, LayerShape,
                                             Roofline, device_roofline, gemm_s, layer_seconds, memory_s)
from het_strategy.core.cost_model import CostModel
from het_strategy.core.errors import ConfigError
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.workload import load_workload
from het_strategy.reference.compute_calibration import (block_measurements, cost_model_s, fit_calibration,
                                                        measurement_device)

CAL = ComputeCalibration(tensor_efficiency=0.8, vector_efficiency=0.5, memory_efficiency=0.5, small_dim=64.0,
                         launch_s=1e-5)
ROOF = Roofline(matmul_flops=100e12, tensor_cores=True, memory_bytes_per_s=1e12, compute_units=4)


def test_a_full_wave_of_whole_tiles_runs_at_the_calibrated_peak_times_the_depth_term() -> None:
    # 256 x 256 output: 4 tiles of 128 x 128 on 4 units, one full wave; depth 64 / (64 + 64) = 0.5
    flops = 2 * 256 * 256 * 64
    assert gemm_s(256, 256, 64, 1, ROOF, CAL) == pytest.approx(flops / (100e12 * 0.8 * 0.5) + 1e-5)


def test_partial_tiles_and_a_partial_last_wave_cost_whole_ones_with_the_best_tile_kept() -> None:
    # 384 x 384 output on 5 units, depth 1024 / 1088; the fill (busy slots x unpadded share) per tile:
    # 256 x 128: 2 x 3 = 6 tiles, 2 waves (10 slots), padding 384 x 384 / (512 x 384) -> 0.6 x 0.75 = 0.45
    # 128 x 128: 9 tiles, 2 waves -> 0.9;  128 x 64: 18 tiles, 4 waves -> 0.9;  64 x 64: 36 tiles, 8 waves -> 0.9
    flops = 2 * 384 * 384 * 1024
    roof5 = Roofline(100e12, True, 1e12, 5)
    assert gemm_s(384, 384, 1024, 1, roof5, CAL) == pytest.approx(flops / (100e12 * 0.8 * 0.9 * (1024 / 1088))
                                                                  + 1e-5)
    # 130 x 64 output on 4 units: 128-row tiles fill at best 2 of 4 slots, 130 / 256 of them unpadded (0.25);
    # 64 x 64 tiles: 3 tiles (the third 2 rows), one wave of 3 on 4 slots, padding 130 / 192 -> 0.5078
    flops = 2 * 130 * 64 * 1024
    expected = flops / (100e12 * 0.8 * (3 / 4) * (130 / 192) * (1024 / 1088)) + 1e-5
    assert gemm_s(130, 64, 1024, 1, ROOF, CAL) == pytest.approx(expected)
    # fp32 on the vector units: its own peak fraction
    vector = Roofline(100e12, False, 1e12, 4)
    assert gemm_s(256, 256, 64, 1, vector, CAL) == pytest.approx(2 * 256 * 256 * 64 / (100e12 * 0.5 * 0.5) + 1e-5)
    assert gemm_s(0, 256, 64, 1, ROOF, CAL) == 0.0


def test_memory_passes_move_their_bytes_at_the_calibrated_bandwidth() -> None:
    assert memory_s(1e9, 2, 3, ROOF, CAL) == pytest.approx(2e9 / (1e12 * 0.5) + 3e-5)


def _device(entry: dict):
    return cluster_from_dict({"name": "c", "nodes": [{"devices": [entry]}]}).devices[0]


def test_the_rate_is_the_unit_the_dtype_runs_on_and_fp32_follows_torchs_matmul_precision() -> None:
    a100 = _device({"type": "A100-40GB"})
    assert device_roofline(a100, "bf16") == Roofline(312e12, True, 1555e9, 108)
    assert device_roofline(a100, "fp32") == Roofline(19.5e12, False, 1555e9, 108)  # torch's default: highest
    assert device_roofline(a100, "fp32", "high") == Roofline(156e12, True, 1555e9, 108)
    v100 = _device({"type": "V100-16GB"})
    assert device_roofline(v100, "fp32", "high") == Roofline(15.7e12, False, 900e9, 80)  # no TF32 units
    assert device_roofline(v100, "bf16") == Roofline(15.7e12, False, 900e9, 80)  # no bf16 rate: the fp32 rate
    # the device's own figures price it: a CPU, a measured throughput or efficiency, an emulated device
    assert device_roofline(_device({"type": "CPU"}), "fp32") is None
    assert device_roofline(_device({"type": "A100-40GB", "tflops": 100}), "bf16") is None
    assert device_roofline(_device({"type": "A100-40GB", "efficiency": 0.5}), "bf16") is None
    assert device_roofline(_device({"type": "A100-40GB", "emulated_speed": 1.0}), "bf16") is None


def test_fused_attention_moves_no_scores_and_tp_splits_the_matmuls() -> None:
    fused = LayerShape("block", 1024, 16, 4096, 50000, AttentionKernel.fused)
    materialized = LayerShape("block", 1024, 16, 4096, 50000, AttentionKernel.materialized)
    one = layer_seconds(fused, 2048, 1, 1, 2, ROOF, CAL)
    assert sum(layer_seconds(materialized, 2048, 1, 1, 2, ROOF, CAL)) > sum(one)
    no_memory = ComputeCalibration(0.8, 0.5, 1e9, 0.0, 0.0)  # memory passes free, no launch cost
    f1, b1 = layer_seconds(fused, 2048, 1, 1, 2, ROOF, no_memory)
    f2, b2 = layer_seconds(fused, 2048, 1, 2, 2, ROOF, no_memory)
    # every matmul's tiles fill whole waves of the 4 units at tp 1 and at tp 2: half the work is half the time
    assert (f2, b2) == pytest.approx((f1 / 2, b1 / 2), rel=0.02)
    assert b1 > 2 * f1  # the fused backward recomputes the scores


def test_with_compute_model_roofline_the_cost_model_prices_a_shaped_layer_on_a_catalog_gpu_by_it() -> None:
    cluster = cluster_from_dict({"name": "c", "nodes": [{"devices": [{"type": "A100-40GB"}]}]})
    workload = load_workload("gpt_small", dtype="bf16")
    flops = CostModel(cluster, workload, TrainSettings(8, dtype="bf16"))  # the default: FLOPs over the rate
    cm = CostModel(cluster, workload, TrainSettings(8, dtype="bf16", compute_model="roofline"))
    dev = cluster.devices[0]
    rate = dev.flops_per_second("bf16")
    assert flops.stage_compute_s(dev, 1, 2, 1, 2) == pytest.approx(3 * workload.layers[1].flops_per_sample * 2 / rate)
    roof = device_roofline(dev, "bf16")
    block = workload.layers[1]
    expected = sum(layer_seconds(block.shape, workload.seq_len, 2, 1, 2, roof, cm.calibration))
    assert cm.stage_compute_s(dev, 1, 2, 1, 2) == pytest.approx(expected)


def test_bad_options_name_their_field() -> None:
    with pytest.raises(ConfigError, match="settings.float32_matmul_precision"):
        TrainSettings(8, float32_matmul_precision="tf32")
    with pytest.raises(ConfigError, match="settings.compute_model"):
        TrainSettings(8, compute_model="measured")
    with pytest.raises(ConfigError, match="model.attention"):
        load_workload({"name": "m", "num_layers": 1, "hidden_size": 8, "num_heads": 2, "seq_len": 4,
                       "vocab_size": 16, "attention": "flash"})


def test_the_shipped_calibration_is_the_fit_of_the_measurements() -> None:
    shipped = json.loads(CALIBRATION_FILE.read_text())["constants"]
    refit = fit_calibration(block_measurements()).to_dict()
    assert refit == pytest.approx(shipped, rel=1e-6, abs=1e-9)


def test_every_measured_gpu_is_a_catalog_gpu_with_a_roofline() -> None:
    gpus = {m.gpu for m in block_measurements()}
    assert gpus == {"A100-40GB", "A100-80GB", "GH200-96GB", "V100-16GB", "RTX-3090", "Titan-RTX", "RTX-2080-Ti",
                    "T4"}
    assert all(measurement_device(g).compute_units for g in gpus)


def test_leave_one_gpu_type_out_predicts_the_left_out_type() -> None:
    """Calibrated without a GPU type, the cost model predicts that type's blocks (every tp, every micro-batch)
    with a median error of at most 20% over all types (13.5% measured), and its tp-1 blocks at most 15%
    (tp > 1 adds the tp all-reduces, priced by the network model, which the calibration does not touch)."""
    rows = block_measurements()
    errors, tp1 = [], []
    for gpu in sorted({m.gpu for m in rows}):
        cal = fit_calibration([m for m in rows if m.gpu != gpu])
        for m in rows:
            if m.gpu == gpu:
                err = abs(cost_model_s(m, cal) / m.seconds - 1)
                errors.append(err)
                if m.tp == 1:
                    tp1.append(err)
    assert statistics.median(errors) <= 0.20
    assert statistics.median(tp1) <= 0.15


def test_a_run_with_tf32_matmuls_gives_the_gpu_with_tf32_units_a_larger_share() -> None:
    """Under the roofline, fp32 matmuls follow ``float32_matmul_precision``: an A100 runs TF32 under ``high``, a
    V100 has no TF32 units, so the A100's share of the global batch grows."""
    from het_strategy.planning import PlanRequest, plan

    cluster = cluster_from_dict({"name": "c", "nodes": [{"devices": [{"type": "A100-40GB"}, {"type": "V100-16GB"}]}]})
    workload = load_workload("gpt_small", dtype="fp32")
    a100 = cluster.devices[0].name

    def shares(precision: str) -> dict[str, int]:
        settings = TrainSettings(64, dtype="fp32", compute_model="roofline", float32_matmul_precision=precision)
        return plan(cluster, workload, settings, PlanRequest(mode="dp")).plan.rank_shares()

    ieee, tf32 = shares("highest"), shares("high")
    assert tf32[a100] > ieee[a100] and sum(tf32.values()) == sum(ieee.values()) == 64


def _one_device_plan(cluster, workload, device: str):
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster=cluster.name, cluster_devices=tuple(d.name for d in cluster.devices),
                model={"name": workload.name, "num_layers": workload.num_layers}, global_batch_size=8, dtype="fp32",
                mode="manual", pipelines=(Pipeline((Stage((device,), (0, workload.num_layers)),), micro_batch_size=2,
                                                   samples=8),))


@pytest.mark.parametrize("compute_model", ["flops", "roofline"])
def test_an_fp32_plan_is_priced_at_the_tf32_rate_under_high_and_at_the_fp32_rate_under_highest(
        compute_model: str) -> None:
    """``settings.float32_matmul_precision`` prices fp32 matmuls in both compute models: an A100's at its TF32
    rate (156 TFLOPS) under ``high`` and ``medium``, at its fp32 rate (19.5) under ``highest``; a V100 has no
    TF32 units, so its price does not move.  The reference is computed by hand from the datasheet figures; the
    plan table's line names the rate each type was priced at."""
    cluster = cluster_from_dict({"name": "c", "nodes": [{"devices": [{"type": "A100-40GB"}, {"type": "V100-16GB"}]}]})
    workload = load_workload("gpt_small", dtype="fp32")
    a100, v100 = cluster.devices
    mbs = 2

    def by_hand(dev, tflops: float, tensor_cores: bool) -> float:
        """Forward + backward of one micro-batch through every layer at the peak ``tflops``."""
        total = 0.0
        for layer in workload.layers:
            if compute_model == "roofline" and layer.shape is not None:
                roof = Roofline(tflops * 1e12, tensor_cores, dev.memory_bandwidth_gbs * 1e9, dev.compute_units)
                total += sum(layer_seconds(layer.shape, workload.seq_len, mbs, 1, 4, roof,
                                           ComputeCalibration.shipped()))
            else:
                total += 3 * layer.flops_per_sample * mbs / (tflops * 1e12 * dev.efficiency)
        return total

    priced = {}
    for precision in ("highest", "high", "medium"):
        cm = CostModel(cluster, workload, TrainSettings(8, dtype="fp32", compute_model=compute_model,
                                                        float32_matmul_precision=precision))
        for dev in (a100, v100):
            score = cm.score(_one_device_plan(cluster, workload, dev.name))
            priced[precision, dev.type] = score.stage_costs[0][0].compute_s
            rate = {("A100-40GB", "highest"): "fp32 19.5", ("V100-16GB", "highest"): "fp32 15.7"}.get(
                (dev.type, precision), "tf32 156" if dev.type == "A100-40GB" else "fp32 15.7")
            assert f"{dev.type} at {rate} TFLOPS" in score.compute
            assert f"compute_model={compute_model}, float32_matmul_precision={precision}" in score.compute
    assert priced["highest", "A100-40GB"] == pytest.approx(by_hand(a100, 19.5, False))
    assert priced["high", "A100-40GB"] == pytest.approx(by_hand(a100, 156, True))
    assert priced["medium", "A100-40GB"] == priced["high", "A100-40GB"]
    assert priced["high", "A100-40GB"] < priced["highest", "A100-40GB"] / 2  # the TF32 rate is 8x fp32's
    assert priced["high", "V100-16GB"] == priced["highest", "V100-16GB"] == pytest.approx(by_hand(v100, 15.7, False))


def test_the_tf32_rate_stays_with_an_efficiency_override_and_not_with_measured_or_emulated_figures() -> None:
    """Under ``flops`` an A100 whose efficiency the cluster file gives keeps its TF32 units; a measured
    throughput or an emulated speed is used as given, whatever the matmul precision."""
    assert _device({"type": "A100-40GB", "efficiency": 0.5}).flops_per_second("fp32", "high") == \
        pytest.approx(156e12 * 0.5)
    assert _device({"type": "A100-40GB", "efficiency": 0.5}).flops_per_second("fp32") == pytest.approx(19.5e12 * 0.5)
    assert _device({"type": "A100-40GB", "tflops": 100}).flops_per_second("fp32", "high") == pytest.approx(100e12)
    assert _device({"type": "A100-40GB", "emulated_speed": 2.0}).flops_per_second("fp32", "high") == \
        pytest.approx(19.5e12 * 0.45 * 2.0)
    assert _device({"type": "A100-40GB"}).flops_per_second("bf16", "high") == pytest.approx(312e12 * 0.45)
    assert _device({"type": "A100-40GB"}).matmul_rate("fp32", "medium") == ("tf32", 156)
