"""Tensor parallelism in ``hetero_deepspeed``: the split, the partitioned sends, the shard reduction, the checks.

The multiprocess cases start the ranks of ``_tp_worker.py`` (gloo, CPU): a small CharGPT in float64 trained
3 steps with clipping and a short last micro-batch, every rank's parameters compared with the matching part of
the single-process reference (the worker does the comparison with ``shard_of`` and reports the largest
difference), then each runner saves a checkpoint that a runner of other weights loads (per replica and tp
rank: ``PlanRunner.checkpoint_dir``).  The layout, link and check cases need no processes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

import _tp_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)
from _ds_launch import run_ds_ranks  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.demo.char_gpt import CharGPT  # noqa: E402
from het_strategy.ds_runtime.replicas import replica_layout  # noqa: E402
from het_strategy.ds_runtime.stage_exchange import StageLink  # noqa: E402
from het_strategy.tensor_parallel.layers import shard_of, unit_view  # noqa: E402
from het_strategy.tensor_parallel.tp_plan import Colwise, ShardSpec, TensorParallelPlan, check_layers  # noqa: E402

WORKER = Path(__file__).with_name("_tp_worker.py")
TIMEOUT_S = 300
CLIP = 0.05  # below the reference's first-step gradient norm (asserted below): clipping is active


# -- layout and links (no processes) --------------------------------------------------------------

def test_mixed_tp_replicas_reduce_each_unit_with_its_holder_in_every_replica():
    layout = replica_layout(worker.plan("mixed"))  # replica 0: rank 0 at tp 1; replica 1: ranks 1, 2 at tp 2
    assert layout.stage_groups == (((0,),), ((1, 2),)) and layout.per_replica and layout.has_tensor_parallel
    assert layout.units(1) == 2
    assert layout.unit_holders(1, 0) == (0, 1) and layout.unit_holders(1, 1) == (0, 2)
    assert layout.layer_holders(1) == (0, 1, 2)  # replicated parameters: every rank holding the layer
    assert layout.holder_sets == ((0, 1), (0, 1, 2), (0, 2))


def test_a_tp_1_plan_keeps_one_holder_per_replica():
    layout = replica_layout(worker.plan("send"))  # tp 2 [0, 2) -> tp 1 [2, 4)
    assert layout.stage_ranks == ((0, 2),) and layout.group_of(1) == (0, 1)
    assert layout.units(3) == 1 and layout.unit_holders(3, 0) == layout.layer_holders(3) == (2,)


@pytest.mark.parametrize("a, b", [(1, 1), (2, 1), (1, 2), (2, 4), (4, 2), (3, 2)])
def test_a_stage_link_carries_every_chunk_once_each_sender_1_over_a_each_receiver_1_over_b(a, b):
    link = StageLink(tuple(range(a)), tuple(range(10, 10 + b)))
    n = link.num_chunks
    sent = sorted((c, s, r) for s in link.senders for c, r in link.sends(s))
    got = sorted((c, s, r) for r in link.receivers for c, s in link.receives(r))
    assert sent == got and [c for c, _, _ in sent] == list(range(n))  # every chunk once, same pair both sides
    assert {len(link.sends(s)) for s in link.senders} == {n // a}
    assert {len(link.receives(r)) for r in link.receivers} == {n // b}
    assert sorted(r for s in link.senders for r in link.served(s)) == list(link.receivers)
    assert link.reversed().reversed() == link


def test_shards_and_units_cut_fused_projections_alone():
    full = torch.arange(6 * 8 * 2, dtype=torch.float64).view(6 * 4, 4)  # fused q, k, v of width 8 each
    spec = ShardSpec(0, fused=3)
    halves = [shard_of(full, spec, 2, r) for r in range(2)]
    assert halves[0].shape == (12, 4)
    # q's first half, then k's, then v's
    assert torch.equal(halves[0], torch.cat([full[0:4], full[8:12], full[16:20]]))
    unit = unit_view(halves[1], spec, 2, 1)  # unit 3 of 4: the last quarter of q, k and v
    assert torch.equal(unit.reshape(-1, 4), torch.cat([full[6:8], full[14:16], full[22:24]]))
    unit.zero_()  # a view: the reduction writes back through it
    assert halves[1][2:4].abs().sum() == 0


def test_a_stage_whose_layers_have_no_plan_is_refused_at_tp_2():
    with pytest.raises(ConfigError) as err:
        check_layers([torch.nn.Linear(4, 4)], 3, 2, 2, "plan.pipelines[0].stages[1].tp")
    assert err.value.field == "plan.pipelines[0].stages[1].tp"
    assert "none of them has a tensor_parallel_plan()" in str(err.value) and "max_tp=1" in str(err.value)


def test_a_tp_that_does_not_divide_the_heads_or_the_width_is_refused_naming_the_field():
    model = CharGPT(num_layers=1, hidden_size=12, num_heads=3, seq_len=8, vocab_size=66)
    layers = model.pipeline_layers()
    with pytest.raises(ConfigError, match=r"`plan.pipelines\[0\].stages\[0\].tp` is 2; it must divide "
                                          r"layers\[1\] \(_Block\).attn.num_heads \(3\)"):
        check_layers(layers, 0, 2, 2, "plan.pipelines[0].stages[0].tp")
    with pytest.raises(ConfigError, match=r"into 8 equal parts"):  # 12 features per projection, 8 units
        check_layers(layers, 0, 1, 8, "plan.pipelines[1].stages[0].tp")
    check_layers(layers, 0, 3, 3, "plan.pipelines[0].stages[0].tp")  # 3 heads, width 12: runs


def test_a_plan_naming_a_linear_the_layer_lacks_is_refused():
    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def tensor_parallel_plan(self) -> TensorParallelPlan:
            return TensorParallelPlan(linears={"proj": Colwise()})

    with pytest.raises(ConfigError, match="names 'proj', which the layer does not have"):
        check_layers([Odd()], 0, 2, 2, "plan.pipelines[0].stages[0].tp")


# -- multi-rank runs against one process ------------------------------------------------------------

def _check_exact(ranks: list[dict]) -> None:
    ref_losses, _, _ = worker.reference(CLIP)
    m = worker.model()
    x, y = worker.batch()
    CharGPT.pipeline_loss(m(x), y).backward()
    assert torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")) > CLIP  # clipping is active
    for r in ranks:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-12, abs=1e-12), f"rank {r['rank']}"
        assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=1e-12, abs=1e-12)
        assert r["param_max_diff"] < 1e-11, f"rank {r['rank']}: {r['param_max_diff']}"
    assert len({tuple(r["losses"]) for r in ranks}) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, world", [("tp2", 2), ("mixed", 3), ("send", 3)])
def test_tensor_parallel_plans_match_one_process_in_float64(tmp_path, case, world):
    # tp2: one stage split 2 ways (micro-batches 3 + 3 + 1); mixed: a tp-1 replica beside a tp-2 replica of the
    # same layers (their units reduced pairwise, replicated parameters over all three ranks); send: a tp-2 stage
    # passing partitioned activations to a tp-1 stage and receiving its gradients back
    ranks = run_ds_ranks(WORKER, world, [case, str(CLIP)], tmp_path, TIMEOUT_S)
    _check_exact(ranks)
    tps = [r["tp"] for r in ranks]
    assert tps == {"tp2": [2, 2], "mixed": [1, 2, 2], "send": [2, 2, 1]}[case]
    for r in ranks:  # a runner of other weights loads the checkpoint: the same shards, the same next update
        assert r["reload_max_diff"] == 0.0 and r["client_step"] == worker.STEPS
        assert r["step_after_reload_max_diff"] == 0.0
    if case == "mixed":
        assert [r["micro_batch_sizes"] for r in ranks] == [[3, 1], [2, 1], [2, 1]]
        # the tp-2 ranks hold halves: the same names as the tp-1 rank, half the elements of the split linears
        assert ranks[1]["names"] == ranks[0]["names"] == ranks[2]["names"]


@pytest.mark.multiprocess
def test_zero_1_shards_the_optimizer_state_within_the_holder_sets_of_mixed_tp_replicas(tmp_path):
    # the mixed case at ZeRO 1: each unit of a split linear is held by two ranks (the tp-1 rank and one tp-2 rank),
    # the replicated parameters by all three; AdamW's moments are kept for a half or a third of each, and the
    # update, the checkpoint round trip and the step after it are those of the single process
    ranks = run_ds_ranks(WORKER, 3, ["mixed", str(CLIP), "fp32", "-", "1"], tmp_path, TIMEOUT_S)
    _check_exact(ranks)
    for r in ranks:
        assert r["reload_max_diff"] == 0.0 and r["step_after_reload_max_diff"] == 0.0
    whole = ranks[0]["param_numel"]  # the tp-1 rank holds every parameter whole
    assert sum(r["state_numel"] for r in ranks) == pytest.approx(2 * whole, abs=2 * 3 * 16)  # two moments, once
    assert ranks[0]["state_numel"] < 2 * whole * 0.6
    assert ranks[1]["state_numel"] < 2 * ranks[1]["param_numel"] * 0.6


@pytest.mark.multiprocess
@pytest.mark.parametrize("case, dtype, bound, zero", [("mixed", "bf16", 1e-2, 0), ("mixed", "fp16", 2e-2, 0),
                                                      ("mixed", "bf16", 1e-2, 1), ("mixed", "fp16", 2e-2, 1),
                                                      ("mixed", "per_device", 2e-2, 0),
                                                      ("send", "per_device", 2e-2, 1)])
def test_mixed_precision_mixed_tp_tracks_the_float64_reference(tmp_path, case, dtype, bound, zero):
    # bf16 (BF16_Optimizer's fp32 buffers reduced per unit) and fp16 at ZeRO 0 (the loss scaled by the runtime,
    # the scaled fp16 gradients reduced in fp32 and clipped against the scaled bound) with fp32 master weights,
    # and bf16 / fp16 at ZeRO 1 (the fp32 masters sharded within the holder sets; fp16's loss scale kept there):
    # after 3 steps at lr 0.05 the half-precision compute is 0.1-1.1% off (fp16 and bf16 alike, measured).
    # per_device (_tp_worker.PER_DEVICE_DTYPES): an fp16 tp-1 replica beside a bf16 tp-2 one, whole fp32 masters
    # on each holder; a bf16 tp-2 stage sending partitioned bf16 activations to an fp16 stage, sharded masters
    ranks = run_ds_ranks(WORKER, 3, [case, str(CLIP), dtype, "-", str(zero)], tmp_path, TIMEOUT_S)
    for r in ranks:
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=bound)
        assert r["eval_loss"] == pytest.approx(r["ref_eval_loss"], rel=bound)
        # the checkpoint's optimizer state comes back too (bf16: PlanRunner.load_checkpoint loads it itself)
        assert r["reload_max_diff"] == 0.0 and r["step_after_reload_max_diff"] == 0.0
    assert len({tuple(r["losses"]) for r in ranks}) == 1


@pytest.mark.multiprocess
def test_an_inf_on_one_tp_rank_skips_the_fp16_step_on_every_rank(tmp_path):
    # rank 2 (tp rank 1 of replica 1) gets an inf in its gradient in step 2: the shard reduction carries it to its
    # unit's holder in replica 0, the replicated parameters' reduction to everyone, so every fp16 optimizer
    # skips step 2 (and halves its loss scale): the loss after it equals the loss before it on every rank
    ranks = run_ds_ranks(WORKER, 3, ["mixed", str(CLIP), "fp16", "2"], tmp_path, TIMEOUT_S)
    for r in ranks:
        first, second, third = r["losses"]
        assert second != first and third == second, r["losses"]
    assert len({tuple(r["losses"]) for r in ranks}) == 1
