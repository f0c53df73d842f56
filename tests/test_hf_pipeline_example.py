"""``examples/hf_llama_pipeline.py`` runs as its docstring says (reduced): a Hugging Face Llama held by a
LightningModule, cut by its own pp and tp plans on the emulated mixed cluster, one tp-2 stage, saved back."""

from __future__ import annotations

import re

import pytest

from tests._example_runner import run_example

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_a_hugging_face_llama_trains_as_a_pipeline_with_a_tp_2_stage(tmp_path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("deepspeed")
    out = run_example("hf_llama_pipeline.py", "--steps", "3", "--save", str(tmp_path / "trained"))
    found = re.findall(r"rank (\d): (layer 0 q_proj \((\d+), 64\) of \(64, 64\)|no decoder layer 0); train loss "
                       r"([0-9.]+) -> ([0-9.]+) in 3 steps", out)
    assert len(found) == 3, out[-2000:]
    shards = {int(rank): rows for rank, _, rows, _, _ in found}
    assert shards == {0: "32", 1: "32", 2: ""}  # the tp-2 stage's two ranks hold half the query heads each
    first, last = float(found[0][3]), float(found[0][4])
    assert first == pytest.approx(5.55, abs=0.1) and last < first  # ln 256 = 5.55 at chance
    saved = re.search(r"from_pretrained reloads (\d+) parameters of (\d+), the trained embedding (\w+)", out)
    assert saved and saved.group(1) == saved.group(2), out[-2000:]  # every tensor written back whole
    assert saved.group(3) == "exactly"
