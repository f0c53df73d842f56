"""Token-weighted losses with padded, variable-length batches: every strategy makes the single-process update.

The single-process loss of a padded batch is the mean over its labels ``!= -100``.  Under uneven shares (and
uneven micro-batches) each rank's mean over its own tokens, weighted by samples, is another update; weighted by
counted tokens (``loss_weighting="tokens"``) it is the same one.  Float64, 3 steps, against one process: ``hetero``
with our own CharGPT and a tiny Hugging Face Qwen2 (a run weighted by samples is shown off by more than 1e-6),
``hetero_deepspeed``'s ``PlanRunner`` (a DP-only plan, and a one-stage replica beside a 2-stage pipeline), and one
``hetero_diloco`` round.
"""

from __future__ import annotations

import copy
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")
import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from het_strategy import HeteroDiLoCoStrategy, HeteroStrategy  # noqa: E402
from het_strategy.core.errors import ConfigError  # noqa: E402
from het_strategy.core.outer_sync import OuterSync  # noqa: E402
from het_strategy.core.plan import Pipeline, Plan, Stage  # noqa: E402
from het_strategy.strategy.loss_tokens import LossTokens, LossWeighting, check_weighting  # noqa: E402
from tests._strategy_worker import float64_trainer  # noqa: E402
from tests import _token_weighting_worker as worker  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_master_port")
_FORK = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (Lightning's fork launcher)")

CLUSTER = {"name": "two_speeds", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": "fast", "type": "CPU", "tflops": {"fp32": 3.0}},
    {"name": "slow", "type": "CPU", "tflops": {"fp32": 1.0}}]}]}
"""Two ranks (a power of two: a Qwen2 rounds its RMSNorm and rotary inputs to fp32, and a rank's activation
gradients carry DDP's ``world x`` factor, which for 3 ranks would round differently from one process's)."""
GLOBAL_BATCH, STEPS, LR = 8, 3, 0.5


class PaddedText(Dataset):
    """``GLOBAL_BATCH x STEPS`` right-padded samples of 1 to ``SEQ`` tokens: CharGPT triples ``(x, y, index)``
    (targets -100 where padded) or Hugging Face dicts (``input_ids``, ``attention_mask``, ``labels`` -100 where
    padded, ``index``): the index tells which rank trained which sample."""

    def __init__(self, hf: bool) -> None:
        self.hf = hf
        self.x, self.y = worker.padded_pairs(GLOBAL_BATCH * STEPS, seed=5)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        if not self.hf:
            return self.x[i], self.y[i], i
        mask = (self.y[i] != -100).long()
        return {"input_ids": self.x[i], "attention_mask": mask, "labels": torch.where(mask.bool(), self.x[i], -100),
                "index": i}


