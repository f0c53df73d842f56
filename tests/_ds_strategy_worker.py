"""Rank 0 of the Trainer test: ``python _ds_strategy_worker.py OUT_DIR ZERO_STAGE [pipe|asym|dp|badbatch|asym_bf16|
asym_per_device]``.

Lightning's subprocess launcher starts ranks 1..3 by re-running this command
line.  DS_ACCELERATOR=cpu and MASTER_ADDR/MASTER_PORT come from the
environment.  Model, plan and optimizer are ``_ds_engine_worker``'s; the
dataset is ``SAMPLES`` samples, 3 global batches of 8, which Lightning shuffles
(the same order on every rank: the strategy's one-replica DistributedSampler);
``base.batch()`` is the validation set.  Every rank writes
``OUT_DIR/rank{r}.json``.  ``badbatch``: one rank, a one-device plan and a
DataLoader batch_size of 4, not 8; writes the ConfigError's field.  After fit
``pipe``/``asym``/``dp`` (``dp_plan``: four one-stage replicas) saves ``OUT_DIR/last.ckpt`` and loads it back into the runner; then a new
Trainer + model resumes from it (``fit(ckpt_path=...)``, ``max_epochs=2``), and
a third of another plan (the other ZeRO stage; the aligned plan for ``asym``)
resumes from it too, through its per-layer state (refused for ZeRO 2, which has none).  ``asym_bf16``: the asymmetric plan in bf16
under ``Trainer(precision="bf16-mixed")``, fit only; ``asym_per_device``: the same plan with bf16 and fp16 ranks
under ``PerDevicePrecision``.
"""

from __future__ import annotations

import json
import os
import sys

import _ds_engine_worker as base

SAMPLES = base.STEPS * base.BATCH


def dataset():
    """``SAMPLES`` distinct (x, y) pairs."""
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(2)
    x = torch.randn(SAMPLES, base.WIDTH, generator=g, dtype=torch.float32)
    return TensorDataset(x, torch.randn(SAMPLES, base.WIDTH, generator=g, dtype=torch.float32) * 0.5)


def one_device_plan():
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=("cpu0",), model={"name": "mlp6", "num_layers": base.NUM_LAYERS},
                global_batch_size=base.BATCH, dtype="fp32", mode="manual", zero_stage=0,
                pipelines=(Pipeline((Stage(("cpu0",), (0, base.NUM_LAYERS)),), micro_batch_size=3,
                                    samples=base.BATCH),))


def dp_plan():
    """Four one-stage replicas of 2 samples each, as 1 + 1 or one micro-batch of 2 (ZeRO 2 equalises the counts)."""
    from het_strategy.core.plan import Pipeline, Plan, Stage

    return Plan(cluster="local", cluster_devices=tuple(f"cpu{i}" for i in range(4)),
                model={"name": "mlp6", "num_layers": base.NUM_LAYERS}, global_batch_size=base.BATCH, dtype="fp32",
                mode="manual", zero_stage=0,
                pipelines=tuple(Pipeline((Stage((f"cpu{i}",), (0, base.NUM_LAYERS)),), micro_batch_size=1 + i % 2,
                                         samples=2) for i in range(4)))


def pipe_model_class() -> type:
    """The six blocks as a LightningModule for hetero_deepspeed (its ``pipeline_layers``; the strategy makes every
    step, so ``training_step`` and ``validation_step`` are never called)."""
    import lightning.pytorch as pl
    import torch

    class PipeModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(base.build_layers())

        def pipeline_layers(self):
            return list(self.layers)

        def pipeline_loss(self, outputs, labels):
            return torch.nn.functional.mse_loss(outputs, labels)

        def training_step(self, batch, batch_idx):  # required by Lightning; the strategy makes the step
            raise AssertionError("not called under hetero_deepspeed")

        def validation_step(self, batch, batch_idx):  # enables Lightning's validation loop; not called either
            raise AssertionError("not called under hetero_deepspeed")

        def configure_optimizers(self):
            return base.optimizer(self.parameters())

    return PipeModel


