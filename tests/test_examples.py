"""Every script in examples/ runs as its docstring says (small settings) and prints what it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests._example_runner import EXAMPLES, run_example


pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


_run = run_example


def test_every_example_has_a_test_and_a_run_line_in_its_docstring() -> None:
    # run here or in another test file (tests/test_*example*.py), named as a quoted "<script>.py"
    tested = {name for test in Path(__file__).parent.glob("test_*example*.py")
              for name in re.findall(r'"([a-z_]+\.py)"', test.read_text())}
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}  # _digits.py: their data
    assert scripts <= tested, scripts - tested
    for name in scripts:
        assert f"examples/{name}" in (EXAMPLES / name).read_text().split('"""')[1]


def test_own_model_on_own_cluster_yaml() -> None:
    out = _run("own_model_hetero.py", "--epochs", "1")
    shares = re.search(r"shares per rank: \[(\d+), (\d+), (\d+)\]; final validation accuracy ([0-9.]+)", out)
    assert shares, out[-2000:]
    assert [int(shares.group(i)) for i in (1, 2, 3)] == [24, 12, 12]  # speeds 1 : 0.5 : 0.5 of 48
    assert float(shares.group(4)) > 0.5  # 10 classes: chance is 0.1


def test_diloco_across_two_sites() -> None:
    out = _run("diloco_two_sites.py", "--epochs", "1")
    found = re.search(r"groups \[\['lab0', 'lab1'\], \['cloud0', 'cloud1'\]\], shares per rank \[(\d+), (\d+), (\d+), "
                      r"(\d+)\], an outer step every (\d+) inner steps in (\w+): (\d+) outer steps, (\d+) bytes sent "
                      r"per group in the last; final validation accuracy ([0-9.]+)", out)
    assert found, out[-2000:]
    shares = [int(found.group(i)) for i in (1, 2, 3, 4)]
    assert sum(shares) == 64 and shares[0] > shares[2]  # the speed-1 site takes more samples per inner step
    h, rounds = int(found.group(5)), int(found.group(7))
    assert 1 <= h <= 8 and rounds >= 24 // h  # 1500 / 64 = 24 steps in the epoch
    assert int(found.group(8)) > 0 and float(found.group(9)) > 0.5  # 10 classes: chance is 0.1


def test_plain_ddp_with_the_compression_hook() -> None:
    out = _run("plain_ddp_compression.py", "--steps", "30")
    found = re.search(r"held-out accuracy ([0-9.]+), .* \(([0-9.]+)x less\)", out)
    assert found, out
    # 4-bit gradients after 10 uncompressed warm-up steps of 30: 2.3x fewer bytes measured (100 steps: more)
    assert float(found.group(1)) > 0.5 and float(found.group(2)) > 2.0


def test_moe_layer_in_a_users_model_places_experts_by_speed() -> None:
    out = _run("moe_uneven_experts.py", "--epochs", "1")
    found = re.search(r"experts per rank \[([0-9, ]+)\]; shares per rank \[([0-9, ]+)\]; final validation "
                      r"accuracy ([0-9.]+)", out)
    assert found, out[-2000:]
    assert found.group(1) == "4, 4, 2, 2" and found.group(2) == "16, 16, 8, 8"
    assert float(found.group(3)) > 0.3


def test_the_pytorch_lightning_flavour() -> None:
    out = _run("pytorch_lightning_hetero.py", "--epochs", "1")
    found = re.search(r"pytorch_lightning [0-9.]+: shares per rank \[(\d+), (\d+)\]; final validation accuracy "
                      r"([0-9.]+)", out)
    assert found, out[-2000:]
    assert [int(found.group(1)), int(found.group(2))] == [32, 16]  # speeds 1 : 0.5 of 48
    assert float(found.group(3)) > 0.5
    # a model this small: its costs are a rough estimate, and local_cpu2's emulated time is far below the real one
    assert "note: rough estimate" in out and "the emulation has no visible effect" in out


def test_own_model_as_a_deepspeed_pipeline_over_unequal_devices() -> None:
    out = _run("pipeline_deepspeed.py", "--epochs", "1")
    found = re.search(r"planned stages: fast blocks 0-(\d+); slow blocks (\d+)-7;", out)
    loss = re.search(r"epoch 0: validation loss ([0-9.]+)", out)
    assert found and loss, out[-2000:]
    fast_blocks, slow_blocks = int(found.group(1)) + 1, 8 - int(found.group(2))
    assert int(found.group(2)) == fast_blocks and fast_blocks > slow_blocks >= 1  # speeds 1 : 0.4
    assert float(loss.group(1)) < 2.2  # 10 classes: chance is ln 10 = 2.30


def test_own_blocks_split_over_two_devices_by_their_tensor_parallel_plan() -> None:
    out = _run("tensor_parallel_deepspeed.py", "--epochs", "1")
    shards = re.findall(r"rank (\d): block fc1 weight \((\d+), (\d+)\) of \((\d+), (\d+)\)", out)
    loss = re.search(r"epoch 0: validation loss ([0-9.]+)", out)
    assert len(shards) == 2 and loss, out[-2000:]
    for _, rows, cols, full_rows, full_cols in shards:  # each rank holds half of fc1's output features
        assert (int(rows) * 2, int(cols)) == (int(full_rows), int(full_cols))
    assert float(loss.group(1)) < 1.0  # 10 classes: chance is ln 10 = 2.30


def test_own_model_with_compression_and_straggler_mitigation() -> None:
    out = _run("compression_and_stragglers.py", "--epochs", "1")
    found = re.search(r"shares \[(\d+), (\d+), (\d+)\] -> \[(\d+), (\d+), (\d+)\]; (\d+) decision\(s\); gradients "
                      r"([0-9.]+)x fewer bytes on the wire; final validation accuracy ([0-9.]+)", out)
    assert found, out[-2000:]
    before, after = [int(found.group(i)) for i in (1, 2, 3)], [int(found.group(i)) for i in (4, 5, 6)]
    assert before == [24, 12, 12] and after[2] < 12 and sum(after) == 48  # slow_b, 3x slower, gave work away
    assert int(found.group(7)) >= 1 and "slow_b (rank2)" in out  # the decision names the device as the YAML does
    assert float(found.group(8)) > 2.0 and float(found.group(9)) > 0.5
