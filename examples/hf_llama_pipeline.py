"""A Hugging Face Llama, as transformers builds it, trained as a pipeline with one tensor-parallel stage.

The model is ``LlamaForCausalLM`` from a small Llama-shaped config shipped beside this script
(``examples/configs/tiny_llama/config.json``: 4 layers, hidden 64, GQA 4:2, SwiGLU, a byte vocabulary), randomly
initialised; the LightningModule only holds it (``self.model``): no ``pipeline_layers``, no ``pipeline_loss``.
``HeteroDeepSpeedStrategy`` cuts it along the model's own ``base_model_pp_plan`` (embedding, each decoder layer,
final norm + ``lm_head``), splits the first stage by the model's own ``base_model_tp_plan`` (q/k/v, gate/up by
columns, o/down by rows, 2 kv heads per rank pair) and trains it with the model's own causal-LM loss.  The text is
the main job's: the standard library's source, byte-level, in Hugging Face batches (``input_ids``,
``attention_mask``, ``labels``).  The cluster is emulated (``examples/clusters/hf_mixed.yaml``): one fast CPU
process and two at half its speed; the plan puts the two slow ones as one tp-2 stage on layers [0, 3) (embedding,
decoder layers 0-1) feeding the fast one on [3, 6) (decoder layers 2-3, head).  ``seq_len=`` prices each stage
from the model's config (``core.hf_config.hf_workload``).  After training, the model is saved back as a
``save_pretrained`` directory (``--save DIR``; the tp shards joined) that ``AutoModelForCausalLM.from_pretrained``
loads.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/hf_llama_pipeline.py              # 30 steps
    .venv/bin/python examples/hf_llama_pipeline.py --steps 4    # quicker

It prints each rank's share of layer 0's ``q_proj`` (half the heads on the tp-2 stage), the training loss, first
and last, which falls from ln 256 = 5.5 (bytes at chance), and the parameters the saved directory reloads with.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed picks its accelerator on import

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from _run import QUIET_RUN  # examples/_run.py
import het_strategy  # noqa: F401  (registers strategy="hetero_deepspeed")
from het_strategy import HeteroDeepSpeedStrategy
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
from het_strategy.hf.checkpoint_export import save_hf_checkpoint

HERE = Path(__file__).parent
CONFIG_DIR = HERE / "configs" / "tiny_llama"
CLUSTER = HERE / "clusters" / "hf_mixed.yaml"
SEQ_LEN = 64
GLOBAL_BATCH = 16


class HFBatches(Dataset):
    """Byte windows of the text as Hugging Face batches: the model shifts ``labels`` itself."""

    def __init__(self, data: torch.Tensor) -> None:
        self.windows = CharDataset(data, SEQ_LEN)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = self.windows[i]
        return {"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x}


class HoldsLlama(pl.LightningModule):
    """Holds the Hugging Face model; the strategy finds it and cuts it."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)  # the same random init on every rank
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG_DIR))

    def training_step(self, batch, batch_idx):  # Lightning requires it; the strategy runs the step itself
        raise AssertionError("not called under hetero_deepspeed")

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def tp_plan(num_layers: int) -> Plan:
    """slow_a + slow_b at tp 2 on [0, 3), then fast on [3, num_layers); micro-batches of 4."""
    stages = (Stage(("slow_a", "slow_b"), (0, 3)), Stage(("fast",), (3, num_layers)))
    return Plan(cluster="hf_mixed", cluster_devices=("fast", "slow_a", "slow_b"),
                model={"name": "tiny_llama", "num_layers": num_layers}, global_batch_size=GLOBAL_BATCH,
                dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline(stages, micro_batch_size=4, samples=GLOBAL_BATCH),))


class _Losses(pl.Callback):
    """Keeps each step's training loss (the strategy's, the same on every rank)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.run.last_loss))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--save", default=None, help="the save_pretrained directory written (default: a new temporary "
                    "directory)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    corpus = stdlib_corpus(max_bytes=400_000)
    module = HoldsLlama()
    num_layers = module.model.config.num_hidden_layers + 2
    strategy = HeteroDeepSpeedStrategy(cluster=str(CLUSTER), plan=tp_plan(num_layers), seq_len=SEQ_LEN)
    losses = _Losses()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=3, max_steps=args.steps,
                         limit_val_batches=0, num_sanity_val_steps=0, callbacks=[losses], **QUIET_RUN)
    trainer.fit(module, DataLoader(HFBatches(corpus.train), batch_size=GLOBAL_BATCH, shuffle=True, drop_last=True))
    mine = strategy.run.runner.named_parameters()
    q = mine.get("1.layer.self_attn.q_proj.weight")  # unit 1: decoder layer 0
    share = f"layer 0 q_proj {tuple(q.shape)} of (64, 64)" if q is not None else "no decoder layer 0"
    print(f"rank {trainer.global_rank}: {share}; train loss {losses.losses[0]:.3f} -> {losses.losses[-1]:.3f} "
          f"in {len(losses.losses)} steps", flush=True)
    # saved back as a Hugging Face directory: every rank sends its units (tp shards joined), rank 0 writes
    out = Path(args.save) if args.save else Path(tempfile.mkdtemp(prefix="hf_llama_"))
    save_hf_checkpoint(trainer, out)
    if trainer.global_rank == 0:  # rank 0 holds the embedding (unit 0) of the tp-2 stage whole
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(module.model.config)
        same = torch.equal(reloaded.model.embed_tokens.weight, mine["0.token.weight"])
        print(f"saved to {out}: from_pretrained reloads {sum(q.numel() for q in reloaded.parameters())} "
              f"parameters of {sum(q.numel() for q in whole.parameters())}, the trained embedding "
              f"{'exactly' if same else 'NOT'}", flush=True)


if __name__ == "__main__":
    main()
