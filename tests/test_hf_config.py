"""Hugging Face config.json files as workloads: each family's fields, the refusals, the parameter counts against the
model transformers builds (meta device), and ``het-plan model=<config.json>``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from het_strategy.core.block_costs import NormKind
from het_strategy.core.errors import ConfigError
from het_strategy.core.hf_config import hf_workload
from het_strategy.core.hf_fields import DEFAULT_SEQ_LEN, HF_FAMILIES, read_hf_config
from het_strategy.core.workload import load_workload

SMALL = Path(__file__).parent / "data" / "hf"
PUBLISHED = Path(__file__).parents[1] / "het_strategy" / "reference" / "data" / "hf_configs"


def _raw(name: str, folder: Path = SMALL) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def test_each_family_is_read_with_its_own_field_names() -> None:
    llama = read_hf_config(SMALL / "llama_tiny.json")
    assert (llama.model_type, llama.name, llama.num_layers, llama.num_heads, llama.num_kv_heads, llama.head_dim) == \
        ("llama", "llama_tiny", 3, 4, 2, 16)
    assert llama.gated_mlp and llama.rotary and llama.norm == NormKind.rmsnorm and not llama.tie_word_embeddings
    assert not (llama.qkv_bias or llama.out_bias or llama.mlp_bias or llama.qk_norm or llama.position_table)
    tied = read_hf_config(SMALL / "llama_tied_tiny.json")
    assert tied.tie_word_embeddings and tied.qkv_bias and tied.out_bias and tied.mlp_bias
    qwen2 = read_hf_config(SMALL / "qwen2_tiny.json")
    assert qwen2.qkv_bias and not qwen2.out_bias
    qwen3 = read_hf_config(SMALL / "qwen3_tiny.json")
    assert qwen3.qk_norm and qwen3.head_dim == 32
    mixtral = read_hf_config(SMALL / "mixtral_tiny.json")
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_intermediate_size) == (4, 2, 160)
    qwen2_moe = read_hf_config(SMALL / "qwen2_moe_tiny.json")
    assert (qwen2_moe.num_experts, qwen2_moe.top_k, qwen2_moe.expert_intermediate_size,
            qwen2_moe.shared_expert_intermediate_size, qwen2_moe.mlp_only_layers) == (6, 2, 48, 96, (0,))
    qwen3_moe = read_hf_config(SMALL / "qwen3_moe_tiny.json")
    assert qwen3_moe.decoder_sparse_step == 2 and qwen3_moe.qk_norm
    gpt2 = read_hf_config(SMALL / "gpt2_tiny.json")
    assert (gpt2.hidden_size, gpt2.num_layers, gpt2.intermediate_size, gpt2.hidden_act) == (64, 3, 256, "gelu_new")
    assert gpt2.norm == NormKind.layernorm and gpt2.tie_word_embeddings and gpt2.position_table and gpt2.dropout
    assert set(HF_FAMILIES) == {"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gpt2"}


def test_the_layer_layout_is_embedding_blocks_head_and_moe_blocks_follow_the_config() -> None:
    w = hf_workload(SMALL / "qwen3_moe_tiny.json", 32)
    assert [layer.name for layer in w.layers] == ["embedding", "block0", "block1", "block2", "block3", "head"]
    assert [layer.moe is not None for layer in w.layers[1:-1]] == [False, True, False, True]  # decoder_sparse_step 2
    w = hf_workload(SMALL / "qwen2_moe_tiny.json", 32)
    assert [layer.moe is not None for layer in w.layers[1:-1]] == [False, True, True, True]  # mlp_only_layers [0]


def test_a_config_file_a_directory_a_mapping_and_the_source_mapping_give_one_workload(tmp_path: Path) -> None:
    (tmp_path / "My-Llama").mkdir()
    (tmp_path / "My-Llama" / "config.json").write_text((SMALL / "llama_tiny.json").read_text())
    from_dir = load_workload(tmp_path / "My-Llama", seq_len=64)
    assert from_dir.name == "My-Llama" and from_dir.seq_len == 64
    from_file = hf_workload(SMALL / "llama_tiny.json", 64)
    source = load_workload({"hf_config": str(SMALL / "llama_tiny.json"), "seq_len": 64, "name": "x"})
    assert source.name == "x"
    for other in (from_dir, source, hf_workload(_raw("llama_tiny"), 64)):
        assert other.layers == from_file.layers
    assert load_workload(SMALL / "gpt2_tiny.json").seq_len == min(DEFAULT_SEQ_LEN, 256)  # capped by n_positions


def test_a_transformers_config_dict_gives_the_workload_of_its_file() -> None:
    transformers = pytest.importorskip("transformers")
    for path in sorted(SMALL.glob("*.json")):
        raw = json.loads(path.read_text())
        as_dict = transformers.AutoConfig.for_model(**raw).to_dict()
        assert hf_workload(as_dict, 32).layers == hf_workload(raw, 32).layers, path.stem


_REQUIRED = [("llama_tiny", key) for key in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "vocab_size")] + [
    ("mixtral_tiny", "num_local_experts"), ("mixtral_tiny", "num_experts_per_tok"),
    ("qwen2_moe_tiny", "num_experts"), ("qwen2_moe_tiny", "moe_intermediate_size"),
    ("qwen2_moe_tiny", "shared_expert_intermediate_size"), ("qwen3_moe_tiny", "moe_intermediate_size"),
    ("gpt2_tiny", "n_embd"), ("gpt2_tiny", "n_layer"), ("gpt2_tiny", "n_head"), ("gpt2_tiny", "n_positions"),
    ("gpt2_tiny", "vocab_size"), ("llama_tiny", "model_type")]


@pytest.mark.parametrize(("name", "key"), _REQUIRED)
def test_a_missing_field_is_one_line_naming_it(name: str, key: str, tmp_path: Path) -> None:
    raw = _raw(name)
    del raw[key]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        hf_workload(path, 32)
    message = str(err.value)
    assert f"`model.{key}`" in message and "\n" not in message and str(path) in message


@pytest.mark.parametrize(("change", "field", "rule"), [
    ({"model_type": "bert"}, "model.model_type", "be one of llama, mistral"),
    ({"num_key_value_heads": 3}, "model.num_key_value_heads", "divide num_attention_heads (4)"),
    ({"num_key_value_heads": 0}, "model.num_key_value_heads", "be >= 1"),
    ({"hidden_size": 65}, "model.hidden_size", "be divisible by num_attention_heads (4)"),
    ({"hidden_size": "64"}, "model.hidden_size", "be an integer"),
    ({"tie_word_embeddings": "yes"}, "model.tie_word_embeddings", "be true or false"),
    ({"hidden_act": "mish"}, "model.hidden_act", "be one of gelu"),
])
def test_a_bad_field_names_the_field_and_the_rule(change: dict, field: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        hf_workload(_raw("llama_tiny") | change, 32)
    assert err.value.field == field and rule in str(err.value)


@pytest.mark.parametrize(("name", "change", "field"), [
    ("mixtral_tiny", {"num_experts_per_tok": 5}, "model.num_experts_per_tok"),
    ("qwen2_moe_tiny", {"mlp_only_layers": [4]}, "model.mlp_only_layers[0]"),
    ("qwen2_moe_tiny", {"mlp_only_layers": 1}, "model.mlp_only_layers"),
    ("gpt2_tiny", {"resid_pdrop": "x"}, "model.resid_pdrop"),
])
def test_a_bad_moe_or_gpt2_field_is_named(name: str, change: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        hf_workload(_raw(name) | change, 32)
    assert err.value.field == field


def test_the_sequence_length_is_the_callers_and_at_most_max_position_embeddings(tmp_path: Path) -> None:
    assert hf_workload(SMALL / "llama_tiny.json", 256).seq_len == 256
    with pytest.raises(ConfigError, match=r"`model.seq_len` is 257; it must be <= max_position_embeddings \(256\)"):
        hf_workload(SMALL / "llama_tiny.json", 257)
    with pytest.raises(ConfigError, match="`model.seq_len` is 0"):
        hf_workload(SMALL / "llama_tiny.json", 0)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ConfigError, match="hold a JSON object"):
        hf_workload(tmp_path / "list.json", 32)
    with pytest.raises(ConfigError, match="holding config.json"):
        load_workload(tmp_path)  # a directory without config.json


_COUNTED = ["llama3_8b", "llama3_2_1b", "qwen2_7b", "qwen2_0_5b", "mistral_7b_v0_1", "mixtral_8x7b", "qwen3_30b_a3b",
            "qwen1_5_moe_a2_7b", "gpt2"]


@pytest.mark.parametrize("name", _COUNTED)
def test_parameter_counts_equal_the_model_transformers_builds(name: str) -> None:
    """Total and (MoE) active parameters per token against ``sum(p.numel())`` of the meta-device model; active: the
    total less (E - k)/E of the routed experts."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = _raw(name, PUBLISHED)
    config = transformers.AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    num = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    active = total - (experts * (num - config.num_experts_per_tok) // num if num else 0)
    w = hf_workload(raw, 128)
    assert abs(w.total_params - total) <= 1e-4 * total
    assert abs(w.active_params_per_token - active) <= 1e-4 * active
    assert w.fingerprint()["total_params"] == w.total_params
    assert ("active_params_per_token" in w.fingerprint()) == bool(num)


def test_het_plan_plans_a_config_json_and_records_the_counts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from het_strategy.cli.plan_cli import main

    code = main([f"model={SMALL / 'mixtral_tiny.json'}", "model.seq_len=64", "cluster=local_cpu4_mixed",
                 "settings.global_batch_size=8", f"output.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0
    assert "model: mixtral_tiny from" in out and "seq_len 64 tokens (model.seq_len)" in out
    model = json.loads((tmp_path / "plan.json").read_text())["model"]
    expected = hf_workload(SMALL / "mixtral_tiny.json", 64)
    assert model == {"name": "mixtral_tiny", "num_layers": 5, "total_params": expected.total_params, "seq_len": 64,
                     "active_params_per_token": expected.active_params_per_token}


@pytest.mark.parametrize(("extra", "message"), [
    (["model.seq_len=300"], "`model.seq_len` is 300; it must be <= max_position_embeddings (256)"),
    (["model.num_layers=2"], "`model.num_layers` is '2'; it must not be set with model=<config.json>"),
])
def test_het_plan_refuses_in_one_line(extra: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    from het_strategy.cli.plan_cli import main

    assert main([f"model={SMALL / 'llama_tiny.json'}", "cluster=local_cpu4_mixed", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_tied_matrix_is_held_once_by_a_stage_with_the_embedding_and_by_the_heads_stage_alone() -> None:
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.train_settings import TrainSettings

    tied, untied = (hf_workload(_raw("llama3_2_1b", PUBLISHED) | {"tie_word_embeddings": t}, 512) for t in (True, False))
    matrix = 128256 * 2048
    assert untied.total_params - tied.total_params == matrix
    cm = CostModel(load_cluster("local_cpu4_mixed"), tied, TrainSettings(global_batch_size=8))
    L = tied.num_layers
    assert cm.stage_param_count(0, L) == tied.total_params  # one stage: the matrix once
    assert cm.stage_param_count(L - 1, L) == tied.layers[-1].params  # the head's stage holds its copy
    whole = cm.memory_matrix(1, 1, 1, 1)
    assert whole[0, L] == cm.stage_memory_bytes(0, L, 1, 1, 1, 1)
    assert whole[1, L] == cm.stage_memory_bytes(1, L, 1, 1, 1, 1)


def test_planning_a_config_json_imports_no_torch_and_no_transformers(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from het_strategy.cli.plan_cli import main; "
            f"rc = main(['model={SMALL / 'qwen2_moe_tiny.json'}', 'cluster=local_cpu4_mixed', 'model.seq_len=32', "
            f"'settings.global_batch_size=8', 'output.dir={tmp_path}']); "
            "assert rc == 0; assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'loaded'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_model_yaml_describes_a_modern_block_with_the_same_keys() -> None:
    mapping = read_hf_config(SMALL / "qwen2_moe_tiny.json").model_mapping(32)
    assert load_workload(mapping).layers == hf_workload(SMALL / "qwen2_moe_tiny.json", 32).layers
    for key, value, rule in (("norm", "batchnorm", "be one of"), ("num_kv_heads", 3, "divide model.num_heads (4)"),
                             ("dense_blocks", [9], "be < model.num_layers (4)")):
        with pytest.raises(ConfigError) as err:
            load_workload(mapping | {key: value})
        assert err.value.field.startswith(f"model.{key}") and rule in str(err.value)
