"""``examples/fsdp_unequal_memory.py`` runs: a model whose whole state exceeds the small emulated device trains under
``HeteroFSDPStrategy``, every rank's counted peak under its emulated memory."""

from __future__ import annotations

import re

import pytest

from tests._example_runner import run_example

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MIB = {"MiB": 1.0, "GiB": 1024.0}


def _mib(value: str, unit: str) -> float:
    return float(value) * MIB[unit]


def test_fsdp_unequal_memory_example() -> None:
    out = run_example("fsdp_unequal_memory.py", "--steps", "4")
    whole = re.search(r"whole, with gradients and AdamW state: ([0-9.]+) (MiB|GiB), more than the small device's "
                      r"([0-9.]+) (MiB|GiB)", out)
    assert whole, out[-3000:]
    assert _mib(*whole.group(1, 2)) > _mib(*whole.group(3, 4))
    ranks = re.findall(r"rank (\d) (\w+) +shard ([0-9.]+) of every block, (\d+) of 12 samples a step; counted peak "
                       r"([0-9.]+) (MiB|GiB) of its ([0-9.]+) (MiB|GiB)", out)
    assert [r[1] for r in ranks] == ["big", "mid", "small"], out[-3000:]
    shards = [float(r[2]) for r in ranks]
    assert shards[0] > shards[1] > shards[2] > 0 and abs(sum(shards) - 1) < 2e-3  # by memory 48 : 32 : 10
    shares = [int(r[3]) for r in ranks]
    assert sum(shares) == 12 and shares[0] == shares[1] > shares[2]  # by speed 1 : 1 : 0.5
    for r in ranks:
        assert 0 < _mib(r[4], r[5]) <= _mib(r[6], r[7])
    assert "trained 4 steps with hetero_fsdp" in out
