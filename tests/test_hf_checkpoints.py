"""Hugging Face checkpoints in and out (``het_strategy.hf.checkpoints``, ``hf.checkpoint_export``,
``ds_runtime.layer_export``): tiny Llama configs, models built from configs (nothing downloaded).

Single process: the ``save_pretrained`` round trip of the writer, each pipeline stage's load materializing only its
own tensors (from one file and from a sharded index), tp-2 shards reading their slices (``ShardLoad``: after the
split), the per-layer checkpoint conversion, and the refusals.  Multiprocess (2 gloo ranks,
``_hf_checkpoint_worker.py``): ``Trainer.fit`` on ``hetero_deepspeed`` from a ``save_pretrained`` directory, saved
back, reloaded by ``from_pretrained``; a tp-2 stage's ranks reading only their shards, the same run as from the
model loaded whole.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.hf.checkpoint_export import save_units, write_layer_values  # noqa: E402
from het_strategy.hf.checkpoints import (empty_causal_lm, held_bytes, load_rank_units, load_units,  # noqa: E402
                                         release_unheld, split_tensors)
from het_strategy.hf.pipeline_units import hf_pipeline_units  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import _hf_checkpoint_worker as worker  # noqa: E402

WORKER = HERE / "_hf_checkpoint_worker.py"
TINY = worker.CONFIG
STAGES = ((0, 3), (3, 6))
"""A 2-stage plan of the tiny Llama's 6 pipeline units: embedding + layers 0-1, layers 2-3 + head."""


def _model(**extra):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**TINY, **extra}))


def _unit_names(model, start: int, stop: int) -> set[str]:
    return {hf for u in hf_pipeline_units(model)[start:stop] for hf in u.hf_names().values()}


