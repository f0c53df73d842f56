"""The batch padding: it pads to the emulated time, and says once when that time is far below the real compute."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from het_strategy.core.cluster import cluster_from_dict
from het_strategy.core.workload import load_workload
from het_strategy.emulation.padding import BatchPadding


def _cluster(tflops: float) -> object:
    return cluster_from_dict({"name": "one", "nodes": [{"name": "n", "devices": [
        {"name": "cpu0", "type": "CPU", "tflops": {"fp32": tflops}, "efficiency": 1.0, "emulated_speed": 0.5}]}]})


def _run_batches(padding: BatchPadding, real_s: float, batches: int = 8) -> list[float]:
    pads = []
    for step in range(batches):
        padding.begin(2, step)
        time.sleep(real_s)
        padding.finish()
        pads.append(padding.pad_s)
    return pads


@pytest.mark.parametrize("tflops, warned", [(1000.0, True), (0.02, False)])
def test_a_negligible_emulated_time_is_said_once_with_the_tflops_to_declare(
        tflops: float, warned: bool, caplog: pytest.LogCaptureFixture) -> None:
    padding = BatchPadding.for_device(_cluster(tflops), "cpu0", load_workload("tiny_gpt", "fp32"), "fp32")
    padding.warn = True
    with caplog.at_level(logging.WARNING, logger="het_strategy"):
        pads = _run_batches(padding, 0.01, batches=10)
    lines = [r.getMessage() for r in caplog.records if "emulation has no visible effect" in r.getMessage()]
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert "cpu0 (speed 0.5)" in lines[0] and "declare a lower `tflops`" in lines[0]
        assert max(pads) == 0.0  # nothing to pad: the real compute was already longer
    else:
        assert min(pads) > 0.0  # emulated time dominates: every batch padded


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds``: a stage whose backward is far slower than twice its forward
    (a CPU's fp16 backward is about 6x its forward)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


@pytest.mark.parametrize("trainable", [True, False])
def test_stage_padding_holds_a_slow_backward_to_the_emulated_time(trainable: bool) -> None:
    # emulated: 0.36 s per micro-batch of 4 (0.12 forward, 0.24 backward); real: ~0 forward, 0.15 s backward.
    # Measured at its end, the backward is padded to 0.24 s; without trainable parameters the pad is taken at its
    # start from 2x the real forward (~0), so the real 0.15 s comes on top
    from het_strategy.emulation.stage_padding import StagePadding

    cluster = cluster_from_dict({"name": "one", "nodes": [{"name": "n", "devices": [
        {"name": "cpu0", "type": "CPU", "tflops": {"fp32": 0.008}, "efficiency": 1.0}]}]})
    workload = load_workload("tiny_gpt", "fp32")
    padding = StagePadding(cluster, "cpu0", workload, (0, workload.num_layers))
    emulated = padding.stage_s(4)
    layer = torch.nn.Linear(3, 3)
    layer.requires_grad_(trainable)

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return _SlowBackward.apply(self.layer(x), 0.15)

    stage = Stage()
    padding.attach(stage)
    for _ in range(2):
        x = torch.randn(4, 3, requires_grad=True)
        start = time.perf_counter()
        stage(x).sum().backward()
        took = time.perf_counter() - start
    assert 0.25 < emulated < 0.6
    if trainable:
        assert took == pytest.approx(emulated, abs=0.05)
    else:
        assert took == pytest.approx(emulated + 0.15, abs=0.05)
