"""One ``HeteroFSDPStrategy`` fit of the char GPT, timed (``fsdp_unequal_memory.py``'s fast section).

``lightning_fit(spec)`` runs this file as a script (``python _fsdp_lightning.py SPEC.json``): a Lightning
``Trainer(strategy=HeteroFSDPStrategy(...))`` on CPU ranks forked by the strategy's launcher, the cluster's
emulated speeds padding each rank's batch (the ``hetero`` run's padding), the plan given (``spec["plan"]``) or
planned.  Each rank records the wall time between the ends of consecutive training batches and, after
``warmup`` batches, the seconds its ``ShardedModel`` was blocked on communication; rank 0 writes every rank's
means to ``spec["out"]``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def lightning_fit(spec: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
    """Run one fit in a fresh interpreter; rank 0's record of every rank."""
    with tempfile.TemporaryDirectory(prefix="het_fsdp_pl_") as tmp:
        spec = dict(spec, out=str(Path(tmp) / "result.json"), root=tmp)
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, __file__, str(Path(tmp) / "spec.json")], capture_output=True,
                              text=True, timeout=timeout_s, env=env, cwd=REPO)
        if proc.returncode != 0 or not Path(spec["out"]).exists():
            raise RuntimeError(f"the fit exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        return json.loads(Path(spec["out"]).read_text())


def _fit(spec_path: str) -> None:
    import datetime

    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    import het_strategy
    from het_strategy.core.plan import Plan
    from het_strategy.core.workload import TransformerConfig, transformer_workload
    from het_strategy.demo.char_gpt import CharGPT

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    cfg = TransformerConfig(**spec["model"])
    world = sum(len(node["devices"]) for node in spec["cluster"]["nodes"])
    steps, warmup, batch = spec["steps"], spec["warmup"], spec["global_batch"]

    class Timing(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.wait_s = 0.0

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, b: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            sharded = trainer.strategy.run.extension.sharded
            if len(self.ends) == warmup + 1:  # the timed batches start here
                sharded.reset_timing()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            sharded = trainer.strategy.run.extension.sharded
            gaps = [b - a for a, b in zip(self.ends[warmup:], self.ends[warmup + 1:])]
            mine = {"step_s": statistics.fmean(gaps), "wait_s": sharded.comm_wait_s / len(gaps),
                    "shares": [p.samples for p in trainer.strategy.plan.pipelines],
                    "shards": dict(trainer.strategy.plan.shards)}
            every: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(every, mine)
            if trainer.global_rank == 0:
                Path(spec["out"]).write_text(json.dumps(every))

    torch.manual_seed(0)
    model = CharGPT.from_workload_config(cfg, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    n = batch * (steps + warmup + 2)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len), generator=g)
    loader = DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=batch // world)
    plan = Plan.from_dict(spec["plan"]) if spec.get("plan") else None
    strategy = het_strategy.HeteroFSDPStrategy(
        cluster=spec["cluster"], plan=plan, global_batch_size=batch, start_method="fork", verbose=False,
        telemetry=False, workload=transformer_workload(cfg, dtype="fp32"), prefetch=spec["prefetch"],
        timeout=datetime.timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps + warmup + 1,
                         callbacks=[Timing()], logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
                         default_root_dir=spec["root"])
    trainer.fit(model, loader)


if __name__ == "__main__":
    _fit(sys.argv[1])
