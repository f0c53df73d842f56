"""Hugging Face causal LMs on the DeepSpeed runtime, cut by their own pp and tp plans (``het_strategy.hf``).

The multiprocess case trains a tiny Llama (GQA 4:2) on 3 gloo ranks through ``PlanRunner`` on padded
variable-length rows, each micro-batch's loss weighted by its counted tokens: an aligned pipeline, an asymmetric
pipeline and a tp-2 stage (of the Llama, and of a Qwen3 with its per-head norms) in float64 (each run per replica),
each equal to the single-process Hugging Face model (losses and parameters to 1e-10, 3 AdamW steps), and three
uneven data-parallel replicas on DeepSpeed's own grid in float32 (which that grid needs), to 1e-4.  The others need no
processes: the units chained give the model's logits and loss, their names are the model's, the refusals are one
line each, and planning takes the model's workload from its config.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_pipeline_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)

from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.hf.causal_lm_loss import CausalLMLoss  # noqa: E402
from het_strategy.hf.lightning_adapter import hf_model_of, pipeline_of  # noqa: E402
from het_strategy.hf.pipeline_units import hf_pipeline_units  # noqa: E402
from het_strategy.strategy.global_batches import batch_pair  # noqa: E402
from het_strategy.tensor_parallel.tp_plan import check_layers  # noqa: E402

WORKER = Path(__file__).with_name("_hf_pipeline_worker.py")
TIMEOUT_S = 300
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"llama": SMALL, "qwen2": SMALL, "qwen3": dict(SMALL, head_dim=8),
            "mistral": dict(SMALL, sliding_window=4),
            "mixtral": dict(SMALL, num_local_experts=4, num_experts_per_tok=2),
            "qwen3_moe": dict(SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8),
            "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)}
"""One tiny config per family with a pp plan, and GPT-2 (the ``transformer.h`` fallback)."""


def _model(kind: str, **overrides):
    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(kind, **{**FAMILIES[kind], **overrides})
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # transformers' grouped-mm experts run in fp32, bf16 or fp16 only
    return m.float() if kind in ("mixtral", "qwen3_moe") else m.double()


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_units_chained_give_the_models_logits_loss_and_names(kind):
    m = _model(kind)
    units = hf_pipeline_units(m)
    assert len(units) == m.config.num_hidden_layers + 2
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 4:] = 0  # padded rows: the padding mask crosses every stage
    labels = ids.masked_fill(mask == 0, -100)
    out = units[0](ids, mask)
    for unit in units[1:]:
        out = unit(out)
    with torch.no_grad():
        ref = m(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(out, ref.logits)
    assert float(CausalLMLoss(m)(out.float(), labels)) == pytest.approx(float(ref.loss), rel=1e-6)
    # every tensor of the model has one unit's name for it, and nothing else
    state = m.state_dict()
    named = [v for u in units for v in u.hf_names().values()]
    assert sorted(named) == sorted(state) and all(torch.equal(u.state_dict()[k], state[v]) for u in units
                                                 for k, v in u.hf_names().items())


def test_the_tp_plan_is_the_models_own_and_a_gqa_tp_not_dividing_the_kv_heads_is_refused():
    units = hf_pipeline_units(_model("llama"))
    plan = units[1].tensor_parallel_plan()
    assert {p: type(s).__name__ for p, s in plan.linears.items()} == {
        "layer.self_attn.q_proj": "Colwise", "layer.self_attn.k_proj": "Colwise", "layer.self_attn.v_proj": "Colwise",
        "layer.self_attn.o_proj": "Rowwise", "layer.mlp.gate_proj": "Colwise", "layer.mlp.up_proj": "Colwise",
        "layer.mlp.down_proj": "Rowwise"}
    assert units[-1].tensor_parallel_plan().linears["lm_head"].gather_output
    check_layers(units[1:3], 1, 2, 2, "plan.pipelines[0].stages[0].tp")  # 2 kv heads over tp 2: fine
    with pytest.raises(ConfigError, match=r"plan.pipelines\[0\].stages\[0\].tp. is 4.*num_key_value_heads \(2\)"):
        check_layers(units[1:3], 1, 4, 4, "plan.pipelines[0].stages[0].tp")
    # Qwen3's per-head q/k norms: replicated, their gradients summed over the group
    assert units[0] is not None and hf_pipeline_units(_model("qwen3"))[1].tensor_parallel_plan().summed == (
        "layer.self_attn.q_norm.weight", "layer.self_attn.k_norm.weight")


def test_a_module_with_two_hf_models_is_refused_and_one_gets_the_models_pipeline():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model, self.teacher = _model("llama"), _model("llama")

    with pytest.raises(ConfigError, match=r"Two. is \['model', 'teacher'\]; it must hold one PreTrainedModel"):
        hf_model_of(Two())
    one = torch.nn.Module()
    one.model = _model("llama")
    layers, loss = pipeline_of(one)
    assert len(layers) == 4 and isinstance(loss, CausalLMLoss)


@pytest.mark.parametrize("kind, note", [("mixtral", "the 4 experts of each MoE layer of MixtralForCausalLM stay "
                                                     "whole in their stage"),
                                         ("qwen3_moe", "the 4 experts"), ("llama", None)])
def test_an_moe_models_experts_are_said_to_stay_whole_in_their_stage(kind, note):
    from het_strategy.hf.lightning_adapter import expert_layout_note

    one = torch.nn.Module()
    one.model = _model(kind)
    got = expert_layout_note(one)
    assert got == note if note is None else got.startswith(note)


def test_gpt2_is_cut_by_the_fallback_and_tp_is_refused_tied_embeddings_split_at_tp_1_only():
    from dataclasses import replace

    from het_strategy.core.plan import Pipeline, Plan, Stage
    from het_strategy.ds_runtime.replicas import replica_layout
    from het_strategy.ds_runtime.tied_weights import check_tied_layout, tied_parameters

    units = hf_pipeline_units(_model("gpt2"))
    assert units[0].hf_names() == {"token.weight": "transformer.wte.weight",
                                   "position.weight": "transformer.wpe.weight"}
    with pytest.raises(ConfigError, match="none of them has a tensor_parallel_plan"):
        check_layers(units, 0, 2, 2, "plan.pipelines[0].stages[0].tp")

    def plan(*cuts, tp=1):
        stages = tuple(Stage(tuple(f"d{i}.{t}" for t in range(tp if i else 1)), (a, b))
                       for i, (a, b) in enumerate(zip((0, *cuts), (*cuts, 4))))
        return Plan(cluster="local", cluster_devices=tuple(d for s in stages for d in s.devices), model={"name": "g",
                    "num_layers": 4}, global_batch_size=2, dtype="fp32", mode="manual", zero_stage=0,
                    pipelines=(Pipeline(stages, micro_batch_size=1, samples=2),))

    def check_tied_stages(p):
        check_tied_layout(replace(replica_layout(p), tied=tied_parameters(units)))

    assert tied_parameters(units) == ((0, "token.weight"), (3, "lm_head.weight"))
    check_tied_stages(plan())
    check_tied_stages(plan(2))  # a copy of the tied matrix on each stage (tests/test_hf_tied.py)
    with pytest.raises(ConfigError, match=r"stages\[1\].tp. is 2; it must be 1 on a stage holding the tied"):
        check_tied_stages(plan(2, tp=2))


def test_a_model_without_pp_plan_or_fallback_and_a_bad_batch_are_refused_in_one_line():
    m = _model("llama")
    m.config.base_model_pp_plan = None
    with pytest.raises(ConfigError, match="LlamaForCausalLM.config.base_model_pp_plan. is null; it must be declared"):
        hf_pipeline_units(m)
    with pytest.raises(ConfigError, match=r"batch\['labels'\]. is null"):
        batch_pair({"input_ids": torch.zeros(2, 3)}, "batch")
    with pytest.raises(ConfigError, match=r"batch\['position_ids'\]. is 'given'; it must be left out"):
        batch_pair({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(2, 3), "position_ids": 0}, "batch")


@pytest.mark.multiprocess
def test_aligned_asymmetric_and_tp_pipelines_on_padded_batches_equal_the_single_process_hf_model(tmp_path):
    from _ds_launch import run_ds_ranks

    pytest.importorskip("deepspeed")
    # padded rows of 8, 5, 8, 3, 6, 7 tokens: each micro-batch's loss weighted by its counted tokens
    ranks = run_ds_ranks(WORKER, 3, ["dp,aligned,asym,tp,qwen3_tp", "padded"], tmp_path, TIMEOUT_S)
    for case in ("aligned", "dp", "asym", "tp", "qwen3_tp"):
        ref = ranks[0][case]["ref_losses"]
        assert ref[-1] < ref[0]
        tol = 1e-4 if case in worker.FLOAT32 else 1e-10  # float32: AdamW divides by small second moments
        covered = set()
        for r in ranks:
            got = r[case]
            assert got["losses"] == pytest.approx(ref, rel=tol, abs=tol), case
            assert max(got["param_diffs"].values()) < tol, (case, got["param_diffs"])
            covered |= set(got["param_diffs"])
        # every parameter checked somewhere
        assert covered == set(worker.reference(True, family=worker._family(case))[1]), case
    assert [r["tp"]["tp"] for r in ranks] == [2, 2, 1]
    # a float64 aligned pipeline runs per replica (DeepSpeed's grid reduces no float64 gradient); float32 on the grid
    assert all(r["aligned"]["per_replica"] and not r["dp"]["per_replica"] for r in ranks)


def test_planning_an_hf_module_takes_its_workload_from_its_config_and_a_tp_its_kv_heads_divide():
    from het_strategy.core.cluster import load_cluster
    from het_strategy.strategy.deepspeed_plan import DeepSpeedPlanHolder

    cluster = load_cluster(str(Path(__file__).parents[1] / "examples" / "clusters" / "hf_mixed.yaml"))
    with pytest.raises(ConfigError, match="seq_len= for a LightningModule holding a Hugging Face model"):
        DeepSpeedPlanHolder(cluster, None, global_batch_size=8)
    holder = DeepSpeedPlanHolder(cluster, None, global_batch_size=8, max_tp=4, seq_len=16)
    module = torch.nn.Module()
    module.model = _model("llama")
    holder.use_module(module)
    assert holder.workload.num_layers == 4  # embedding, 2 decoder layers, head
    why = holder.limit_tp_to(module)
    assert holder.settings.max_tp == 2 and why.startswith("max_tp=4 is lowered to 2")
    assert "num_key_value_heads (2)" in why
