"""Tied embeddings (``tie_word_embeddings``) split over pipeline stages: a copy of the matrix per stage.

The multiprocess case trains a tiny tied Llama on 3 gloo ranks (``_hf_tied_worker.py``): on DeepSpeed's own grid
(float32, the copies on the first and last stage) and as an asymmetric pair of replicas (float64, one replica
holding the matrix once); each equals the single-process Hugging Face model, and every copy equals the single
process's matrix after each step.  The planner prices the split: the copy's all-reduce and memory on the head stage.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_tied_worker as worker  # noqa: E402  (tests/ is on sys.path under pytest)

from het_strategy.core.errors import ConfigError  # noqa: E402

WORKER = Path(__file__).with_name("_hf_tied_worker.py")
TIMEOUT_S = 300


@pytest.mark.multiprocess
def test_a_tied_embedding_and_head_on_different_stages_equal_the_single_process_model(tmp_path):
    from _ds_launch import run_ds_ranks

    pytest.importorskip("deepspeed")
    ranks = run_ds_ranks(WORKER, 3, ["aligned,asym"], tmp_path, TIMEOUT_S)
    for case in ("aligned", "asym"):
        ref = ranks[0][case]["ref_losses"]
        assert ref[-1] < ref[0]
        tol = 1e-4 if case in worker.FLOAT32 else 1e-10
        covered = set()
        for r in ranks:
            got = r[case]
            assert got["losses"] == pytest.approx(ref, rel=tol, abs=tol), case
            assert max(got["param_diffs"].values()) < tol, (case, got["param_diffs"])
            assert all(d < tol for step in got["tied_diffs"] for d in step), (case, got["tied_diffs"])
            covered |= set(got["param_diffs"])
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= covered, case
    copies = [len(r["asym"]["tied_diffs"][0]) for r in ranks]
    assert copies == [1, 1, 1]  # the one-device replica holds the matrix once


def test_a_split_tied_plan_is_priced_with_the_copys_allreduce_and_memory_on_the_head_stage():
    import json

    from het_strategy.core.cluster import load_cluster
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.hf_config import hf_workload
    from het_strategy.core.network import SyncRoute
    from het_strategy.core.plan import Pipeline, Plan, Stage
    from het_strategy.core.train_settings import TrainSettings

    raw = json.loads((Path(__file__).parents[1] / "het_strategy" / "reference" / "data" / "hf_configs"
                      / "llama3_2_1b.json").read_text())
    cluster = load_cluster("mixed_a100_v100_t4")
    settings = TrainSettings(global_batch_size=8)

    def score(tied: bool, cut: int | None):
        wl = hf_workload(raw | {"tie_word_embeddings": tied}, 512)
        L = wl.num_layers
        stages = (Stage(("mixed/0",), (0, cut)), Stage(("mixed/2",), (cut, L))) if cut else (Stage(("mixed/0",),
                                                                                                   (0, L)),)
        plan = Plan(cluster=cluster.name, cluster_devices=tuple(d.name for d in cluster.devices),
                    model={"name": "llama3_2_1b", "num_layers": L}, global_batch_size=8, dtype="fp32",
                    mode="manual", zero_stage=0, pipelines=(Pipeline(stages, micro_batch_size=1, samples=8),))
        cm = CostModel(cluster, wl, settings)
        return cm, plan, cm.score(plan)

    cm, plan, got = score(True, 16)
    matrix = 128256 * 2048
    ring = cm.network.ring_allreduce_s(matrix * settings.grad_bytes, SyncRoute(members=2, nodes=("mixed",),
                                                                                 flows=(1,)))
    assert ring > 0 and cm.tied_sync_s(plan.pipelines[0]) == pytest.approx(ring)
    assert got.device_sync_s == {"mixed/0": pytest.approx(ring), "mixed/2": pytest.approx(ring)}  # one replica
    assert cm.stage_param_count(16, 18) == cm.workload.layers[16].params + cm.workload.layers[17].params
    untied = score(False, 16)
    assert got.memory_bytes == pytest.approx(untied[2].memory_bytes)  # the head stage holds its copy, as untied
    assert untied[0].tied_sync_s(untied[1].pipelines[0]) == 0 and untied[2].device_sync_s["mixed/0"] == 0
    one = score(True, None)
    assert one[0].tied_sync_s(one[1].pipelines[0]) == 0  # one stage: the matrix held once, nothing to sum
