"""A ``hetero_deepspeed`` checkpoint loads into another plan: other boundaries, replicas, world size (``layer_state``).

Two launches of ``_reshard_worker.py``: the first trains 2 Adam steps of one plan and saves, the second loads
that checkpoint into another plan and trains 2 more.  Every rank's parameters then equal one process's 4 steps on
the same global batch, as if the run had never stopped; the client state comes back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

import _ds_engine_worker as base  # noqa: E402
import _reshard_worker as worker  # noqa: E402
from _ds_launch import run_ds_ranks  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402

WORKER = Path(__file__).with_name("_reshard_worker.py")
WORLD = {"pipe": 4, "asym": 4, "dp": 2}


def _phase(tmp: Path, phase: str, plan: str, ckpt: Path, dtype: str = "fp32", zero: int = 0) -> list[dict]:
    out = tmp / f"{phase}-{plan}"
    out.mkdir()
    return run_ds_ranks(WORKER, WORLD[plan], [phase, plan, str(ckpt), dtype, str(zero)], out, 300)


def _reference(steps: int, fresh_optimizer_after: int | None = None) -> dict[str, list[float]]:
    """One process, whole batch, Adam; ``fresh_optimizer_after``: a new Adam (no moments, step 0) from there on."""
    model = torch.nn.Sequential(*(layer.float() for layer in base.build_layers()))
    opt = worker.adam(model.parameters())
    x, y = (t.float() for t in base.batch("pipe"))
    for step in range(steps):
        if step == fresh_optimizer_after:
            opt = worker.adam(model.parameters())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
@pytest.mark.parametrize("first, first_zero, second, second_zero", [("pipe", 0, "asym", 1), ("asym", 0, "dp", 0),
                                                                    ("asym", 1, "dp", 0)])
def test_a_checkpoint_continues_exactly_in_another_plan(tmp_path: Path, first: str, first_zero: int, second: str,
                                                        second_zero: int) -> None:
    """pipe -> asym: DeepSpeed's aligned grid (2 pipelines x 2 stages at [0, 4, 6]) into three replicas of
    different shapes, their Adam moments sharded within the holder sets (ZeRO 1: each holder gets its slice);
    asym -> dp: four ranks into two (world size 4 -> 2), from whole moments and from sharded ones (gathered)."""
    ckpt = tmp_path / "ckpt"
    _phase(tmp_path, "save", first, ckpt, zero=first_zero)
    manifest = json.loads((ckpt / "layers" / "manifest.json").read_text())
    assert manifest["num_layers"] == base.NUM_LAYERS and manifest["optimizer"] == "Adam"
    assert sorted(p.name for p in (ckpt / "layers").glob("layer_*.pt")) == [f"layer_{i:03d}.pt" for i in range(6)]
    ranks = _phase(tmp_path, "load", second, ckpt, zero=second_zero)
    ref = _reference(2 * worker.STEPS)
    covered: set[str] = set()
    for r in ranks:
        assert r["client"]["marker"] == "saved" and r["client"]["global_step"] == worker.STEPS
        assert r["global_steps_loaded"] == worker.STEPS
        for name, values in r["params"].items():
            assert values == pytest.approx(ref[name], rel=1e-5, abs=1e-6), (r["rank"], name)
        covered |= set(r["params"])
    assert covered == set(ref)
    # had only the weights been loaded (Adam's moments and step lost) the parameters would differ beyond the bound
    weights_only = _reference(2 * worker.STEPS, fresh_optimizer_after=worker.STEPS)
    assert any(weights_only[n] != pytest.approx(ref[n], rel=1e-5, abs=1e-6) for n in ref)


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
@pytest.mark.parametrize("asym_zero", [0, 1])
def test_a_bf16_zero_1_checkpoint_loads_its_fp32_masters_into_asymmetric_replicas(tmp_path: Path,
                                                                                 asym_zero: int) -> None:
    """bf16 keeps fp32 master weights and moments apart from the bf16 weights (ZeRO 1 over the aligned grid's
    replicas: DeepSpeed's flat partitions; per asymmetric replica: BF16_Optimizer's at ZeRO 0, the holder sets'
    chunks at ZeRO 1): the new plan's masters are the saved fp32 values exactly, not the bf16 weights rounded,
    and training goes on."""
    ckpt = tmp_path / "ckpt"
    _phase(tmp_path, "save", "pipe", ckpt, "bf16", 1)
    ranks = _phase(tmp_path, "load", "asym", ckpt, "bf16", asym_zero)
    from het_strategy.ds_runtime.checkpoint_files import load_as_data

    saved = {i: load_as_data(ckpt / "layers" / f"layer_{i:03d}.pt") for i in range(base.NUM_LAYERS)}
    rounded = 0
    for r in ranks:
        for name, values in r["masters"].items():
            layer, _, local = name.partition(".")
            want = saved[int(layer)][local]["value"].double().flatten()
            assert values == want.tolist(), (r["rank"], name)
            moment = saved[int(layer)][local]["state"]["exp_avg_sq"].double().flatten()
            assert r["moments"][name] == moment.tolist() and moment.abs().sum() > 0, (r["rank"], name)
            rounded += want.tolist() != want.to(torch.bfloat16).double().tolist()
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert rounded > 0  # the masters carry more than bf16 does


@pytest.mark.multiprocess
@pytest.mark.usefixtures("fresh_master_port")
def test_a_per_device_checkpoint_loads_its_masters_and_loss_scale_into_another_plan(tmp_path: Path) -> None:
    """per_device (bf16 and fp16 ranks) at ZeRO 1 on the asymmetric replicas, then at ZeRO 0 on the aligned
    pipelines: the per-layer files carry the holder sets' fp32 masters and moments, and the manifest the one loss
    scale (set to 1024 before saving), so the new plan starts from exactly those and training goes on."""
    ckpt = tmp_path / "ckpt"
    _phase(tmp_path, "save", "asym", ckpt, "per_device", 1)
    ranks = _phase(tmp_path, "load", "pipe", ckpt, "per_device", 0)
    from het_strategy.ds_runtime.checkpoint_files import load_as_data

    saved = {i: load_as_data(ckpt / "layers" / f"layer_{i:03d}.pt") for i in range(base.NUM_LAYERS)}
    for r in ranks:
        assert r["loss_scale"]["cur_scale"] == 1024.0
        for name, values in r["masters"].items():
            layer, _, local = name.partition(".")
            assert values == saved[int(layer)][local]["value"].double().flatten().tolist(), (r["rank"], name)
            moment = saved[int(layer)][local]["state"]["exp_avg_sq"].double().flatten()
            assert r["moments"][name] == moment.tolist() and moment.abs().sum() > 0, (r["rank"], name)
        assert all(torch.isfinite(torch.tensor(r["losses"])))


@pytest.mark.parametrize("name, dtype, zero, refused", [
    ("asym", "fp16", 0, True),  # DeepSpeed's FP16_UnfusedOptimizer per replica: no per-parameter mapping
    ("pipe", "fp16", 1, True),  # DeepSpeed's ZeRO-1 fp16 optimizer on its own grid
    ("asym", "fp16", 1, False),  # the holder sets' fp32 masters and loss scale
    ("pipe", "per_device", 0, False),
])
def test_per_layer_files_refuse_fp16_only_on_deepspeeds_own_fp16_optimizers(name, dtype, zero, refused) -> None:
    import dataclasses
    from types import SimpleNamespace

    from het_strategy.ds_runtime.layer_state import reshard_problem

    plan = {"pipe": base.pipe_plan, "asym": base.asym_plan}[name](zero)
    dtypes = {d: base.PER_DEVICE_DTYPES[i % 2] for i, d in enumerate(plan.cluster_devices)} if dtype == "per_device" \
        else {}
    problem = reshard_problem(SimpleNamespace(plan=dataclasses.replace(plan, dtype=dtype, device_dtypes=dtypes)))
    assert (problem is not None) == refused, problem
    if refused:
        assert problem.startswith("plan.dtype is 'fp16'") and "FP16_Optimizer" in problem


def test_a_checkpoint_of_another_batch_or_dtype_is_refused_naming_the_fields(tmp_path: Path) -> None:
    from het_strategy.strategy.deepspeed_checkpoint import _resharded, check_same_model

    saved = base.pipe_plan().to_dict()
    mine = {**base.asym_plan().to_dict(), "global_batch_size": 16, "dtype": "bf16"}
    with pytest.raises(ConfigError, match="differs in: dtype, global_batch_size"):
        check_same_model(tmp_path, saved, mine)
    diff = check_same_model(tmp_path, saved, base.asym_plan().to_dict())
    assert "pipelines" in diff
    with pytest.raises(ConfigError, match=r"hold per-layer state \(layers/\)"):
        _resharded(None, tmp_path, diff, {})  # type: ignore[arg-type]
