"""A Hugging Face causal LM on ``strategy="hetero"``: uneven data parallelism with padded batches, exact.

The model is ``Qwen2ForCausalLM`` from a small config shipped beside this script
(``examples/configs/tiny_qwen2/config.json``: 2 layers, hidden 64, GQA 4:2, a byte vocabulary), randomly
initialised; the LightningModule holds it (``self.model``) and its ``training_step`` is ``self.model(**batch).loss``.
The samples are lines of the main job's text (the standard library's source, as bytes) of every length up to 64
bytes, padded to the longest of each rank's batch (``attention_mask`` 0 and ``labels`` -100 where padded).  Two
CPU processes play the shipped ``local_cpu2`` cluster (speeds 1 and 0.5): the fast rank takes more samples of
every global batch of 16, so the two ranks hold different numbers of real tokens.  The model's loss is a mean over
its rank's counted tokens (``labels[..., 1:] != -100``), so the strategy weights each rank's loss by its tokens
(``loss_weighting="auto"`` is ``"tokens"`` for a module that holds a Hugging Face causal LM, said in one line):
every step is the one a single process makes on the whole global batch.

Run (from the repository root, after ``bash scripts/setup.sh``)::

    .venv/bin/python examples/hf_finetune_hetero.py              # 40 steps
    .venv/bin/python examples/hf_finetune_hetero.py --steps 3    # quicker

It prints the shares, the counted tokens each rank held in the first step and the training loss, first and last
(bytes at chance: ln 256 = 5.5).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import AutoConfig, AutoModelForCausalLM

from _run import QUIET_RUN, epochs_parser  # examples/_run.py
import het_strategy  # noqa: F401  (registers strategy="hetero")
from het_strategy import HeteroStrategy
from het_strategy.demo.stdlib_text import stdlib_corpus

CONFIG_DIR = Path(__file__).parent / "configs" / "tiny_qwen2"
MAX_LEN = 64
PAD = 0


class SourceLines(Dataset):
    """The text's lines (2 to ``MAX_LEN`` bytes, longer ones cut) as token tensors of their own lengths."""

    def __init__(self, data: torch.Tensor) -> None:
        ends = (data == ord("\n")).nonzero().flatten().tolist()
        starts = [0, *(e + 1 for e in ends[:-1])]
        self.lines = [data[s:min(e + 1, s + MAX_LEN)].long() for s, e in zip(starts, ends) if e + 1 - s >= 2]

    def __len__(self) -> int:
        return len(self.lines)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.lines[i]


def pad_batch(lines: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face batch, right-padded to its longest line: the model shifts ``labels`` itself."""
    width = max(len(t) for t in lines)
    ids = torch.full((len(lines), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, t in enumerate(lines):
        ids[row, :len(t)], mask[row, :len(t)] = t, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class HoldsQwen2(pl.LightningModule):
    """Holds the Hugging Face model; its loss is the model's own."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(CONFIG_DIR))
        self.first_step: list[int] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = self.model(**batch).loss  # a mean over this rank's counted tokens
        if not self.first_step:
            self.first_step = [len(batch["labels"]), int((batch["labels"][:, 1:] != -100).sum())]
        synced = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")  # weighted by tokens: the global mean
        self.losses.append(float(synced))
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = epochs_parser(__doc__, epochs=1)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)  # the same random init on every rank
    lines = SourceLines(stdlib_corpus(max_bytes=200_000).train)
    module = HoldsQwen2()
    # batch_size is per rank, as in plain DDP: the global batch is 8 x 2 = 16, which the strategy splits by speed
    strategy = HeteroStrategy(cluster="local_cpu2", verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.epochs,
                         max_steps=args.steps, **QUIET_RUN)
    trainer.fit(module, DataLoader(lines, batch_size=8, shuffle=True, collate_fn=pad_batch, drop_last=True))
    held = module.all_gather(torch.tensor(module.first_step)).tolist()
    if trainer.global_rank == 0:
        print(f"shares per rank {strategy.run.current_shares()}; first step: samples {[h[0] for h in held]}, "
              f"counted tokens {[h[1] for h in held]}; train loss {module.losses[0]:.3f} -> "
              f"{module.losses[-1]:.3f} in {len(module.losses)} steps", flush=True)


if __name__ == "__main__":
    main()
