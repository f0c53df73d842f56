"""Emitted ds_config + pipeline parts through real ``deepspeed.initialize`` (2 CPU processes, gloo).

Each case starts two worker processes (``_deepspeed_worker.py``) and compares
what they trained with a single-process torch reference of the same model,
data, clipping and SGD steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")
torch = pytest.importorskip("torch")

import _deepspeed_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)
from _ds_launch import run_ds_ranks  # noqa: E402


pytestmark = pytest.mark.multiprocess
WORKER = Path(__file__).with_name("_deepspeed_worker.py")
TIMEOUT_S = 60


def _run_two_ranks(mode: str, out_dir: Path, zero_stage: int) -> list[dict]:
    return run_ds_ranks(WORKER, 2, [mode, str(zero_stage)], out_dir, TIMEOUT_S)


def _reference(split: list[list[tuple[int, int]]]) -> tuple[list[float], dict[str, list[float]]]:
    """Single-process training: per step the mean-over-batch MSE gradient, global-norm clipping, SGD.

    ``split`` lists, per step, the micro-batches (start, stop) whose mean losses
    are averaged to form the step loss (the loss DeepSpeed's pipeline reports).
    """
    model = torch.nn.Sequential(*worker.build_layers())
    opt = torch.optim.SGD(model.parameters(), lr=worker.LR)
    x, y = worker.batch()
    losses = []
    for micro in split:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            losses.append(sum(float(torch.nn.functional.mse_loss(model(x[a:b]), y[a:b])) for a, b in micro) / len(micro))
        torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP)
        opt.step()
    return losses, {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}


def test_pipeline_module_with_uneven_parts_trains_like_one_process(tmp_path):
    # ZeRO-1: DeepSpeed 0.19's fp32 ZeRO-0 pipeline path clips by stage 0's gradient norm only
    # (measured; deepspeed_config warns), while the reference clips by the global norm.
    ranks = _run_two_ranks("pipe", tmp_path, zero_stage=1)
    # each stage holds exactly the plan's layers: [0, 4) on rank 0, [4, 6) on rank 1
    assert [r["parts"] for r in ranks] == [[0, 4, 6], [0, 4, 6]]
    assert ranks[0]["local_layers"] == [0, 1, 2, 3] and ranks[1]["local_layers"] == [4, 5]
    assert {n.split(".")[0] for n in ranks[0]["params"]} == {"0", "1", "2", "3"}
    assert {n.split(".")[0] for n in ranks[1]["params"]} == {"4", "5"}
    assert ranks[0]["config"]["gradient_accumulation_steps"] == 2

    ref_losses, ref_params = _reference([[(0, 2), (2, 4)]] * worker.STEPS)
    for r in ranks:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], rel=1e-5, abs=1e-6), name
    assert ref_losses[-1] < ref_losses[0]
    # clipping was active (so the match checks DeepSpeed's cross-stage norm, not just SGD)
    model = torch.nn.Sequential(*worker.build_layers())
    x, y = worker.batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > worker.CLIP


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_uneven_data_parallel_with_per_rank_accumulation_matches_global_mean(tmp_path, zero_stage):
    # rank 0: 3 samples as micro-batches of 2 and 1 (gas 2); rank 1: 1 sample (gas 1).  DeepSpeed runs
    # different gas per rank at ZeRO 0/1: both reduce once, at each rank's own accumulation boundary.
    ranks = _run_two_ranks("dp", tmp_path, zero_stage)
    assert [r["gas"] for r in ranks] == [2, 1]
    assert [r["global_steps"] for r in ranks] == [worker.STEPS, worker.STEPS]
    _, ref_params = _reference([[(0, 4)]] * worker.STEPS)
    for r in ranks:
        for name, values in r["params"].items():
            assert values == pytest.approx(ref_params[name], rel=1e-5, abs=1e-6), name
