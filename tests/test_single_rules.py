"""Each rule and constant is written once (STYLE.md 12): the source says so, read as text.

A literal that spells a rule (the tensor-parallel degrees, the ZeRO stages, the ring allreduce's ``2(n-1)``)
appears in the package only where the rule is defined; every other place reads the name.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "het_strategy"

def _sources() -> dict[str, str]:
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def _lines_with(pattern: str) -> list[tuple[str, str]]:
    """``(file, line)`` of every line of the package matching ``pattern``."""
    rx = re.compile(pattern)
    return [(name, line.strip()) for name, text in _sources().items()
            for line in text.splitlines() if rx.search(line)]


def test_the_tensor_parallel_degrees_are_written_once() -> None:
    """``core.train_settings.TP_DEGREES``; the planners search it, and ``max_tp``'s checks and messages are built
    from it.  ``TrainSettings.micro_batch_sizes``' default is another list that happens to hold the same
    numbers: the micro-batch sizes searched unless the settings give others."""
    found = _lines_with(r"\(1, 2, 4, 8\)|1, 2, 4 or 8|1, 2, 4, 8 or")
    assert found == [("het_strategy/core/train_settings.py", "TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)"),
                     ("het_strategy/core/train_settings.py", "micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)")]


def test_the_zero_stages_are_written_once() -> None:
    found = _lines_with(r"\(0, 1, 2, 3\)|0, 1, 2 or 3|0, 1, 2, 3 or")
    assert found == [("het_strategy/core/train_settings.py", "ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)")]


def test_the_ring_allreduce_factor_is_written_once() -> None:
    """``2(n-1)`` steps of ``1/n`` of the buffer: ``core.network.ring_steps``; the codecs' bytes, the cost
    model's times, the link probe's bus bandwidth and Sailor's simulator read it.  The hierarchical exchange's
    reduce to the node leader and broadcast back (``core/compressed_sync.py``) is another collective:
    ``(L-1)/L`` of the bytes each way, with two latencies, not ``2(L-1)``."""
    found = sorted(_lines_with(r"2 \* \(\w+ - 1\)"))
    assert found == [("het_strategy/core/compressed_sync.py",
                      "intra = 0.0 if local <= 1 else 2 * (local - 1) / local * b / intra_bw + 2 * latency_s"),
                     ("het_strategy/core/network.py", "return 2 * (members - 1)")]


@pytest.mark.parametrize("world, num_bytes", [(1, 100), (2, 100), (3, 1000), (8, 4096)])
def test_the_ring_bytes_and_time_follow_the_one_rule(world: int, num_bytes: int) -> None:
    from het_strategy.core.network import ring_allreduce_bytes, ring_allreduce_time_s, ring_steps

    assert ring_steps(world) == 2 * (world - 1)
    assert ring_allreduce_bytes(num_bytes, world) == 2 * (world - 1) * num_bytes // world
    assert ring_allreduce_time_s(num_bytes, world, 1e9, 1e-5) == 2 * (world - 1) * (1e-5 + num_bytes / world / 1e9)


def test_the_precision_tables_are_written_once() -> None:
    """Lightning's precision strings -> dtypes: ``core.dtypes.PRECISION_DTYPES``; what the deepspeed runtime runs
    of them: ``core.runtime_rules.DEEPSPEED_PRECISIONS``."""
    from het_strategy.core.dtypes import PRECISION_DTYPES
    from het_strategy.core.runtime_rules import DEEPSPEED_PRECISIONS

    assert _lines_with(r"^\s*PRECISION_DTYPES\b.*=") == [
        ("het_strategy/core/dtypes.py", "PRECISION_DTYPES: dict[str, Dtype] = {")]
    assert _lines_with(r"^\s*DEEPSPEED_PRECISIONS\b.*=") == [
        ("het_strategy/core/runtime_rules.py", 'DEEPSPEED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", '
                                               '"16-mixed", "per_device")')]
    assert set(DEEPSPEED_PRECISIONS) <= set(PRECISION_DTYPES)


def test_who_clips_is_decided_by_the_rule_table() -> None:
    """``core.runtime_rules.clipping_owner`` decides; the DeepSpeed runtime's config and engine read it and hand
    the reducer or sharding the norm to clip to (``test_runtime_rules.test_one_rule_says_who_clips...``)."""
    sources = _sources()
    for name in ("het_strategy/ds_runtime/ds_config.py", "het_strategy/ds_runtime/engine.py"):
        assert "clipping_owner(plan" in sources[name], name  # (plan) or (plan, param_dtype)
    assert _lines_with(r"own_clip\b|\"bf16\", \{\}\)\.get\(\"enabled\"\)") == []


def test_sailors_data_sits_under_reference_and_the_planning_core_reads_none() -> None:
    """Other projects' measurements live in ``reference/`` (its ``data/``); the planning core takes them as plain
    data from its caller (``reference.sailor_profiles.request_profile``), never reading that folder itself."""
    from het_strategy.reference.sailor_profiles import SAILOR_DATA_DIR

    assert SAILOR_DATA_DIR == PACKAGE / "reference" / "data" / "sailor"
    assert {"LICENSE", "README.md", "layer_profiles.json"} <= {p.name for p in SAILOR_DATA_DIR.iterdir()}
    assert not (PACKAGE / "core" / "data" / "sailor").exists()
    # and no module of core/ or planning/ imports reference/ (tests/test_layout.py's layers)
    for name, text in _sources().items():
        if name.startswith(("het_strategy/core/", "het_strategy/planning/")):
            assert "read_sailor_json" not in text and "SAILOR_DATA_DIR" not in text, name
