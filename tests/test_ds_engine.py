"""``PlanRunner``: uneven heterogeneous pipelines on DeepSpeed make exactly one process's global-batch step.

The multiprocess cases start the ranks of ``_ds_engine_worker.py`` (gloo, CPU)
and compare every rank's parameters and losses with a single-process torch
reference: same layers, same SGD-with-momentum, the mean MSE over all 8
samples per step.  The refusal cases need no processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

import _ds_engine_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)
from _ds_launch import needs_cpu_fp16, run_ds_ranks  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.plan import Pipeline, Plan, Stage  # noqa: E402
from het_strategy.ds_runtime.engine import check_runnable  # noqa: E402

WORKER = Path(__file__).with_name("_ds_engine_worker.py")
TIMEOUT_S = 300  # up to four DeepSpeed ranks on two shared cores
TOL = dict(rel=1e-6, abs=1e-6)  # float32: DeepSpeed sums the micro-batch gradients in another order
TOL64 = dict(rel=1e-12, abs=1e-12)  # float64 (asymmetric plans): only the summation order differs


def _run_ranks(world: int, args: list[str], out_dir: Path) -> list[dict]:
    return run_ds_ranks(WORKER, world, args, out_dir, TIMEOUT_S)


def _reference(clip: float = 0.0, mode: str = "pipe",
               steps: int = worker.STEPS) -> tuple[list[float], float, dict[str, list[float]]]:
    """One process, whole batch: (loss per step, loss after the last step, parameters)."""
    model = torch.nn.Sequential(*worker.layers(mode))
    opt = worker.optimizer(model.parameters())
    x, y = worker.batch(mode)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        final = float(torch.nn.functional.mse_loss(model(x), y))
    return losses, final, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def _assert_matches_reference(ranks: list[dict], clip: float = 0.0, mode: str = "pipe") -> None:
    ref_losses, ref_final, ref_params = _reference(clip, mode)
    tol = TOL64 if worker.dtype_of(mode) == torch.float64 else TOL
    assert ref_losses[-1] < ref_losses[0]
    covered: set[str] = set()
    for r in ranks:
        assert r["losses"] == pytest.approx(ref_losses, **tol), f"rank {r['rank']}"
        assert r["eval_loss"] == pytest.approx(ref_final, **tol), f"rank {r['rank']}"
        assert r["global_steps"] == worker.STEPS
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], **tol), f"rank {r['rank']}: {name}"
        covered |= set(r["params"])
    assert covered == set(ref_params)
    # every rank of a step reports the same number (the last stage's, re-broadcast in float64)
    assert len({tuple(r["losses"]) for r in ranks}) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, clip", [(0, 0.0), (0, 0.05), (1, 0.05)])
def test_uneven_pipelines_match_one_process_on_the_global_batch(tmp_path, zero_stage, clip):
    # 2 pipelines x 2 stages at [0, 4, 6]: pipeline 0 takes 5 samples as 2+2+1 (gas 3), pipeline 1 takes
    # 3 as 2+1 (gas 2); both end on a short micro-batch.  Clipping by the global norm: at ZeRO 1 DeepSpeed's,
    # at ZeRO 0 the runner's own (DeepSpeed 0.19 clips that engine by stage 0's norm only).
    ranks = _run_ranks(4, ["pipe", str(zero_stage), str(clip)], tmp_path)
    assert [r["micro_batch_sizes"] for r in ranks] == [[2, 2, 1], [2, 1], [2, 2, 1], [2, 1]]
    assert [r["gas"] for r in ranks] == [3, 2, 3, 2]
    # rank = stage * dp + pipeline: ranks 0, 1 hold layers [0, 4), ranks 2, 3 hold [4, 6)
    held = [sorted({n.split(".")[0] for n in r["params"]}) for r in ranks]
    assert held == [["0", "1", "2", "3"]] * 2 + [["4", "5"]] * 2
    if clip:
        model = torch.nn.Sequential(*worker.build_layers())
        x, y = worker.batch()
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > clip  # clipping is active
    _assert_matches_reference(ranks, clip)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, clip", [(0, 0.0), (0, 0.05), (1, 0.05)])
def test_asymmetric_replicas_match_one_process_in_float64(tmp_path, zero_stage, clip):
    # Three replicas of different shapes (1 stage, 2 stages at [0, 2, 6], 1 stage) on 4 ranks, 3 + 4 + 1
    # samples as 2+1 / 2+2 / 1: uneven counts, a short last micro-batch, overlapping holder sets.  At ZeRO 1
    # the momentum buffers are sharded within each holder set ((0, 1, 3) for layers 0-1, (0, 2, 3) for 2-5):
    # every element's buffer is kept once in each set, a third of it on each holder.
    ranks = _run_ranks(4, ["asym", str(zero_stage), str(clip)], tmp_path)
    states = [r["state_numel"] for r in ranks]
    if zero_stage == 0:
        assert states == [r["param_numel"] for r in ranks]
    else:
        assert sum(states) == ranks[0]["param_numel"]  # rank 0 holds every layer; each buffer kept once
        assert max(states) <= ranks[0]["param_numel"] // 3 + 6
    assert [r["micro_batch_sizes"] for r in ranks] == [[2, 1], [2, 2], [2, 2], [1]]
    held = [sorted(int(n.split(".")[0]) for n in r["params"] if n.endswith("weight")) for r in ranks]
    assert held == [list(range(6)), [0, 1], [2, 3, 4, 5], list(range(6))]
    if clip:
        model = torch.nn.Sequential(*worker.layers("asym"))
        x, y = worker.batch("asym")
        torch.nn.functional.mse_loss(model(x), y).backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > clip  # clipping is active
    _assert_matches_reference(ranks, clip, "asym")


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_uneven_pure_data_parallel_matches_one_process(tmp_path, zero_stage):
    # rank 0: 5 samples as 2+2+1 (gas 3); rank 1: 3 samples as one micro-batch (gas 1).  ZeRO 2 reduces on every
    # micro-step, so both ranks run 3 micro-batches there (rank 1's 3 samples as 1+1+1); ZeRO 3 also shards and
    # gathers the parameters (every parameter sharded; runner.named_parameters() gathers them for the comparison).
    ranks = _run_ranks(2, ["dp", str(zero_stage)], tmp_path)
    assert [r["gas"] for r in ranks] == ([3, 1] if zero_stage == 0 else [3, 3])
    assert all(r["sharded"] for r in ranks) == (zero_stage == 3)
    _assert_matches_reference(ranks)


# bf16 keeps 8 mantissa bits: after 3 steps the losses and the parameters (held in bf16) are within these of fp32
MIXED_TOL = {"bf16": dict(rel=2e-2, abs=4e-3), "fp16": dict(rel=2e-3, abs=5e-4)}
MIXED_TOL["per_device"] = MIXED_TOL["bf16"]  # its bf16 ranks set the bound


def _assert_tracks_fp32(ranks: list[dict], dtype: str, steps: int = worker.STEPS, skipped: int = 0,
                        clip: float = 0.0) -> None:
    ref_losses, _, ref_params = _reference(clip, mode="pipe", steps=steps)
    tol = MIXED_TOL[dtype]
    for r in ranks:
        assert r["skipped_steps"] == skipped, f"rank {r['rank']}"
        assert r["losses"][skipped:] == pytest.approx(ref_losses, **tol), f"rank {r['rank']}"
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], **tol), f"rank {r['rank']}: {name}"
    assert len({tuple(r["losses"]) for r in ranks}) == 1  # every rank reports the same global-batch loss


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode, zero_stage, dtype", [("pipe", 0, "bf16"), ("asym", 0, "bf16"), ("asym", 1, "fp16"),
                                                     pytest.param("pipe", 1, "fp16", marks=needs_cpu_fp16)])
def test_mixed_precision_tracks_fp32(tmp_path, mode, zero_stage, dtype):
    """The aligned grid (BF16_Optimizer at ZeRO 0, DeepSpeed's ZeRO-1 fp16 optimizer) and the asymmetric replicas
    (the holder-set reduction of BF16_Optimizer's fp32 gradient buffers; at ZeRO 1 in fp16 the holder sets' own
    fp32 master chunks and loss scale) train the fp32 layers in bf16/fp16 with fp32 master weights: 3 steps stay
    within MIXED_TOL of the fp32 single-process reference."""
    ranks = _run_ranks(4, [mode, str(zero_stage), "0.0", dtype], tmp_path)
    _assert_tracks_fp32(ranks, dtype)
    if (mode, zero_stage, dtype) == ("asym", 1, "fp16"):  # a checkpoint brings back the masters and the loss scale
        assert all(r["restored"] == {"scale": 1234.0, "hysteresis": 1, "masters": True} for r in ranks)


@pytest.mark.multiprocess
def test_asymmetric_bf16_at_zero_1_shards_the_fp32_masters_and_steps_as_zero_0(tmp_path):
    """bf16 at ZeRO 1 on the asymmetric plan: the layers run in bf16, the fp32 master weights and the momentum
    buffers are sharded within the holder sets (a third of each set on each holder), the update clipped by the
    global norm.  It follows the ZeRO-0 run (DeepSpeed's BF16_Optimizer: whole fp32 masters on every rank) step
    for step: bf16 gradients, reduced in fp32, stepped in fp32.  The masters start apart by one rounding: the
    sharding takes them from the model's fp32 weights, BF16_Optimizer from their bf16 rounding (0.1% in the
    losses after it).  And both track the fp32 reference."""
    (tmp_path / "zero0").mkdir()
    (tmp_path / "zero1").mkdir()
    zero0 = _run_ranks(4, ["asym", "0", "0.05", "bf16"], tmp_path / "zero0")
    zero1 = _run_ranks(4, ["asym", "1", "0.05", "bf16"], tmp_path / "zero1")
    numel = zero1[0]["param_numel"]  # rank 0 holds every layer
    states = [r["state_numel"] for r in zero1]
    masters = [r["master_numel"] for r in zero1]
    assert sum(states) == sum(masters) == numel and max(masters) <= numel // 3 + 6
    assert all(r["param_dtype"] == "torch.bfloat16" for r in zero0 + zero1)
    for a, b in zip(zero0, zero1):
        assert b["losses"] == pytest.approx(a["losses"], rel=2e-3), f"rank {a['rank']}"
        for name, values in b["params"].items():  # at most one bf16 ulp (2**-7 relative) where a rounding flips
            assert values == pytest.approx(a["params"][name], rel=2**-7, abs=1e-4), f"rank {a['rank']}: {name}"
    ref_losses, _, _ = _reference(0.05, "pipe")
    assert zero1[0]["losses"] == pytest.approx(ref_losses, **MIXED_TOL["bf16"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, dtype", [(0, "bf16"), (1, "fp16")])
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path, zero_stage, dtype):
    """Rank 3 (replica 2, holding every layer) gets an inf gradient in its first backward.  At ZeRO 0 the
    holder-set reduction carries it to each layer's other holders, so every replica's bf16 optimizer skips step 1;
    at ZeRO 1 in fp16 the sharding's overflow vote (one all-reduce over the world) makes every rank skip it.  The
    two steps after it are those of a 2-step fp32 run."""
    ranks = _run_ranks(4, ["asym", str(zero_stage), "0.0", dtype, "3"], tmp_path)
    _assert_tracks_fp32(ranks, dtype, steps=worker.STEPS - 1, skipped=1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero_stage, inf_rank", [(0, None), (1, "3")])
def test_per_device_precision_gives_every_rank_the_same_update(tmp_path, zero_stage, inf_rank):
    """The asymmetric plan with bf16 on ranks 0, 2 and fp16 on ranks 1, 3: replica 1 is a pipeline from an fp16
    stage to a bf16 one.  Every holder of a parameter ends with bitwise the same fp32 master weight (whole on
    each holder at ZeRO 0, sharded at ZeRO 1), its own parameter is that master rounded to its dtype, and the
    run tracks fp32 clipped by the global norm.  An inf in fp16 rank 3's first backward makes every rank skip
    that step."""
    args = ["asym", str(zero_stage), "0.05", "per_device"] + ([inf_rank] if inf_rank else [])
    ranks = _run_ranks(4, args, tmp_path)
    skipped = 1 if inf_rank else 0
    _assert_tracks_fp32(ranks, "per_device", steps=worker.STEPS - skipped, skipped=skipped, clip=0.05)
    assert [r["param_dtype"] for r in ranks] == ["torch.bfloat16", "torch.float16"] * 2
    by_name: dict[str, list[list[float]]] = {}
    for r in ranks:
        wire = torch.bfloat16 if r["param_dtype"] == "torch.bfloat16" else torch.float16
        for name, master in r["masters"].items():
            by_name.setdefault(name, []).append(master)
            rounded = torch.tensor(master, dtype=torch.float64).to(wire).double().tolist()
            assert r["rank_params"][name] == rounded, f"rank {r['rank']}: {name}"
    assert all(len(held) >= 2 and all(m == held[0] for m in held) for held in by_name.values())


def _plan(pipelines, zero_stage=0, devices=8, dtype="fp32"):
    return Plan(cluster="local", cluster_devices=tuple(f"d{i}" for i in range(devices)),
                model={"name": "mlp6", "num_layers": 6}, global_batch_size=sum(p.samples for p in pipelines),
                dtype=dtype, mode="manual", zero_stage=zero_stage, pipelines=tuple(pipelines))


def _pipe(devs, bounds, micro=2, samples=4):
    stages = tuple(Stage(tuple(d) if isinstance(d, tuple) else (d,), (a, b)) for d, a, b in
                   zip(devs, bounds, bounds[1:]))
    return Pipeline(stages, micro_batch_size=micro, samples=samples)


@pytest.mark.parametrize("plan, field, world", [
    (_plan([_pipe([("d0", "d1", "d2")], [0, 6]), _pipe([("d3", "d4")], [0, 6])]),
     "plan.pipelines[1].stages[0].tp", None),  # tp 2 beside tp 3: no common unit to reduce a shard in
    (_plan([_pipe([("d0", "d1")], [0, 6]), _pipe(["d2"], [0, 6])], dtype="fp16", zero_stage=2), "plan.zero_stage",
     None),  # tensor parallelism runs per replica, which shards the optimizer state only (ZeRO 1)
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2", "d3"], [0, 4, 6])], zero_stage=2), "plan.zero_stage",
     None),
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])]), "WORLD_SIZE", 4),
    (_plan([_pipe(["d0"], [0, 6], micro=1, samples=4), _pipe(["d1"], [0, 6], micro=3, samples=3)], zero_stage=2),
     "plan.pipelines[1].samples", None),  # ZeRO 2: 4 micro-batches everywhere, and 3 samples cannot make 4
    (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2", "d3"], [0, 3, 6])]), "WORLD_SIZE", 2),
])
def test_plans_deepspeed_cannot_run_are_refused_naming_the_field(plan, field, world):
    with pytest.raises(ConfigError) as err:
        check_runnable(plan, world)
    assert err.value.field == field
    assert f"`{field}`" in str(err.value) and "must" in str(err.value)


def test_aligned_pipelines_are_runnable_with_clipping_at_zero_0_and_1():
    # ZeRO 0: DeepSpeed 0.19 would clip by stage 0's norm only, so the runner clips itself (tested multi-rank)
    plan = _plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2", "d3"], [0, 3, 6])])
    assert check_runnable(plan, 4).parts == ((0, 3, 6),) * 2
    assert check_runnable(_plan(plan.pipelines, zero_stage=1), 4).is_aligned


def test_asymmetric_plans_are_runnable_at_zero_0_with_clipping():
    # replicas of different lengths and boundaries: each its own grid, the runtime clips by the global norm
    plan = _plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6]), _pipe(["d3", "d4"], [0, 4, 6])])
    layout = check_runnable(plan, 5)
    assert not layout.is_aligned
    assert layout.stage_ranks == ((0, 1), (2,), (3, 4))
    assert layout.holders(0) == (0, 2, 3) and layout.holders(3) == (1, 2, 3) and layout.holders(5) == (1, 2, 4)
    assert layout.holder_sets == ((0, 2, 3), (1, 2, 3), (1, 2, 4))
    assert layout.layers_by_holders(2) == [((0, 2, 3), [0, 1, 2]), ((1, 2, 3), [3]), ((1, 2, 4), [4, 5])]


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_per_replica_plans_run_zero_1_and_tell_deepspeed_zero_0_without_its_bf16(dtype):
    # the runtime shards within holder sets itself (in bf16 the fp32 masters too, and it clips); DeepSpeed's own
    # ZeRO would shard over the replica's grid, its BF16_Optimizer would keep whole fp32 masters
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.ds_runtime.ds_config import deepspeed_config

    for plan in (_plan([_pipe(["d0", "d1"], [0, 3, 6]), _pipe(["d2"], [0, 6])], zero_stage=1, dtype=dtype),
                 _plan([_pipe([("d0", "d1"), "d2"], [0, 3, 6])], zero_stage=1, dtype=dtype)):
        assert check_runnable(plan, len(plan.used_devices)).per_replica
        settings = TrainSettings(plan.global_batch_size, dtype=dtype, zero_stage=1)
        cfg = deepspeed_config(plan, settings, rank=0, gradient_clipping=1.0)
        assert cfg["zero_optimization"]["stage"] == 0
        assert not cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"] and cfg["gradient_clipping"] == 0.0


def test_importing_the_engine_does_not_import_deepspeed():
    code = "import sys, het_strategy.ds_runtime.engine; print('deepspeed' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.stdout.strip() == "False"