def _qwen2() -> torch.nn.Module:
    """A 2-layer Qwen2 (GQA 2:1) from its config, random init (seed 0), whose loss keeps float64 (transformers'
    own rounds the logits to fp32): B's ``CausalLMLoss``, the same shifted mean over the labels ``!= -100``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from het_strategy.hf.causal_lm_loss import CausalLMLoss

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=worker.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    own = CausalLMLoss(model)
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: own(logits, labels)
    return model


class TextModule(pl.LightningModule):
    """A user's module: ``model(**batch).loss`` of a held HF causal LM, or CharGPT's own mean cross-entropy; it
    records each step's synced loss and its counted samples."""

    def __init__(self, hf: bool, out: str) -> None:
        super().__init__()
        self.hf, self.out, self.rows = hf, out, []
        if hf:
            self.model = _qwen2()
        else:
            self.net = worker.char_gpt(torch.float64)

    def loss(self, batch: Any) -> torch.Tensor:
        if self.hf:
            return self.model(**{k: v for k, v in batch.items() if k != "index"}).loss
        x, y, _ = batch
        return self.net.pipeline_loss(self.net(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        synced = self.trainer.strategy.reduce(loss.detach().clone(), reduce_op="mean")
        index = batch["index"] if self.hf else batch[2]
        self.rows.append({"synced": float(synced), "samples": self.trainer.strategy.run.current_local_samples,
                          "indices": index.tolist()})
        return loss

    def on_train_end(self) -> None:
        (Path(self.out) / f"rank{self.global_rank}.json").write_text(json.dumps(self.rows))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _single_process(module: TextModule, data: PaddedText, steps: list[list[int]]) -> list[float]:
    """One process on the same global batches: the mean loss over every counted token of each, SGD."""
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    losses = []
    for indices in steps:
        batch = torch.utils.data.default_collate([data[i] for i in indices])
        opt.zero_grad()
        loss = module.loss(batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.multiprocess
@_FORK
@pytest.mark.parametrize("hf, weighting", [(False, "tokens"), (False, "samples"), (True, "auto"), (True, "samples")])
def test_hetero_padded_batches_equal_one_process_only_when_weighted_by_tokens(tmp_path: Path, hf: bool,
                                                                                weighting: str) -> None:
    """Shares 6 / 2 of 8 padded samples, 3 steps: weighted by tokens (``auto`` for the HF model), the loss and
    parameters equal one process's to 1e-10; weighted by samples, the parameters are off by more than 1e-6."""
    if hf:
        pytest.importorskip("transformers")
    torch.set_num_threads(1)
    data = PaddedText(hf)
    model = TextModule(hf, str(tmp_path))
    reference = copy.deepcopy(model)
    strategy = HeteroStrategy(cluster=CLUSTER, global_batch_size=GLOBAL_BATCH, start_method="fork", verbose=False,
                              timeout=timedelta(seconds=120), loss_weighting=weighting)
    float64_trainer(tmp_path, strategy, devices=2, max_steps=STEPS).fit(model, DataLoader(data, batch_size=3))
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    shares = [rows[r][0]["samples"] for r in range(2)]
    assert sum(shares) == GLOBAL_BATCH and shares[0] > shares[1] > 0, shares  # uneven
    steps = [[i for r in range(2) for i in rows[r][s]["indices"]] for s in range(STEPS)]
    assert sorted(i for step in steps for i in step) == list(range(len(data)))
    ref_losses = _single_process(reference, data, steps)
    diff = _max_diff(model, reference)
    if weighting == "samples":
        assert diff > 1e-6, diff
        return
    assert diff < 1e-10, diff
    assert [r["synced"] for r in rows[0]] == pytest.approx(ref_losses, abs=1e-10, rel=0)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["dp", "asym"])
def test_plan_runner_weights_each_micro_batch_by_its_tokens(tmp_path: Path, mode: str) -> None:
    """``PlanRunner``, micro-batches of uneven tokens: a DP-only plan (DeepSpeed's grid, float32: 1e-6) and a
    one-stage replica beside a 2-stage pipeline (float64: 1e-10) equal one process.  The plan's micro-batches
    weighted by samples (``test_ds_engine.py`` checks the runner makes that update) would be off by more."""
    pytest.importorskip("deepspeed")
    from tests._ds_launch import run_ds_ranks

    world = 2 if mode == "dp" else 3
    dtype, tol = worker.dtype_of(mode), (1e-6 if mode == "dp" else 1e-10)
    (losses, ref), (_, by_samples) = _plan_reference(mode, by_samples=False), _plan_reference(mode, by_samples=True)
    assert max(float((ref[n] - by_samples[n]).abs().max()) for n in ref) > 100 * tol
    ranks = run_ds_ranks(Path(worker.__file__), world, [mode, "tokens"], tmp_path, 300)
    assert {n for r in ranks for n in r["params"]} == set(ref)
    for r in ranks:
        assert r["losses"] == pytest.approx(losses, abs=tol, rel=0)
        for n, values in r["params"].items():
            assert float((torch.tensor(values, dtype=torch.float64) - ref[n]).abs().max()) < tol, n


def _plan_reference(mode: str, by_samples: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the whole padded batch: the mean over its counted tokens; ``by_samples``: the plan's
    micro-batches' means weighted by their samples instead (what weighting by samples makes of the batch)."""
    dtype = worker.dtype_of(mode)
    net = worker.char_gpt(dtype)
    model, loss_fn = torch.nn.Sequential(*net.pipeline_layers()), net.pipeline_loss
    opt = worker.optimizer(model.parameters())
    x, y = worker.padded_pairs()
    cuts = [(0, 2), (2, 4), (4, 5)] + ([(5, 8)] if mode == "dp" else [(5, 6), (6, 7), (7, 8)])
    losses = []
    for _ in range(worker.STEPS):
        opt.zero_grad()
        loss = (sum((b - a) / worker.BATCH * loss_fn(model(x[a:b]), y[a:b]) for a, b in cuts) if by_samples
                else loss_fn(model(x), y))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().double().flatten() for n, p in model.named_parameters()}


TWO_SITES = {"name": "two_sites", "inter_node_bandwidth_gbs": 0.00125, "nodes": [
    {"name": "a", "devices": [{"name": "fast", "type": "CPU", "tflops": {"fp32": 2.0}}]},
    {"name": "b", "devices": [{"name": "b0", "type": "CPU", "tflops": {"fp32": 1.0}},
                              {"name": "b1", "type": "CPU", "tflops": {"fp32": 1.0}}]}]}
DILOCO_SHARES = {"fast": 4, "b0": 3, "b1": 1}  # groups of 4 and 3 + 1 samples per inner step


@pytest.mark.multiprocess
@_FORK
@pytest.mark.parametrize("hf", [False, True], ids=["char_gpt", "qwen2"])
def test_diloco_round_with_padded_batches_equals_its_reference(tmp_path: Path, hf: bool) -> None:
    """One round (H = 3) of two groups, the second split 3 / 1, for CharGPT and a Hugging Face Qwen2 (``auto``:
    its shifted labels counted): each group's inner steps are the mean over its counted tokens, and the outer step
    averages the pseudo-gradients weighted by the groups' tokens (plain averaging: outer lr 1, no momentum); the
    parameters equal that reference to 1e-10."""
    torch.set_num_threads(1)
    plan = Plan(cluster="two_sites", cluster_devices=("fast", "b0", "b1"), model={"num_layers": 1},
                global_batch_size=GLOBAL_BATCH, dtype="fp32", mode="manual",
                pipelines=tuple(Pipeline((Stage((d,), (0, 1)),), n, n) for d, n in DILOCO_SHARES.items()),
                outer_sync=OuterSync(STEPS, "none", (("fast",), ("b0", "b1"))))
    if hf:
        pytest.importorskip("transformers")
    data = PaddedText(hf=hf)
    model = TextModule(hf, str(tmp_path))
    groups = [copy.deepcopy(model), copy.deepcopy(model)]
    strategy = HeteroDiLoCoStrategy(cluster=TWO_SITES, plan=plan.save(tmp_path / "plan.json"), start_method="fork",
                                    verbose=False, timeout=timedelta(seconds=120), outer_lr=1.0, outer_momentum=0.0,
                                    loss_weighting="auto" if hf else "tokens", global_batch_size=GLOBAL_BATCH)
    float64_trainer(tmp_path, strategy, max_steps=STEPS).fit(model, DataLoader(data, batch_size=3))
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    counted = LossTokens(shifted=hf)  # a causal LM's own loss shifts its labels
    weights = []
    for g, ranks in enumerate([(0,), (1, 2)]):
        steps = [[i for r in ranks for i in rows[r][s]["indices"]] for s in range(STEPS)]
        assert [len(step) for step in steps] == [4] * STEPS
        _single_process(groups[g], data, steps)
        labels = torch.stack([data[i]["labels"] if hf else data.y[i] for step in steps for i in step])
        weights.append(counted.count(labels))
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for e, a, b in zip(expected.parameters(), *(m.parameters() for m in groups)):
            e.copy_((weights[0] * a + weights[1] * b) / sum(weights))
    assert weights[0] != weights[1]
    assert _max_diff(model, expected) < 1e-10


def test_the_option_is_checked_and_the_count_shifts_only_for_a_causal_lm() -> None:
    labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
    assert LossTokens(shifted=False).count(labels) == 3 and LossTokens(shifted=True).count(labels) == 1
    assert LossTokens(shifted=False).of_batch({"labels": labels}, "batch") == 3
    assert check_weighting("tokens") is LossWeighting.tokens
    with pytest.raises(ConfigError, match="`loss_weighting` is 'token'; it must be one of auto, samples, tokens"):
        HeteroStrategy(cluster=CLUSTER, loss_weighting="token")
    with pytest.raises(ConfigError, match="`training batch` is 'Tensor'"):
        LossTokens(shifted=False).of_batch(labels, "training batch")
