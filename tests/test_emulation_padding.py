"""The batch padding: it pads to the emulated time, and says once when that time is far below the real compute."""

from __future__ import annotations

import logging
import time

import pytest

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
