"""One worker of the elastic test, started by torchrun's agent: ``_elastic_worker.py OUT_DIR KILL_STEP``.

Every agent runs one worker and names its device in HET_STRATEGY_DEVICE (``fast``, ``mid`` or ``slow`` of
``CLUSTER``).  The worker trains ``Recorder`` (float64) with the ``hetero`` strategy for 2 epochs of 48 samples
(global batch 16), checkpointing every step into OUT_DIR/ckpt, and resumes from the newest checkpoint there
(``elastic.latest_checkpoint``).  Each training step appends one line to OUT_DIR/steps.jsonl: the worker
group, the global step, the epoch, the device, the world size and the samples it trained.

Each worker group (one rendezvous round) is named by a token its rank 0 broadcasts at the start of training: the
agents' restart counts differ after a membership change, the token does not.  A world that ``slow`` has not yet
joined (it starts last) trains step 0 and then waits at step 1 until torchrun's agents restart it with ``slow``;
in the world of three, ``slow`` kills its agent and itself as step KILL_STEP begins.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
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
        self.group = ""

    def on_train_start(self) -> None:
        self.group = self.trainer.strategy.broadcast(f"{os.getpid()}-{time.time()}")
        if os.environ["HET_STRATEGY_DEVICE"] == "slow":
            (Path(self.out_dir) / "slow_joined").touch()

    def _wait_for_slow(self) -> None:
        """Until the agents restart this world of two with ``slow`` (SIGTERM, which Lightning notes and we obey)."""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.trainer.received_sigterm:
                os._exit(0)
            time.sleep(0.1)
        raise RuntimeError("the slow device never joined")

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        device, world = os.environ["HET_STRATEGY_DEVICE"], self.trainer.world_size
        if world < 3 and not (Path(self.out_dir) / "slow_joined").exists() and self.trainer.global_step == 1:
            self._wait_for_slow()
        if device == "slow" and self.trainer.global_step == self.kill_step:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: nothing restarts this device
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        row = self.rows[-1]
        line = {"group": self.group, "step": self.trainer.global_step, "epoch": row["epoch"], "device": device,
                "world": world, "ids": row["indices"][: row["counted"]]}
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
