"""``planner.profile=measured``: a Hugging Face config built here and timed per pipeline unit
(``hf.layer_profile.profile_hf_model``), planned by ``het-plan``, and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from het_strategy.core.errors import ConfigError
from het_strategy.core.hf_config import hf_workload
from het_strategy.hf.layer_profile import profile_hf_model

SMALL = Path(__file__).parent / "data" / "hf"


@pytest.mark.parametrize("name", ["llama_tiny", "gpt2_tiny"])
def test_the_profile_has_the_workloads_layers_positive_times_and_the_device_type(name: str) -> None:
    result = profile_hf_model(SMALL / f"{name}.json", 16, [1, 2], repeats=1, warmup=0)
    expected = hf_workload(SMALL / f"{name}.json", 16, "fp32")
    num_layers = json.loads((SMALL / f"{name}.json").read_text()).get("num_hidden_layers") or \
        json.loads((SMALL / f"{name}.json").read_text())["n_layer"]
    assert result.workload == expected and result.profile.model == expected.name
    assert (result.device_type, result.device) == ("CPU", "cpu")
    assert set(result.profile.times) == {("CPU", 1)}
    for mb in (1, 2):
        rows = result.profile.layer_times("CPU", 1, mb)
        assert len(rows) == num_layers + 2 == expected.num_layers
        assert all(f > 0 and b > 0 and u is not None and u > 0 for f, b, u in rows)


def test_a_built_model_is_timed_as_it_is_and_left_unchanged() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads((SMALL / "llama_tied_tiny.json").read_text())
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = AutoModelForCausalLM.from_config(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = profile_hf_model(model, 8, [1], repeats=1, warmup=0, device_type="A100-80GB")
    assert set(result.profile.times) == {("A100-80GB", 1)}
    assert len(result.profile.layer_times("A100-80GB", 1, 1)) == config.num_hidden_layers + 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_too_large_for_this_machine_is_refused_before_it_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    import het_strategy.hf.layer_profile as layer_profile

    monkeypatch.setattr(layer_profile, "_free_bytes", lambda device: 1000)
    monkeypatch.setattr(layer_profile, "_build", lambda *a: pytest.fail("built a model that does not fit"))
    with pytest.raises(ConfigError, match=r"`config` is '.*llama_tiny.json'; it must fit this machine's memory to "
                                          r"be profiled: its weights and gradients take .* GiB are free on cpu"):
        profile_hf_model(SMALL / "llama_tiny.json", 16, [1])


def test_het_plan_prices_the_measured_device_type_and_writes_a_plan(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture) -> None:
    from het_strategy.cli.plan_cli import main

    args = [f"model={SMALL / 'llama_tiny.json'}", "model.seq_len=16", "cluster=local_cpu2", "settings.dtype=fp32",
            "settings.global_batch_size=8", "settings.micro_batch_sizes=[1,2]", "model_input.repeats=1",
            f"output.dir={tmp_path}"]
    assert main([*args, "planner.profile=measured"]) == 0
    out = capsys.readouterr().out
    assert "compute priced by: measured per-layer times of llama_tiny for CPU tp 1\n" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model"]["name"] == "llama_tiny" and plan["model"]["num_layers"] == 5
    assert main([*args, "output.plan=null"]) == 0  # without the option: the datasheet figures
    assert "measured per-layer times" not in capsys.readouterr().out


@pytest.mark.parametrize(("extra", "message"), [
    (["model=gpt_small", "planner.profile=measured"],
     "`planner.profile` is 'measured'; it must go with model=<config.json or model directory>"),
    ([f"model={SMALL / 'llama_tiny.json'}", "planner.profile=measure"],
     "`planner.profile` is 'measure'; it must be one of sailor, measured or null"),
    ([f"model={SMALL / 'llama_tiny.json'}", "planner.profile=measured", "settings.dtype=per_device"],
     "`settings.dtype` is 'per_device'; it must be fp32, fp16 or bf16 with planner.profile=measured"),
])
def test_het_plan_refuses_in_one_line(extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from het_strategy.cli.plan_cli import main

    assert main(["cluster=local_cpu2", "output.plan=null", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
