"""How long a checkpoint stops training: synchronous saves against Lightning's ``AsyncCheckpointIO``.

The char GPT (6 blocks, hidden 512: about 19M parameters, a checkpoint of ~230 MB with AdamW's state) trains
under ``hetero`` on 2 CPU ranks for ``--steps`` steps with a ``ModelCheckpoint`` every ``--every`` steps, once
with synchronous saves and once with ``AsyncCheckpointIO`` (what het-train's ``checkpoint.async_save=true``
uses: the tensors are copied on the training thread, a background thread writes them).  The stall per
checkpoint is how long rank 0's ``trainer.save_checkpoint`` blocks the training loop (timed around the call:
gathering the state, the copy or the write, the closing barrier), the mean over the run's saves.  The
background writer also competes with training for this 2-core machine: ``writer_slowdown`` is the median step
between saves of the asynchronous run over the synchronous run's (rank 0 stamps the start of every batch).
It checks the stall the training loop sees on this machine's disk; it cannot say what a network file system
or a GPU's device-to-host copy would add.
Last line: ``RESULT sync_stall_s=... async_stall_s=... async_stall_ratio=... writer_slowdown=... checkpoints=N``.
"""

from __future__ import annotations

import argparse
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
MODEL = dict(num_layers=6, hidden_size=512, num_heads=8, seq_len=64)


def _worker(mode: str, out: str, steps: int, every: int) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from torch.utils.data import DataLoader

    import het_strategy
    from het_strategy.demo.char_gpt import CharGPT
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus

    class Stamps(pl.Callback):
        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.starts.append(time.perf_counter())

        def on_train_end(self, trainer, pl_module):
            self.starts.append(time.perf_counter())

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    corpus = stdlib_corpus(max_bytes=1_000_000)
    loader = DataLoader(CharDataset(corpus.train, MODEL["seq_len"]), batch_size=8, shuffle=True)
    stamps = Stamps()
    ckpt_dir = Path(out).with_suffix("") / "checkpoints"
    saver = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step_{step}", every_n_train_steps=every, save_top_k=-1)
    cluster = {"name": "two", "nodes": [{"name": "local", "devices": [{"name": f"cpu{i}", "type": "CPU"}
                                                                      for i in range(2)]}]}
    trainer = pl.Trainer(strategy=het_strategy.HeteroStrategy(cluster=cluster, verbose=False, telemetry=False),
                         accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[stamps, saver],
                         plugins=[AsyncCheckpointIO()] if mode == "async" else [])
    saves: list[float] = []
    save = trainer.save_checkpoint

    def timed_save(*args: Any, **kwargs: Any) -> None:  # what ModelCheckpoint calls, on every rank
        started = time.perf_counter()
        save(*args, **kwargs)
        saves.append(time.perf_counter() - started)

    trainer.save_checkpoint = timed_save  # type: ignore[method-assign]
    trainer.fit(CharGPT(**MODEL), loader)
    if trainer.global_rank == 0:
        files = sorted(ckpt_dir.glob("*.ckpt"))
        Path(out).write_text(json.dumps({"starts": stamps.starts, "saves": saves, "files": len(files),
                                         "bytes": files[-1].stat().st_size if files else 0}))


def run(mode: str, steps: int, every: int) -> dict:
    """One training run in a subprocess (Lightning re-runs its command line for rank 1)."""
    from het_strategy.emulation.local_ranks import free_port

    with tempfile.TemporaryDirectory(prefix="het_ckpt_") as tmp:
        out = Path(tmp) / "result.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
                   PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, __file__, "--worker", mode, str(out), str(steps), str(every)],
                              env=env, cwd=tmp, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{mode} run exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def stall(result: dict, every: int) -> tuple[float, float, int]:
    """(mean seconds rank 0's ``save_checkpoint`` blocked, median step between saves, number of saves)."""
    starts = result["starts"]
    steps = [b - a for a, b in zip(starts, starts[1:])]
    others = [t for i, t in enumerate(steps) if (i + 1) % every != 0 and i > 0]  # step 0 warms up
    return statistics.fmean(result["saves"]), statistics.median(others), len(result["saves"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    args = ap.parse_args()
    rows = {}
    print(f"char GPT {MODEL}, 2 ranks (hetero), {args.steps} steps, a checkpoint every {args.every} steps")
    print(f"  {'save':<6} {'checkpoint MB':>13} {'step s':>8} {'stall s':>8}")
    for mode in ("sync", "async"):
        result = run(mode, args.steps, args.every)
        rows[mode] = stall(result, args.every)
        print(f"  {mode:<6} {result['bytes'] / 1e6:13.0f} {rows[mode][1]:8.3f} {rows[mode][0]:8.3f}", flush=True)
    (sync, sync_step, _), (asynchronous, async_step, n) = rows["sync"], rows["async"]
    print(f"RESULT sync_stall_s={sync:.3f} async_stall_s={asynchronous:.3f} "
          f"async_stall_ratio={asynchronous / sync:.3f} writer_slowdown={async_step / sync_step:.3f} checkpoints={n}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
