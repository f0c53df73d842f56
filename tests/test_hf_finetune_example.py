"""``examples/hf_finetune_hetero.py`` runs as its docstring says (3 steps) and prints what it promises."""

from __future__ import annotations

import re

import pytest

from tests._example_runner import run_example

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_a_hugging_face_model_with_padded_batches_on_uneven_ranks() -> None:
    pytest.importorskip("transformers")
    out = run_example("hf_finetune_hetero.py", "--steps", "3")
    found = re.search(r"shares per rank \[(\d+), (\d+)\]; first step: samples \[(\d+), (\d+)\], counted tokens "
                      r"\[(\d+), (\d+)\]; train loss ([0-9.]+) -> ([0-9.]+) in 3 steps", out)
    assert found, out[-2000:]
    shares, samples, tokens = ([int(found.group(i)) for i in pair] for pair in ((1, 2), (3, 4), (5, 6)))
    assert sum(shares) == 16 and shares[0] > shares[1] and samples == shares  # speeds 1 : 0.5
    assert tokens[0] / samples[0] != tokens[1] / samples[1]  # the ranks' samples hold different numbers of tokens
    assert "loss_weighting=tokens (auto)" in out
    assert float(found.group(8)) < float(found.group(7)) < 6.0  # from ln 256 = 5.5 (bytes at chance), falling
