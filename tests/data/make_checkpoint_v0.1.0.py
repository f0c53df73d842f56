"""How tests/data/checkpoint_v0.1.0.ckpt was written: het_strategy 0.1.0 (commit 71f60ba, before the reorganisation).

Run from a checkout of that commit (with ``het_strategy/callbacks`` and ``het_strategy/configs`` linked to its
top-level ``callbacks/`` and ``configs/``), with this repository's venv::

    OLD=/path/to/checkout PYTHONPATH=$OLD python tests/data/make_checkpoint_v0.1.0.py OUT_DIR

and copy ``OUT_DIR/epoch=0-step=3.ckpt``: 2 emulated ranks, q8 compression (state included), the straggler
callback, 3 steps of global batch 12.  Kept for the record; the tests only load its output.
"""
import datetime
import os
import sys
import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader
sys.path.insert(0, os.environ["OLD"])  # the 0.1.0 checkout (its tests/_strategy_worker.py)
from tests._strategy_worker import IndexedData, Recorder
import het_strategy
from het_strategy.callbacks.straggler import StragglerMitigation
print(het_strategy.__file__)
cluster = {"name": "two_emulated", "inter_node_bandwidth_gbs": 10, "nodes": [{"name": "local", "devices": [
    {"name": "fast", "type": "CPU", "tflops": {"fp32": 2.0}, "emulated_speed": 1.0},
    {"name": "slow", "type": "CPU", "tflops": {"fp32": 2.0}, "emulated_speed": 0.5}]}]}
if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    strategy = het_strategy.HeteroStrategy(cluster=cluster, global_batch_size=12, start_method="fork", verbose=False,
                                           compression={"method": "quantize", "bits": 8, "min_numel": 8, "warmup_steps": 1}, timeout=datetime.timedelta(seconds=120))
    ckpt = ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, max_steps=3,
                         callbacks=[ckpt, StragglerMitigation(verbose=False, log=False)], default_root_dir=out)
    import tempfile
    trainer.fit(Recorder(tempfile.mkdtemp()), DataLoader(IndexedData(30), batch_size=6, shuffle=True))