@pytest.mark.parametrize("tied", [False, True])
def test_written_directory_reloads_with_from_pretrained_equal_and_replaces_an_old_one(tmp_path, tied):
    model = _model(tie_word_embeddings=tied)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    save_units(hf_pipeline_units(model), model.config, out)
    assert not (out / "stale.txt").exists() and [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp left
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 6  # one file per pipeline unit
    assert ("lm_head.weight" in index["weight_map"]) is not tied  # a tied matrix is written once
    back = AutoModelForCausalLM.from_pretrained(out)
    want, got = model.state_dict(), back.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert (back.lm_head.weight is back.model.embed_tokens.weight) is tied


@pytest.mark.parametrize("sharded", [False, True])
def test_each_stage_materializes_only_its_own_tensors(tmp_path, sharded):
    source = _model()
    source.save_pretrained(tmp_path / "src", max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file() is sharded
    want = source.state_dict()
    seen: set[str] = set()
    for start, stop in STAGES:
        model = empty_causal_lm(tmp_path / "src")
        assert held_bytes(model) == {}  # built on the meta device: nothing held
        load_rank_units(model, tmp_path / "src", (start, stop))
        held = held_bytes(model)
        assert set(held) == _unit_names(source, start, stop)
        assert sum(held.values()) == sum(want[n].numel() * 4 for n in held)
        assert sum(held.values()) < sum(t.numel() * 4 for t in want.values())  # never the whole model
        params = dict(model.named_parameters())
        assert all(torch.equal(params[n], want[n]) for n in held)
        assert all(q.numel() == 0 for n, q in params.items() if n not in held)  # released: movable, no memory
        seen |= set(held)
    assert seen == set(want)


def test_a_model_loaded_whole_computes_the_sources_logits_and_a_tied_head_reads_the_embedding(tmp_path):
    source = _model(tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "src")
    model = empty_causal_lm(tmp_path / "src")
    load_units(hf_pipeline_units(model), tmp_path / "src")  # the head reads the embedding matrix
    assert release_unheld(model) == 0
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = torch.randint(0, TINY["vocab_size"], (2, 5))
    assert torch.equal(model(x).logits, source(x).logits)
    head_only = empty_causal_lm(tmp_path / "src")
    load_rank_units(head_only, tmp_path / "src", (5, 6))  # a head on a stage of its own reads the embedding's name
    assert set(held_bytes(head_only)) == {"lm_head.weight", "model.norm.weight"}
    assert torch.equal(head_only.lm_head.weight, source.model.embed_tokens.weight)


def test_moe_experts_round_trip_by_the_models_names_and_transformers_layout_is_named(tmp_path):
    torch.manual_seed(0)
    moe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", **{**TINY, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2}))
    save_units(hf_pipeline_units(moe), moe.config, tmp_path / "ours")  # fused experts, by the model's names
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").state_dict()
    assert all(torch.equal(back[k], v) for k, v in moe.state_dict().items())
    model = empty_causal_lm(tmp_path / "ours")
    load_rank_units(model, tmp_path / "ours", (1, 3))  # decoder layer 0 and 1, experts whole
    assert set(held_bytes(model)) == _unit_names(moe, 1, 3)
    moe.save_pretrained(tmp_path / "theirs")  # transformers writes one tensor per expert
    with pytest.raises(ConfigError, match=r"under the model's own name \(it keeps transformers' checkpoint layout "
                       r"of mixtral"):
        load_rank_units(empty_causal_lm(tmp_path / "theirs"), tmp_path / "theirs", (1, 3))


def test_tp2_shards_read_only_their_slices(tmp_path):
    from het_strategy.tensor_parallel.layers import SOURCE, parallelize_layer, shard_of

    source = _model()
    source.save_pretrained(tmp_path / "src")
    want = source.state_dict()
    for tp_rank in (0, 1):
        model = empty_causal_lm(tmp_path / "src")
        units = hf_pipeline_units(model)[1:]  # decoder layers and the head: each has a tp plan
        for unit in units:
            parallelize_layer(unit, unit.tensor_parallel_plan(), None, 2, tp_rank)  # the shards, still on meta
        load_units(units, tmp_path / "src", tp_rank=tp_rank)
        checked = 0
        for unit in units:
            specs, names = unit.tensor_parallel_plan().shard_specs(), unit.hf_names()
            for key, t in unit.state_dict(keep_vars=True).items():
                whole = want[names[key]]
                if hasattr(t, SOURCE):
                    assert torch.equal(t, shard_of(whole, specs[key], 2, tp_rank)), key
                    assert t.numel() * 2 == whole.numel()
                    checked += 1
                else:
                    assert torch.equal(t, whole), key
        assert checked == 4 * 7 + 1  # q, k, v, o, gate, up, down per layer, and lm_head


def test_a_tp_stage_reads_its_shards_after_the_split_and_a_tied_head_cuts_the_embedding_read_whole(tmp_path):
    from het_strategy.tensor_parallel.layers import SOURCE, parallelize_layer, shard_of

    source = _model(tie_word_embeddings=True)
    source.save_pretrained(tmp_path / "src")
    want = source.state_dict()
    model = empty_causal_lm(tmp_path / "src")
    units = hf_pipeline_units(model)
    load = load_rank_units(model, tmp_path / "src", (0, 6), split=True)
    cut = split_tensors(units)
    assert all(t.numel() == 0 for t in cut.values()) and (5, "lm_head.weight") not in cut  # tied: read whole
    stage = torch.nn.ModuleDict({str(i): u for i, u in enumerate(units)})  # as the runtime's pipeline module
    load.prepare(stage)
    assert all(units[i].get_parameter(k).is_meta for i, k in cut)
    for unit in units[1:]:
        parallelize_layer(unit, unit.tensor_parallel_plan(), None, 2, 1)  # the runtime's split: meta shards
    load.load(stage, tp_rank=1)
    for unit in units[1:]:
        specs, names = unit.tensor_parallel_plan().shard_specs(), unit.hf_names()
        for key, t in unit.state_dict(keep_vars=True).items():
            whole = want[names[key]]
            assert torch.equal(t, shard_of(whole, specs[key], 2, 1) if hasattr(t, SOURCE) else whole), key
            if hasattr(t, SOURCE) and key != "lm_head.weight":
                assert getattr(t, SOURCE).numel() == 0  # the optimizer's (empty) parameter, not a whole copy
    assert getattr(units[5].get_parameter("lm_head.weight"), SOURCE) is model.model.embed_tokens.weight
    matrices = [t.numel() * 4 for k, t in want.items() if t.dim() == 2 and k != "lm_head.weight"]  # tied: once
    assert load.bytes_read == sum(t.numel() * 4 for t in want.values() if t.dim() == 1) + matrices[0] + sum(
        matrices[1:]) // 2  # the norms and the (tied) embedding whole, half of every other matrix


def _layer_checkpoint(path: Path, values: list[dict[str, torch.Tensor]]) -> None:
    """A per-layer checkpoint directory as ``ds_runtime.layer_state`` writes it (values only, no optimizer)."""
    layers = path / "layers"
    layers.mkdir(parents=True)
    for i, entries in enumerate(values):
        torch.save({k: {"value": v, "state": {}} for k, v in entries.items()}, layers / f"layer_{i:03d}.pt")
    (layers / "manifest.json").write_text(json.dumps({"format": 1, "num_layers": len(values), "dtype": "fp32"}))


def test_a_per_layer_checkpoint_becomes_a_directory_from_pretrained_loads(tmp_path):
    from het_strategy.ds_runtime.layer_export import layer_checkpoint_to_hf

    source = _model()
    source.config.save_pretrained(tmp_path / "cfg")
    # as the runtime keeps them: each unit's parameters by their names in the unit
    _layer_checkpoint(tmp_path / "ckpt", [{k: v.detach().clone() for k, v in u.named_parameters()}
                                          for u in hf_pipeline_units(source)])
    layer_checkpoint_to_hf(tmp_path / "ckpt", tmp_path / "cfg" / "config.json", tmp_path / "hf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(back[k], v) for k, v in source.state_dict().items())
    with pytest.raises(ConfigError, match=r"`checkpoint` is .*it must hold per-layer files"):
        layer_checkpoint_to_hf(tmp_path / "cfg", tmp_path / "cfg", tmp_path / "x")
    other = AutoConfig.for_model("llama", **{**TINY, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match=r"`config` is 'llama'; it must give the checkpoint's 6 layers"):
        layer_checkpoint_to_hf(tmp_path / "ckpt", other, tmp_path / "x")
    wide = AutoConfig.for_model("llama", **{**TINY, "hidden_size": 64})
    with pytest.raises(ConfigError, match=r"`checkpoint layer 0.token.weight` is \(64, 32\); it must be a tensor"):
        write_layer_values(wide, [{"token.weight": torch.zeros(64, 32)}], tmp_path / "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg", "ckpt", "hf"]  # nothing half-written left


def test_a_directory_without_config_or_weights_and_a_mismatched_config_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"`pretrained` is .*empty'; it must be a save_pretrained directory "
                       r"holding config.json"):
        empty_causal_lm(tmp_path / "empty")
    source = _model()
    source.config.save_pretrained(tmp_path / "config_only")
    with pytest.raises(ConfigError, match=r"it must hold its weights as model.safetensors or "
                       r"model.safetensors.index.json"):
        empty_causal_lm(tmp_path / "config_only")
    source.save_pretrained(tmp_path / "src")
    with torch.device("meta"):
        wider = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **{**TINY, "hidden_size": 64}))
    with pytest.raises(ConfigError, match=r"config.json.hidden_size` is 32; it must equal the model's hidden_size "
                       r"\(64\)"):
        load_rank_units(wider, tmp_path / "src", (0, 3))
    pytest.importorskip("deepspeed")
    from het_strategy import HeteroDeepSpeedStrategy

    with pytest.raises(ConfigError, match=r"`pretrained` is .*config_only'; it must hold its weights"):
        HeteroDeepSpeedStrategy(cluster="local_cpu2", seq_len=8, global_batch_size=4,
                                pretrained=tmp_path / "config_only")


@pytest.mark.multiprocess
def test_fit_from_a_pretrained_directory_saves_back_what_from_pretrained_reloads(tmp_path):
    """Each rank loads only its stage from the directory, trains, and the gathered directory reloads the run: a
    2-stage pipeline, and one tp-2 stage (its shards joined by the writer)."""
    from _ds_launch import run_ds_ranks

    from het_strategy.ds_runtime.layer_export import layer_checkpoint_to_hf

    pytest.importorskip("deepspeed")
    worker.write_source(str(tmp_path / "source"))
    ranks = run_ds_ranks(WORKER, 2, [str(tmp_path / "source"), "2", "pipe,tp,tp_whole"], tmp_path, 300)
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "source")
    for (start, stop), r in zip(STAGES, ranks):
        assert r["pipe"]["layers"] == [start, stop]
        assert set(r["pipe"]["held"]) == _unit_names(source, start, stop)  # only its own stage was materialized
        assert (r["pipe"]["shards"], r["tp"]["shards"]) == (0, 4 * 7 + 1)  # q k v o gate up down per layer, head
    cut = sum(t.numel() * 4 for t in split_tensors(hf_pipeline_units(source)).values())
    whole = sum(t.numel() * 4 for t in source.state_dict().values())
    for r in ranks:  # each tp rank read, and holds, only its half of each tensor the tp plan cuts
        assert (r["tp"]["read"], r["tp"]["shard_bytes"], r["tp"]["source_bytes"]) == (whole - cut // 2, cut // 2, 0)
        assert (r["tp_whole"]["shard_bytes"], r["tp_whole"]["source_bytes"]) == (cut // 2, cut)  # the whole kept
    for r in ranks:  # reading the shards is the same run as splitting the whole model
        assert r["tp"]["losses"] == r["tp_whole"]["losses"]
    by_shards = AutoModelForCausalLM.from_pretrained(tmp_path / "tp" / "hf").state_dict()
    by_whole = AutoModelForCausalLM.from_pretrained(tmp_path / "tp_whole" / "hf").state_dict()
    assert all(torch.equal(by_shards[k], by_whole[k]) for k in by_whole)
    for case in ("pipe", "tp"):
        ids = torch.tensor(ranks[0][case]["first_batch"])
        with torch.no_grad():  # the run started from the directory's weights
            first = float(source(input_ids=ids, labels=ids).loss)
        assert ranks[0][case]["losses"][0] == pytest.approx(first, abs=1e-5)
        assert ranks[0][case]["losses"][-1] < first
        for r in ranks:
            assert abs(r[case]["reload_val"] - r[case]["run_val"]) <= 1e-6
            assert max(r[case]["param_diffs"].values()) == 0.0, case
        assert set(ranks[0][case]["param_diffs"]) | set(ranks[1][case]["param_diffs"]) == set(source.state_dict())
    # the run's own per-layer checkpoint, converted without a run, is the same model
    layer_checkpoint_to_hf(tmp_path / "pipe" / "ckpt", tmp_path / "source", tmp_path / "converted")
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "pipe" / "hf").state_dict()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").state_dict()
    assert all(torch.equal(saved[k], converted[k]) for k in saved)
