"""One rank of the Hugging Face checkpoint round trip: ``python _hf_checkpoint_worker.py SOURCE OUT STEPS [CASES]``.

Started once per rank (``emulation.local_ranks.run_script_ranks``: Lightning sees ``LOCAL_RANK`` and launches
nothing), 2 ranks.  Per case of ``CASES`` (comma-separated, default ``pipe``): a LightningModule holds
``empty_causal_lm(SOURCE)`` (a tiny Llama on the meta device); ``HeteroDeepSpeedStrategy(pretrained=SOURCE)`` runs
the case's fp32 plan (``plan``: ``pipe``, 2 stages; ``tp``, one tp-2 stage), each rank loading only its own units
(at tp 2, only its shards of them), and ``Trainer.fit`` trains ``STEPS`` AdamW steps.  Case ``tp_whole``: the tp-2
plan from the model loaded whole by ``from_pretrained``, without ``pretrained=`` (the runtime splits it).  Then: the run's validation loss on ``val_batch()``
(``PlanRunner.eval_step``); for ``pipe`` ``trainer.save_checkpoint(OUT/pipe/ckpt)`` (with its per-layer files);
``save_hf_checkpoint(trainer, OUT/<case>/hf)`` (gathered per layer to rank 0, tp shards joined); every rank
reloads it with ``from_pretrained``.  Each rank writes ``OUT/rank{r}.json``, per case: the parameters it
materialized after the load (name -> bytes), the bytes it read from SOURCE, the bytes of its tp shards and of
the whole parameters they were cut from, the first batch's ``input_ids``, its losses, the run's and the
reloaded model's validation loss, the largest difference of each trained parameter (shard) from the reloaded one
and how many are tp shards.
"""

from __future__ import annotations

import json
import os
import sys

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
"""The tiny Llama: 4 decoder layers (6 pipeline units), GQA 4:2, untied head."""
BATCH = 4
SEQ = 8
LR = 1e-2


def write_source(path: str) -> None:
    """A seeded tiny Llama saved with ``save_pretrained`` at ``path`` (the run's starting point)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG)).save_pretrained(path)


def plan(case: str = "pipe"):  # tp_whole: as tp
    """``pipe``: stages [0, 3) on cpu0 and [3, 6) on cpu1; ``tp``: one tp-2 stage [0, 6) over both."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    stages = ((Stage(("cpu0",), (0, 3)), Stage(("cpu1",), (3, 6))) if case == "pipe"
              else (Stage(("cpu0", "cpu1"), (0, 6)),))
    return Plan(cluster="local", cluster_devices=("cpu0", "cpu1"), model={"name": "tiny_llama", "num_layers": 6},
                global_batch_size=BATCH, dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline(stages, micro_batch_size=2, samples=BATCH),))


def batches(n: int, seed: int) -> list[dict]:
    """``n`` batches of rows counting up from a random start (mod the vocabulary): a pattern a few steps learn."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, CONFIG["vocab_size"], (BATCH, 1), generator=g)
        ids = (starts + torch.arange(SEQ)) % CONFIG["vocab_size"]
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()})
    return out


def val_batch() -> dict:
    return batches(1, seed=7)[0]


def _diffs(runner, reloaded) -> dict[str, float]:
    """The largest difference of each of this rank's trained parameters (a tp shard: from its slice) from the
    reloaded model's, by Hugging Face name."""
    from het_strategy.tensor_parallel.layers import SOURCE, shard_of

    ref = reloaded.state_dict()
    group = runner.layout.group_of(runner.rank)
    units = {int(n): m for n, m in runner.engine.module.named_children() if n.isdigit()}
    diffs = {}
    for layer, unit in units.items():
        plan = unit.tensor_parallel_plan() if callable(getattr(unit, "tensor_parallel_plan", None)) else None
        specs = plan.shard_specs() if plan is not None else {}
        for local, value in unit.named_parameters():
            hf = unit.hf_names()[local]
            want = ref[hf]
            if hasattr(value, SOURCE):
                want = shard_of(want, specs[local], len(group), group.index(runner.rank))
            diffs[hf] = float((value.detach() - want).abs().max())
    return diffs


