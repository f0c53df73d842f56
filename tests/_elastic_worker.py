"""One worker of the elastic test, started by torchrun's agent: ``_elastic_worker.py OUT_DIR KILL_STEP``.

Every agent runs one worker and names its device in HET_STRATEGY_DEVICE (``fast``, ``mid`` or ``slow`` of
``CLUSTER``).  The worker trains ``Recorder`` (float64) with the ``hetero`` strategy for 2 epochs of 48 samples
(global batch 16), checkpointing every step into OUT_DIR/ckpt, and resumes from the newest checkpoint there
(``elastic.latest_checkpoint``).  Each training step appends one line to OUT_DIR/steps.jsonl: the restart
count, the global step, the epoch, the device and the samples it trained.  On the first attempt the ``slow``
device's worker kills its own agent and itself (SIGKILL) as step KILL_STEP begins: the device is gone.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _strategy_worker import IndexedData, Recorder  # noqa: E402

CLUSTER = {"name": "three_speeds", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": "fast", "type": "CPU", "tflops": {"fp32": 5.0}}, {"name": "mid", "type": "CPU", "tflops": {"fp32": 2.0}},
    {"name": "slow", "type": "CPU", "tflops": {"fp32": 1.0}}]}]}


class Logged(Recorder):
    def __init__(self, out_dir: str, kill_step: int) -> None:
        super().__init__(out_dir)
        self.kill_step = kill_step

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        device = os.environ["HET_STRATEGY_DEVICE"]
        if attempt == 0 and device == "slow" and self.trainer.global_step == self.kill_step:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: nothing restarts this device
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        row = self.rows[-1]
        line = {"attempt": attempt, "step": self.trainer.global_step, "epoch": row["epoch"], "device": device,
                "world": self.trainer.world_size, "ids": row["indices"][: row["counted"]]}
        with open(Path(self.out_dir) / "steps.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
        return loss

    def on_train_end(self) -> None:
        super().on_train_end()
        if self.global_rank == 0:
            params = {n: p.detach().flatten().tolist() for n, p in self.net.named_parameters()}
            (Path(self.out_dir) / "final.json").write_text(json.dumps({"params": params,
                                                                       "world": self.trainer.world_size}))


def main() -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from het_strategy import HeteroStrategy
    from het_strategy.strategy.elastic import latest_checkpoint

    out, kill_step = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    ckpt_dir = out / "ckpt"
    strategy = HeteroStrategy(cluster=CLUSTER, global_batch_size=16, verbose=False, heartbeat_timeout_s=5,
                              timeout=datetime.timedelta(seconds=60))
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=world, strategy=strategy, precision="64-true",
                         max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=str(ckpt_dir), filename="step_{step}",
                                                    auto_insert_metric_name=False, every_n_train_steps=1,
                                                    save_top_k=-1)],
                         default_root_dir=str(out))
    resume = latest_checkpoint(ckpt_dir)
    trainer.fit(Logged(str(out), kill_step), DataLoader(IndexedData(48), batch_size=8, shuffle=True),
                ckpt_path=None if resume is None else str(resume))


if __name__ == "__main__":
    main()
