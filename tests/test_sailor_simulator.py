"""Our re-implementation of Sailor's runtime simulator: its published figure for Sailor's own 32:96 plan,
small cases worked by hand from the vendored tables (with Sailor's backward-send rule and with its slip
corrected), and the plans it refuses."""

from __future__ import annotations

import json
import math

import pytest

from het_strategy.core.cluster import load_cluster
from het_strategy.core.errors import ConfigError
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.reference.sailor_profiles import SAILOR_DATA_DIR
from het_strategy.reference.sailor_simulator import BackwardSend, sailor_iteration_time

_CLUSTER = "sailor_a100_v100_32_96"
_ZONE = "us-central1-a"


def _json(name: str):
    return json.loads((SAILOR_DATA_DIR / name).read_text())


def _plan(cluster: str, stage_lists: list[list[tuple[list[str], tuple[int, int]]]], mbs: int, samples: list[int],
          num_layers: int = 26) -> Plan:
    pipes = tuple(Pipeline(stages=tuple(Stage(tuple(devs), layers) for devs, layers in stages),
                           micro_batch_size=mbs, samples=n) for stages, n in zip(stage_lists, samples))
    return Plan(cluster=cluster, cluster_devices=tuple(d.name for d in load_cluster(cluster).devices),
                model={"name": "opt350", "num_layers": num_layers}, global_batch_size=sum(samples), pipelines=pipes)


def test_sailors_32_96_plan_scores_sailors_published_5_884_s():
    plan = Plan.load(SAILOR_DATA_DIR / "sailor_plan_32_96.json")
    est = sailor_iteration_time(plan, _CLUSTER)
    assert est.iteration_s == pytest.approx(5.884, rel=0.01)
    assert est.iterations_per_s == pytest.approx(0.170, abs=0.001)
    # one Sailor pipeline of 27 replicas, 2 stages; m = ceil(1024 / (2 x 27)) = 19
    assert len(est.pipelines) == 1 and len(est.pipelines[0].plan_pipelines) == 27
    assert est.num_micro_batches == 19 and est.sync_across_s == 0.0
    assert est.iteration_s == pytest.approx(est.pipeline_s + est.sync_s)
    assert est.pipeline_s == pytest.approx(18 * est.bottleneck_s + est.pipelines[0].fill_s + est.update_s)


# -- a small case by hand ---------------------------------------------------------------------


def _gbs_at(coeffs: list[float], x: float) -> float:
    m = math.log2(x / 1e6)
    return coeffs[0] * m * m + coeffs[1] * m + coeffs[2]


