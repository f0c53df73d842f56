"""Sailor's per-stage memory formula (``reference/sailor_memory.py``) against sums done by hand.

Figures used below, from the vendored ``layer_memory.json`` (OPT-350, per device):
  tp 1: embedding (layer 0) params_floats 53,608,448; block (layer 1) params_floats 12,596,224,
        act_mem_floats 90,181,632; head (layer 25) params_floats 51,513,344, act_mem_floats 208,673,536.
  tp 4: embedding params_floats 15,073,280, act_mem_floats 2,101,760; every block params_floats 3,153,664,
        act_mem_floats 27,398,144 for layer 1 and 27,267,072 for layers 2-24.
"""

from __future__ import annotations

import pytest

from het_strategy.core.errors import ConfigError
from het_strategy.reference.sailor_memory import (SAILOR_ADAM_BYTES_PER_PARAM, SAILOR_SGD_BYTES_PER_PARAM,
                                                  sailor_stage_fits, sailor_stage_memory)


def test_one_block_one_stage_tp1() -> None:
    # state 12,596,224 x 24 = 302,309,376; activations 90,181,632 x mbs 1 x 4 B x 1 in flight = 360,726,528;
    # overhead 2e9 (tp 1); total 2,663,035,904
    mem = sailor_stage_memory(1, 2, tp=1, micro_batch=1, stage_index=0, num_stages=1)
    assert SAILOR_ADAM_BYTES_PER_PARAM == 24 and SAILOR_SGD_BYTES_PER_PARAM == 20
    assert mem.model_state_bytes == 302_309_376
    assert mem.activation_bytes == 360_726_528
    assert mem.overhead_bytes == 2e9
    assert mem.in_flight == 1
    assert mem.total_bytes == 2_663_035_904


def test_first_of_four_stages_tp4_mbs8_is_the_issues_v100_example() -> None:
    # layers [0, 5) = embedding + 4 blocks at tp 4:
    # params 15,073,280 + 4 x 3,153,664 = 27,687,936 -> x 24 = 664,510,464
    # activations (2,101,760 + 27,398,144 + 3 x 27,267,072) = 111,301,120 floats x mbs 8 x 4 B x 4 in flight
    #   = 14,246,543,360
    # overhead 3e9 (tp > 1); total 17,911,053,824 B = 16.68 GiB > 16 GiB: does not fit a V100-16, fits an A100-40
    mem = sailor_stage_memory(0, 5, tp=4, micro_batch=8, stage_index=0, num_stages=4)
    assert mem.model_state_bytes == 664_510_464
    assert mem.activation_bytes == 14_246_543_360
    assert mem.overhead_bytes == 3e9
    assert mem.in_flight == 4
    assert mem.total_bytes == 17_911_053_824
    assert mem.total_bytes / 2**30 == pytest.approx(16.681, abs=1e-3)
    assert not sailor_stage_fits(mem, "V100-16")
    assert sailor_stage_fits(mem, "A100-40")


def test_last_stage_holds_one_micro_batch_and_fp16_halves_activations() -> None:
    # head [25, 26), stage 3 of 4 -> 1 in flight; fp16: 2 B per float
    # state 51,513,344 x 24 = 1,236,320,256; activations 208,673,536 x mbs 2 x 2 B x 1 = 834,694,144;
    # overhead 2e9; total 4,071,014,400
    mem = sailor_stage_memory(25, 26, tp=1, micro_batch=2, stage_index=3, num_stages=4, fp16=True)
    assert mem.in_flight == 1
    assert mem.model_state_bytes == 1_236_320_256
    assert mem.activation_bytes == 834_694_144
    assert mem.total_bytes == 4_071_014_400


def test_eth_easl_planner_variant_counts_16_bytes_per_parameter() -> None:
    # as the first case with 16 B/param: 12,596,224 x 16 = 201,539,584 + 360,726,528 + 2e9 = 2,562,266,112
    mem = sailor_stage_memory(1, 2, tp=1, micro_batch=1, stage_index=0, num_stages=1, bytes_per_param=16)
    assert mem.total_bytes == 2_562_266_112


@pytest.mark.parametrize(("kwargs", "field", "value"), [
    ({"model": "GPT-5"}, "model", "GPT-5"),
    ({"tp": 3}, "tp", 3),
    ({"tp": 16}, "tp", 16),
    ({"stop": 27}, "stop", 27),
    ({"stage_index": 2, "num_stages": 2}, "stage_index", 2),
    ({"micro_batch": 0}, "micro_batch", 0),
])
def test_bad_input_is_refused_naming_the_field(kwargs: dict, field: str, value: object) -> None:
    args = {"start": 0, "stop": 5, "tp": 1, "micro_batch": 1, "stage_index": 0, "num_stages": 1} | kwargs
    with pytest.raises(ConfigError) as err:
        sailor_stage_memory(**args)
    assert err.value.field == field
    assert f"`{field}`" in str(err.value) and repr(value) in str(err.value)


def test_unknown_gpu_is_refused_naming_the_field() -> None:
    mem = sailor_stage_memory(1, 2, tp=1, micro_batch=1, stage_index=0, num_stages=1)
    with pytest.raises(ConfigError, match="`sailor_gpu` is 'H100'") as err:
        sailor_stage_fits(mem, "H100")
    assert err.value.field == "sailor_gpu"
