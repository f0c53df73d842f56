"""The loaders of a ``hetero_deepspeed`` run: every rank loads the whole global batch (``GlobalBatches``).

``PlanRunner`` cuts each rank's micro-batches out of the global batch, so every
rank must see the same batches in the same order:

1. Lightning's injected ``DistributedSampler`` is made a one-replica sampler
   (``SAMPLER_KWARGS``): the whole dataset on every rank, in one (seeded) order.
2. Every loader's ``batch_size`` must be the plan's global batch.
3. The training loader is rebuilt, in its own class, with one share (the whole
   global batch), and its position a checkpoint saves, so a resumed fit
   continues mid-epoch with the next batch; a short last batch cannot be cut
   into the plan's micro-batches, so ``drop_last=True`` is required when the
   dataset is not a multiple of the global batch.

``batch_pair`` splits a batch into ``(inputs, labels)`` (a Hugging Face dict batch too).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch.utils.data import DataLoader

from het_strategy.core.errors import field_error
from het_strategy.strategy.loaders import batch_index, check_splittable, is_split, split_loader

__all__ = ["SAMPLER_KWARGS", "GlobalBatches", "batch_pair"]

SAMPLER_KWARGS = {"num_replicas": 1, "rank": 0}
"""Lightning's ``DistributedSampler`` arguments: one replica, so every rank iterates the whole dataset in one order."""


def batch_pair(batch: Any, where: str) -> tuple[Any, Any]:
    """``(inputs, labels)`` of a batch; a ``ConfigError`` naming ``where`` for anything else.

    A Hugging Face batch (a mapping with ``input_ids``, ``labels`` and optionally ``attention_mask``) gives
    ``((input_ids, attention_mask), labels)``, or ``(input_ids, labels)`` without a mask: the runner cuts each
    tensor of the inputs' tuple into the same micro-batches."""
    if isinstance(batch, Mapping) and "input_ids" in batch:
        if "labels" not in batch:
            raise field_error(f"{where}['labels']", None, "be given in a Hugging Face batch (a mapping of input_ids, "
                              "attention_mask, labels; labels -100 where not counted)")
        if "position_ids" in batch:
            raise field_error(f"{where}['position_ids']", "given", "be left out: the pipeline's units number each row "
                              "0 .. T-1, as the model does without them (packed sequences are not supported)")
        mask = batch.get("attention_mask")
        return (batch["input_ids"] if mask is None else (batch["input_ids"], mask)), batch["labels"]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise field_error(where, type(batch).__name__, "be (inputs, labels) or a mapping of input_ids, "
                          "attention_mask and labels")
    return batch[0], batch[1]


class GlobalBatches:
    """The loaders' check and the training loader's position (the index of the batch being trained)."""

    def __init__(self) -> None:
        self.batch_idx = -1
        """The index in the epoch of the training batch last started (-1 before the first)."""

    def record(self, step_args: tuple[Any, ...], step_kwargs: dict[str, Any]) -> None:
        """Note the training step's batch index (the loader's saved position is the next one)."""
        self.batch_idx = batch_index(step_args, step_kwargs)

    def process(self, dataloader: Any, global_batch: int, training: bool) -> Any:
        """Check a loader's batch size; a training ``DataLoader`` is rebuilt with one share."""
        if is_split(dataloader):
            return dataloader
        batch_size = getattr(dataloader, "batch_size", None)
        if batch_size is not None and batch_size != global_batch:
            raise field_error("DataLoader.batch_size", batch_size,
                              f"equal the plan's global_batch_size ({global_batch}): every rank "
                              "loads the whole global batch")
        if not isinstance(dataloader, DataLoader) or not training:
            return dataloader
        check_splittable(dataloader)
        size = len(dataloader.dataset)  # type: ignore[arg-type]
        if size % global_batch and not dataloader.drop_last:
            raise field_error("DataLoader.drop_last", False, f"be True when the dataset size ({size}) is not a "
                              f"multiple of the global batch ({global_batch}): a short last batch cannot be cut "
                              "into the plan's micro-batches")
        return split_loader(dataloader, global_batch, [global_batch], 0, lambda: self.batch_idx + 1)