def main() -> None:
    out_dir, zero_stage = sys.argv[1], int(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "pipe"
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from het_strategy import HeteroDeepSpeedStrategy

    PipeModel = pipe_model_class()

    class Losses(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.losses.append(trainer.strategy.run.last_loss)

    from het_strategy.core.errors import ConfigError

    one = mode == "badbatch"
    cluster = {"name": "local", "nodes": [{"name": "local", "devices": [{"name": f"cpu{i}", "type": "CPU"}
                                                                        for i in range(1 if one else 4)]}]}
    plan = (one_device_plan() if one else base.asym_plan() if mode.startswith("asym") else dp_plan() if mode == "dp"
            else base.pipe_plan())
    mixed = mode in ("asym_bf16", "asym_per_device")
    per_device = mode == "asym_per_device"
    plugins = []
    if mixed:
        import dataclasses

        if per_device:  # bf16 on cpu0, cpu2; fp16 on cpu1, cpu3 (replica 1 is an fp16 -> bf16 pipeline)
            from het_strategy import PerDevicePrecision

            plugins.append(PerDevicePrecision())
            plan = dataclasses.replace(plan, dtype="per_device",
                                       device_dtypes={d: base.PER_DEVICE_DTYPES[i % 2]
                                                      for i, d in enumerate(plan.cluster_devices)})
        else:
            plan = dataclasses.replace(plan, dtype="bf16")
    strategy = HeteroDeepSpeedStrategy(cluster=cluster, plan=plan, zero_stage=zero_stage)
    data = DataLoader(dataset(), batch_size=4 if one else base.BATCH)
    val = DataLoader(TensorDataset(*base.batch()), batch_size=base.BATCH)
    losses = Losses()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1 if one else 4, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=1, callbacks=[losses], plugins=plugins,
                         precision=None if per_device else "bf16-mixed" if mixed else "32-true")
    if one:
        try:
            trainer.fit(PipeModel(), data, val)
        except ConfigError as exc:
            with open(os.path.join(out_dir, "rank0.json"), "w") as fh:
                json.dump({"field": exc.field, "message": str(exc)}, fh)
        return
    trainer.fit(PipeModel(), data, val)
    runner = strategy.run.runner
    result = {"rank": trainer.global_rank, "global_step": trainer.global_step, "losses": losses.losses,
              "logged": float(trainer.callback_metrics["train_loss"]),
              "val_loss": float(trainer.callback_metrics["val_loss"]),
              "params": {n: p.double().flatten().tolist() for n, p in runner.named_parameters().items()}}
    if mixed:
        result["param_dtype"] = str(next(runner.engine.module.parameters()).dtype)
        result["optimizer"] = type(runner.engine.optimizer).__name__
        if runner.sharding is not None:  # ZeRO 1: the fp32 master chunks survive a checkpoint round trip exactly
            from het_strategy.strategy.deepspeed_checkpoint import CHECKPOINT_TAG

            result["masters"] = [c.tolist() for c in runner.sharding.chunks]
            path = os.path.join(out_dir, "last.ckpt")
            trainer.save_checkpoint(path)
            with torch.no_grad():
                for q in [*runner.engine.module.parameters(), *runner.sharding.chunks]:
                    q.zero_()
            runner.load_checkpoint(path, CHECKPOINT_TAG)
            result["masters_restored"] = [c.tolist() for c in runner.sharding.chunks]
        _write(out_dir, trainer.global_rank, result)
        return
    # a checkpoint round trip: save (every rank), spoil this rank's weights, load them back through DeepSpeed
    from het_strategy.strategy.deepspeed_checkpoint import CHECKPOINT_TAG, PLAN_KEY

    path = os.path.join(out_dir, "last.ckpt")
    trainer.save_checkpoint(path)
    with torch.no_grad():
        for q in runner.engine.module.parameters():
            q.zero_()
    _, client = runner.load_checkpoint(path, CHECKPOINT_TAG)
    result["restored"] = {n: q.flatten().tolist() for n, q in runner.named_parameters().items()}
    result["ckpt"] = {"global_step": client["global_step"], "plan": client[PLAN_KEY] == strategy.plan.to_dict(),
                      "loops": "loops" in client, "is_dir": os.path.isdir(path)}

    # resume at the epoch boundary: a NEW Trainer, strategy and model continue from the checkpoint for epoch 2
    def resume(ckpt_path: str) -> tuple[pl.Trainer, HeteroDeepSpeedStrategy, Losses]:
        """A NEW Trainer, strategy and model continuing from ``ckpt_path`` to the end of epoch 2."""
        losses = Losses()
        strategy_r = HeteroDeepSpeedStrategy(cluster=cluster, plan=plan, zero_stage=zero_stage)
        trainer_r = pl.Trainer(strategy=strategy_r, accelerator="cpu", devices=4, max_epochs=2, logger=False,
                               enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                               callbacks=[losses])
        trainer_r.fit(PipeModel(), data, ckpt_path=ckpt_path)
        return trainer_r, strategy_r, losses

    trainer2, strategy2, resumed_losses = resume(path)
    result["resumed"] = {"global_step": trainer2.global_step, "epoch": trainer2.current_epoch,
                         "losses": resumed_losses.losses,
                         "params": {n: q.flatten().tolist() for n, q in strategy2.run.runner.named_parameters().items()}}
    # resume mid-epoch: a run stopped after 2 of the epoch's 3 steps, resumed by a new Trainer, continues with
    # the epoch's third batch (the training loader's saved position) and then epoch 2
    # (ModelCheckpoint saves during the epoch; a checkpoint saved after fit stopped at max_steps counts as the
    # epoch's end for Lightning's loops)
    from lightning.pytorch.callbacks import ModelCheckpoint

    every = ModelCheckpoint(dirpath=os.path.join(out_dir, "mid"), filename="{step}", every_n_train_steps=2,
                            save_top_k=-1)
    trainer_a = pl.Trainer(strategy=HeteroDeepSpeedStrategy(cluster=cluster, plan=plan, zero_stage=zero_stage),
                           accelerator="cpu", devices=4, max_epochs=1, logger=False, enable_progress_bar=False,
                           enable_model_summary=False, callbacks=[every])
    trainer_a.fit(PipeModel(), data)
    mid_path = os.path.join(out_dir, "mid", "step=2.ckpt")
    trainer_b, strategy_b, mid_losses = resume(mid_path)
    result["mid_resumed"] = {"global_step": trainer_b.global_step, "losses": mid_losses.losses,
                             "params": {n: q.flatten().tolist() for n, q in strategy_b.run.runner.named_parameters().items()}}
    # a checkpoint of another plan (another ZeRO stage; for the asymmetric plan, the aligned one) loads layer by
    # layer and epoch 2 continues; a ZeRO-2 checkpoint has no per-layer state and is refused
    strategy3 = (HeteroDeepSpeedStrategy(cluster=cluster, plan=base.pipe_plan(), zero_stage=0) if mode == "asym" else
                 HeteroDeepSpeedStrategy(cluster=cluster, plan=plan, zero_stage=0 if zero_stage else 1))
    trainer3 = pl.Trainer(strategy=strategy3, accelerator="cpu", devices=4, max_epochs=2, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer3.fit(PipeModel(), data, ckpt_path=path)
        result["refused"] = None
        result["replanned"] = {"global_step": trainer3.global_step, "params": {
            n: q.flatten().tolist() for n, q in strategy3.run.runner.named_parameters().items()}}
    except ConfigError as exc:
        result["refused"] = {"field": exc.field, "message": str(exc)}
    _write(out_dir, trainer.global_rank, result)


def _write(out_dir: str, rank: int, result: dict) -> None:
    final = os.path.join(out_dir, f"rank{rank}.json")
    with open(final + ".tmp", "w") as fh:
        json.dump(result, fh)
    os.replace(final + ".tmp", final)  # the test polls for these files: never show a half-written one


if __name__ == "__main__":
    main()
