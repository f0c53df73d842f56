"""Checkpoint files are read as data: a crafted pickle is refused, naming the file, and never runs."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.plan import Pipeline, Plan, Stage  # noqa: E402
from het_strategy.ds_runtime.checkpoint_files import load_as_data, read_as_data  # noqa: E402
from het_strategy.strategy.deepspeed_checkpoint import CHECKPOINT_TAG, load_plan_checkpoint  # noqa: E402


class _Payload:
    """Unpickling it creates ``marker``: what a crafted checkpoint would do with a shell command instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _crafted(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": {"w": torch.ones(2)}, "extra": _Payload(marker)}, path)
    return path


def test_a_crafted_file_is_refused_naming_it_and_its_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "model_states.pt", marker)
    with pytest.raises(ConfigError) as err:
        load_as_data(path)
    assert err.value.field == "ckpt_path" and str(path) in str(err.value)
    assert "weights_only=True" in str(err.value) and "it needs getattr, which is not data" in str(err.value)
    assert "\n" not in str(err.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the same file loaded as code does run it: the test can fail
    assert marker.exists()


def test_data_and_deepspeeds_own_state_types_load(tmp_path: Path) -> None:
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    path = tmp_path / "optim_states.pt"
    torch.save({"loss_scaler": DynamicLossScaler(init_scale=2.0 ** 8, scale_window=1000, min_scale=1,
                                                                delayed_shift=2, consecutive_hysteresis=False), "zero_stage": ZeroStageEnum.optimizer_states,
                "state": {"exp_avg": torch.arange(3.0)}, "step": 4}, path)
    loaded = load_as_data(path)
    assert loaded["loss_scaler"].cur_scale == 2.0 ** 8 and loaded["zero_stage"] is ZeroStageEnum.optimizer_states
    assert torch.equal(loaded["state"]["exp_avg"], torch.arange(3.0)) and loaded["step"] == 4


def test_the_engine_reads_its_files_through_the_data_only_loader(tmp_path: Path) -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    engine = types.SimpleNamespace(checkpoint_engine=TorchCheckpointEngine())
    read_as_data(engine)
    reader = engine.checkpoint_engine
    assert isinstance(reader, TorchCheckpointEngine) and type(reader) is not TorchCheckpointEngine
    read_as_data(engine)
    assert engine.checkpoint_engine is reader  # once is enough
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match="hold only data"):
        reader.load(str(_crafted(tmp_path / "layer_00-model_states.pt", marker)), map_location=torch.device("cpu"))
    assert not marker.exists()
    reader.save({"w": torch.ones(1)}, str(tmp_path / "ok.pt"))  # saving stays DeepSpeed's
    assert torch.equal(reader.load(str(tmp_path / "ok.pt"))["w"], torch.ones(1))


def test_a_crafted_hetero_deepspeed_checkpoint_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    plan = Plan(cluster="local", cluster_devices=("cpu0",), model={"name": "m", "num_layers": 2},
                global_batch_size=2, pipelines=(Pipeline((Stage(("cpu0",), (0, 2)),), 2, 2),), mode="manual")
    marker = tmp_path / "ran"
    _crafted(tmp_path / "ckpt" / CHECKPOINT_TAG / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(ConfigError) as err:
        load_plan_checkpoint(None, plan, tmp_path / "ckpt")  # type: ignore[arg-type]  (refused before the runner)
    assert err.value.field == "ckpt_path" and "mp_rank_00_model_states.pt" in str(err.value)
    assert not marker.exists()