def _shards(runner) -> int:
    """How many of this rank's parameters are tensor-parallel shards."""
    from het_strategy.tensor_parallel.layers import SOURCE

    return sum(hasattr(q, SOURCE) for q in runner.engine.module.parameters())


def _shard_bytes(runner) -> dict[str, int]:
    """This rank's parameters (count, bytes), the bytes of its tp shards and of the whole parameters they were cut
    from (still referenced)."""
    from het_strategy.tensor_parallel.layers import SOURCE

    params = list(runner.engine.module.parameters())
    shards = [q for q in params if hasattr(q, SOURCE)]
    return {"tensors": len(params), "module_bytes": sum(q.numel() * q.element_size() for q in params),
            "shard_bytes": sum(q.numel() * q.element_size() for q in shards),
            "source_bytes": sum(getattr(q, SOURCE).numel() * getattr(q, SOURCE).element_size() for q in shards)}


def run_case(case: str, source: str, out: str, steps: int) -> dict:
    """Fit ``case``'s plan from ``source``, save it back under ``out/<case>``, reload and compare."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    import het_strategy  # noqa: F401
    from het_strategy import HeteroDeepSpeedStrategy
    from het_strategy.hf.checkpoint_export import save_hf_checkpoint
    from het_strategy.hf.checkpoints import empty_causal_lm, held_bytes
    from het_strategy.strategy.global_batches import batch_pair

    class Holds(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = (AutoModelForCausalLM.from_pretrained(source) if case == "tp_whole"
                          else empty_causal_lm(source))

        def training_step(self, batch, batch_idx):
            raise AssertionError("not called under hetero_deepspeed")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    class Record(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []
            self.held: dict[str, int] = {}
            self.first: list = []

        def on_train_start(self, trainer, module) -> None:
            self.held = held_bytes(module.model)

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if not self.first:
                self.first = batch["input_ids"].tolist()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            self.losses.append(float(trainer.strategy.run.last_loss))

    cluster = {"name": "local", "nodes": [{"name": "local", "devices": [{"name": "cpu0", "type": "CPU"},
                                                                        {"name": "cpu1", "type": "CPU"}]}]}
    strategy = HeteroDeepSpeedStrategy(cluster=cluster, plan=plan(case),
                                       pretrained=None if case == "tp_whole" else source)
    record = Record()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record])
    rows = [{k: v[i] for k, v in b.items()} for b in batches(steps, seed=1) for i in range(BATCH)]
    trainer.fit(Holds(), DataLoader(rows, batch_size=BATCH))
    runner = strategy.run.runner
    val = val_batch()
    run_val = runner.eval_step(*batch_pair(val, "validation batch"))
    where = os.path.join(out, case)
    if case == "pipe":
        trainer.save_checkpoint(os.path.join(where, "ckpt"))
    save_hf_checkpoint(trainer, os.path.join(where, "hf"))
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(where, "hf")).eval()
    with torch.no_grad():
        reload_val = float(reloaded(**val).loss)
    read = strategy.run.pretrained_load
    return {"held": record.held, "read": None if read is None else read.bytes_read, **_shard_bytes(runner),
            "first_batch": record.first, "losses": record.losses, "run_val": run_val,
            "reload_val": reload_val, "param_diffs": _diffs(runner, reloaded),
            "layers": list(runner.layout.layers_of(runner.rank)), "shards": _shards(runner)}


def main() -> None:
    import torch

    torch.set_num_threads(1)
    source, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cases = sys.argv[4].split(",") if len(sys.argv) > 4 else ["pipe"]
    result = {case: run_case(case, source, out, steps) for case in cases}
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
