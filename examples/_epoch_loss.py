"""The line the DeepSpeed examples print after each epoch: rank 0's validation loss."""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["EpochLoss"]


class EpochLoss(pl.Callback):
    """Prints ``epoch N: validation loss X`` on rank 0 after each validation (not the sanity check)."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == 0 and not trainer.sanity_checking:
            print(f"epoch {trainer.current_epoch}: validation loss {float(trainer.callback_metrics['val_loss']):.4f}",
                  flush=True)
