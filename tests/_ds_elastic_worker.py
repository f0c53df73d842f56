"""One worker of the hetero_deepspeed elastic test, started by torchrun: ``_ds_elastic_worker.py OUT MAX_STEPS``.

Each agent names its device (``a`` or ``b`` of ``CLUSTER``) in HET_STRATEGY_DEVICE.  The worker fits the six-block
MLP of ``_ds_engine_worker`` (fp32, SGD with momentum) with ``hetero_deepspeed``, planned at setup for the devices
present (``workload``: six equal layers), for 2 epochs of 3 global batches of 8 or ``MAX_STEPS`` steps,
checkpointing every step into OUT/ckpt and resuming from the newest one there (``elastic.latest_checkpoint``).
Each rank appends its world size and the plan's devices to OUT/starts.jsonl; rank 0 writes the parameters it holds
to OUT/final.json at the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _ds_engine_worker as base  # noqa: E402
import _ds_strategy_worker as strategy_worker  # noqa: E402

CLUSTER = {"name": "two", "nodes": [{"name": "local", "devices": [
    {"name": "a", "type": "CPU", "tflops": {"fp32": 5.0}}, {"name": "b", "type": "CPU", "tflops": {"fp32": 2.0}}]}]}


def workload():
    from het_strategy.core.workload import LayerCost, WorkloadSpec

    width = base.WIDTH  # priced as a large layer, so that the planner uses every device present
    layer = LayerCost(name="block", flops_per_sample=1e11, params=width * width + width,
                      activation_bytes_per_sample=8.0 * width, output_bytes_per_sample=4.0 * width)
    return WorkloadSpec(name="mlp6", layers=(layer,) * base.NUM_LAYERS, seq_len=1, dtype="fp32")


def main() -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from het_strategy.strategy.elastic import latest_checkpoint
    from het_strategy import HeteroDeepSpeedStrategy

    out, max_steps = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)

    class PipeModel(strategy_worker.pipe_model_class()):  # type: ignore[misc]
        def on_train_start(self) -> None:
            plan = self.trainer.strategy.plan
            with open(out / "starts.jsonl", "a") as fh:
                fh.write(json.dumps({"rank": self.global_rank, "world": self.trainer.world_size,
                                     "devices": list(plan.used_devices), "step": self.trainer.global_step}) + "\n")

        def on_train_end(self) -> None:
            if self.global_rank == 0:
                params = {n: p.double().flatten().tolist()
                          for n, p in self.trainer.strategy.run.runner.named_parameters().items()}
                (out / "final.json").write_text(json.dumps({"params": params, "step": self.trainer.global_step}))

    strategy = HeteroDeepSpeedStrategy(cluster=CLUSTER, workload=workload(), global_batch_size=base.BATCH,
                                       heartbeat_timeout_s=10)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=int(os.environ["WORLD_SIZE"]),
                         max_epochs=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(out),
                         callbacks=[ModelCheckpoint(dirpath=str(out / "ckpt"), filename="step_{step}",
                                                    auto_insert_metric_name=False, every_n_train_steps=1,
                                                    save_top_k=-1)])
    resume = latest_checkpoint(out / "ckpt")
    trainer.fit(PipeModel(), DataLoader(strategy_worker.dataset(), batch_size=base.BATCH),
                ckpt_path=None if resume is None else str(resume))


if __name__ == "__main__":
    main()