def test_two_pipelines_of_two_stages_match_the_hand_computation():
    # pipeline 0: A100 -> A100; pipeline 1: V100 -> A100; mbs 2, 8 samples each
    plan = _plan(_CLUSTER, [[(["a100_0/0"], (0, 13)), (["a100_0/1"], (13, 26))],
                            [(["v100_0/0"], (0, 13)), (["a100_0/2"], (13, 26))]], mbs=2, samples=[8, 8])
    est = sailor_iteration_time(plan, _CLUSTER)

    prof = _json("layer_profiles.json")["OPT-350"]
    mem = _json("layer_memory.json")["OPT-350"]["1"]
    fits = _json("inter_node_bandwidth_fits.json")[_ZONE]
    a100, v100 = prof["A100-40"]["2"]["1"], prof["V100-16"]["2"]["1"]  # [gpu][mbs 2][tp 1]
    aa = fits["A100-40"]["1"][_ZONE]["A100-40"]["1"][0]
    va = fits["V100-16"]["1"][_ZONE]["A100-40"]["1"][0]
    av = fits["A100-40"]["1"][_ZONE]["V100-16"]["1"][0]

    def fb(table, lo, hi):
        return sum(table[str(l)][0] + table[str(l)][1] for l in range(lo, hi))

    def send(x, c):
        return x / 1e9 / _gbs_at(c, x)

    compute0 = max(fb(a100, 0, 13), fb(v100, 0, 13))
    compute1 = fb(a100, 13, 26)
    update = max(a100["0"][2], v100["0"][2], a100["13"][2])  # first layer of each stage only
    act = 2 * 4 * 2097152  # mbs x 4 bytes x act_output_floats of layers 12 and 13
    assert mem["12"]["act_output_floats"] == mem["13"]["act_output_floats"] == 2097152
    send0 = max(send(act, aa), send(act, va))  # 2 stages: the first pays its forward send once
    send1 = 2 * max(send(act, aa), send(act, av))  # the last pays twice its backward send
    m = math.ceil(16 / (2 * 2))
    pipeline = (m - 1) * max(compute0 + send0, compute1 + send1) + compute0 + compute1 + send0 + send1 + update

    def allreduce(total, d, c):  # buckets of 5e8 bytes, 2 (d - 1) sends of bucket / d each
        buckets = [5e8] * int(total // 5e8) + [total % 5e8]
        return sum(2 * (d - 1) * send(b / d, c) for b in buckets if b)

    bytes0 = 4 * sum(mem[str(l)]["params_floats"] for l in range(0, 13))  # fp32, divided by min tp = 1
    bytes1 = 4 * sum(mem[str(l)]["params_floats"] for l in range(13, 26))
    sync = max(allreduce(bytes0, 2, av), allreduce(bytes1, 2, aa))

    assert est.num_micro_batches == m
    (pipe,) = est.pipelines
    assert [s.compute_s for s in pipe.stages] == pytest.approx([compute0, compute1])
    assert [s.send_s for s in pipe.stages] == pytest.approx([send0, send1])
    assert est.update_s == pytest.approx(update)
    assert est.pipeline_s == pytest.approx(pipeline)
    assert est.sync_s == pytest.approx(sync)
    assert est.iteration_s == pytest.approx(pipeline + sync)


def test_pipelines_with_different_boundaries_add_a_sync_across_pipelines():
    plan = _plan(_CLUSTER, [[(["a100_0/0"], (0, 26))], [(["a100_1/0"], (0, 13)), (["a100_1/1"], (13, 26))]],
                 mbs=2, samples=[8, 8])
    est = sailor_iteration_time(plan, _CLUSTER)
    assert len(est.pipelines) == 2 and est.sync_within_s == 0.0  # each has one replica per stage
    mem = _json("layer_memory.json")["OPT-350"]["1"]
    aa = _json("inter_node_bandwidth_fits.json")[_ZONE]["A100-40"]["1"][_ZONE]["A100-40"]["1"][0]
    # the longer pipeline's stages, full fp32 bytes, all-reduced over the 2 pipelines
    stage0 = 4 * sum(mem[str(l)]["params_floats"] for l in range(0, 13))
    expected = sum(2 * (b / 2) / 1e9 / _gbs_at(aa, b / 2) for b in (5e8, stage0 - 5e8))
    assert est.sync_across_s == pytest.approx(expected)


# -- the backward send: Sailor's rule and its slip corrected ----------------------------------


def test_a_stage_starting_at_the_head_sends_back_its_input_when_the_slip_is_corrected():
    # A100 -> A100 -> A100, the last stage is the output head alone; mbs 1, 4 samples
    plan = _plan(_CLUSTER, [[(["a100_0/0"], (0, 13)), (["a100_0/1"], (13, 25)), (["a100_0/2"], (25, 26))]],
                 mbs=1, samples=[4])
    sailors = sailor_iteration_time(plan, _CLUSTER)
    corrected = sailor_iteration_time(plan, _CLUSTER, backward_send="stage_input")
    assert sailor_iteration_time(plan, _CLUSTER, backward_send=BackwardSend.first_layer_output) == sailors

    mem = _json("layer_memory.json")["OPT-350"]["1"]
    aa = _json("inter_node_bandwidth_fits.json")[_ZONE]["A100-40"]["1"][_ZONE]["A100-40"]["1"][0]
    hidden = 4 * 2097152  # fp32 x act_output_floats of a block (layer 24: the head's input)
    logits = 4 * 103022593  # fp32 x act_output_floats of the head (layer 25): 412 MB
    assert mem["24"]["act_output_floats"] * 4 == hidden and mem["25"]["act_output_floats"] * 4 == logits

    def send(x):
        return x / 1e9 / _gbs_at(aa, x)

    # 3 stages: first pays its forward once, middle forward + backward, last twice its backward
    assert [s.send_s for s in sailors.pipelines[0].stages] == pytest.approx(
        [send(hidden), 2 * send(hidden), 2 * send(logits)])
    assert [s.send_s for s in corrected.pipelines[0].stages] == pytest.approx(
        [send(hidden), 2 * send(hidden), 2 * send(hidden)])  # the head sends back a hidden state
    assert send(hidden) < 0.05 * send(logits)

    a100 = _json("layer_profiles.json")["OPT-350"]["A100-40"]["1"]["1"]  # [gpu][mbs 1][tp 1]
    compute = [sum(a100[str(l)][0] + a100[str(l)][1] for l in range(lo, hi))
               for lo, hi in ((0, 13), (13, 25), (25, 26))]
    update = max(a100[str(l)][2] for l in (0, 13, 25))
    m = 4  # ceil(4 / (mbs 1 x 1 replica x 1 pipeline))

    def iteration(head_send):  # one replica per stage: no gradient sync
        per_stage = [compute[0] + send(hidden), compute[1] + 2 * send(hidden), compute[2] + 2 * head_send]
        return (m - 1) * max(per_stage) + sum(per_stage) + update

    assert sailors.iteration_s == pytest.approx(iteration(send(logits)))
    assert corrected.iteration_s == pytest.approx(iteration(send(hidden)))
    # Sailor's rule makes the head stage the bottleneck; corrected, the 12-block middle stage is
    assert (sailors.pipelines[0].bottleneck_stage, corrected.pipelines[0].bottleneck_stage) == (2, 1)


def test_the_correction_leaves_sailors_32_96_plan_alone():
    # its stages are [0, 13) and [13, 26): the second starts at a block, whose output is its input's size
    plan = Plan.load(SAILOR_DATA_DIR / "sailor_plan_32_96.json")
    assert sailor_iteration_time(plan, _CLUSTER, backward_send="stage_input").iteration_s == pytest.approx(
        sailor_iteration_time(plan, _CLUSTER).iteration_s, rel=1e-12)


def test_an_unknown_backward_send_is_refused_naming_the_choices():
    plan = _plan(_CLUSTER, [[(["a100_0/0"], (0, 26))]], mbs=2, samples=[4])
    with pytest.raises(ConfigError, match="first_layer_output, stage_input") as err:
        sailor_iteration_time(plan, _CLUSTER, backward_send="stage_output")
    assert err.value.field == "backward_send"


# -- plans it cannot score --------------------------------------------------------------------


def test_unprofiled_gpu_type_is_refused_naming_the_stage():
    plan = _plan("amp_v100_t4", [[(["g4dn_12xlarge/0"], (0, 26))], [(["p3_8xlarge_0/0"], (0, 26))]],
                 mbs=2, samples=[4, 4])
    with pytest.raises(ConfigError, match="T4") as err:
        sailor_iteration_time(plan, "amp_v100_t4")
    assert err.value.field == "plan.pipelines[0].stages[0].devices"


def test_unprofiled_micro_batch_and_tp_are_refused_naming_the_field():
    plan = _plan(_CLUSTER, [[(["a100_0/0"], (0, 26))]], mbs=3, samples=[6])
    with pytest.raises(ConfigError) as err:
        sailor_iteration_time(plan, _CLUSTER)
    assert err.value.field == "plan.pipelines[0].micro_batch_size"
    plan = _plan(_CLUSTER, [[(["v100_0/0", "v100_0/1", "v100_0/2"], (0, 26))]], mbs=2, samples=[4])
    with pytest.raises(ConfigError) as err:
        sailor_iteration_time(plan, _CLUSTER)
    assert err.value.field == "plan.pipelines[0].stages[0].tp"


def test_mixed_micro_batch_sizes_are_refused():
    plan = Plan(cluster=_CLUSTER, cluster_devices=(), model={"name": "opt350", "num_layers": 26},
                global_batch_size=6, pipelines=(
                    Pipeline(stages=(Stage(("a100_0/0",), (0, 26)),), micro_batch_size=2, samples=4),
                    Pipeline(stages=(Stage(("a100_0/1",), (0, 26)),), micro_batch_size=1, samples=2)))
    with pytest.raises(ConfigError) as err:
        sailor_iteration_time(plan, _CLUSTER)
    assert err.value.field == "plan.pipelines[1].micro_batch_size"


def test_micro_batches_plan_charges_each_pipeline_its_own_size_and_count():
    """``micro_batches="plan"``: a plan of two sizes, which Sailor's rule refuses, is charged per pipeline its own
    micro-batch size and count; pipelines sharing stage boundaries but not the size are separate Sailor pipelines
    (so an all-reduce across them); on a plan of one size and equal shares it is Sailor's rule."""
    stages = [[([f"a100_0/{i}"], (0, 13)), ([f"a100_1/{i}"], (13, 26))] for i in range(2)]
    mixed = Pipeline(stages=tuple(Stage(tuple(d), l) for d, l in stages[1]), micro_batch_size=1, samples=6)
    plan = _plan(_CLUSTER, stages[:1], mbs=4, samples=[16])
    plan = Plan(cluster=plan.cluster, cluster_devices=plan.cluster_devices, model=plan.model, global_batch_size=22,
                pipelines=(*plan.pipelines, mixed))
    with pytest.raises(ConfigError, match="micro_batch_size"):
        sailor_iteration_time(plan, _CLUSTER)
    est = sailor_iteration_time(plan, _CLUSTER, micro_batches="plan")
    assert [p.plan_pipelines for p in est.pipelines] == [(0,), (1,)]
    for pipe, m in zip(est.pipelines, (4, 6)):  # 16 samples at 4, 6 samples at 1
        assert pipe.pipeline_s == pytest.approx((m - 1) * pipe.bottleneck_s + pipe.fill_s + pipe.update_s)
    slow = max(est.pipelines, key=lambda p: p.pipeline_s)
    assert est.pipeline_s == slow.pipeline_s and est.sync_across_s > 0
    assert (est.micro_batch_size, est.num_micro_batches) == ((4, 4) if slow is est.pipelines[0] else (1, 6))
    # one size, equal shares: the plan's counts are Sailor's m, so the two rules agree
    even = _plan(_CLUSTER, stages, mbs=2, samples=[8, 8])
    assert sailor_iteration_time(even, _CLUSTER, micro_batches="plan") == sailor_iteration_time(even, _CLUSTER)
    with pytest.raises(ConfigError, match="micro_batches"):
        sailor_iteration_time(even, _CLUSTER, micro_batches="even")
