"""What each rank's (and each micro-batch's) loss is weighted by: ``LossWeighting``, and the one token count.

A loss that is a mean over its batch's non-ignored label tokens (``model(**batch).loss`` of a Hugging Face causal
LM, ``F.cross_entropy(..., ignore_index=-100)``) is the single-process update only if every rank's, and every
micro-batch's, loss is weighted by its share of the global batch's counted tokens, not of its samples, as soon as
the ranks hold different numbers of real tokens (padding, variable lengths).  The runtimes call:

1. ``resolve_weighting`` once: ``auto`` is ``tokens`` for a Hugging Face causal LM (the LightningModule holds one,
   or the pipeline loss says ``shifts_labels``), else ``samples``; the choice is logged once, on rank 0; it gives
   the run's ``LossTokens`` (None: weight by samples).
2. ``LossTokens.count`` / ``LossTokens.of_batch`` per batch: the labels are a dict batch's ``labels`` or a pair's
   second element; ``-100`` is ignored; a causal LM shifts its labels by one (token ``t`` predicts ``t + 1``), so
   its count is over ``labels[..., 1:]``; our own models' labels are already targets, counted whole.

A rank (micro-batch) without a counted token gets weight 0 and its loss, ``nan`` for a plain mean over nothing, is
made 0 before backward (``LossTokens.weighted``), so it adds nothing to the update.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.core.errors import ConfigError, field_error, require_option
from het_strategy.core.log import rank_zero_info, rank_zero_warning
from het_strategy.hf.causal_lm_loss import IGNORE_INDEX

__all__ = ["LossWeighting", "LossTokens", "RankLossCounts", "check_weighting", "resolve_weighting", "batch_labels",
           "has_ignored_labels", "holds_causal_lm", "summed_count"]


class LossWeighting(StrEnum):
    """What a rank's (a micro-batch's) mean loss is weighted by, so the update is the single-process one."""

    auto = "auto"
    """``tokens`` for a Hugging Face causal LM, ``samples`` otherwise (logged once)."""
    samples = "samples"
    """Its samples: exact for a loss that is a mean over samples, or over tokens when every sample has as many."""
    tokens = "tokens"
    """Its labels' non-ignored tokens (``!= -100``): exact for a mean over the counted tokens (padded batches)."""


def check_weighting(option: Any, field: str = "loss_weighting") -> LossWeighting:
    """``option`` as a ``LossWeighting`` (at construction), or a ConfigError naming ``field`` and the choices."""
    return require_option(LossWeighting, option, field)


@dataclass(frozen=True)
class LossTokens:
    """How a run counts the label tokens its losses average over (``loss_weighting="tokens"``)."""

    shifted: bool
    """The loss shifts its labels by one (a causal LM): the tokens counted are ``labels[..., 1:]``."""

    def count(self, labels: torch.Tensor) -> int:
        """The tokens of ``labels`` the loss counts: those ``!= -100`` (over ``labels[..., 1:]`` when shifted)."""
        counted = labels[..., 1:] if self.shifted and labels.dim() > 1 else labels
        return int((counted != IGNORE_INDEX).sum().item())

    def of_batch(self, batch: Any, where: str) -> int:
        """``count`` of ``batch``'s labels (``batch_labels``); a batch without labels is refused, naming ``where``."""
        labels = batch_labels(batch)
        if labels is None:
            raise field_error(where, type(batch).__name__, "carry its labels as a tensor (a mapping's 'labels' or "
                              "a pair's second element) under loss_weighting='tokens'",
                              "or pass loss_weighting='samples'")
        return self.count(labels)

    @staticmethod
    def weighted(loss: torch.Tensor, weight: Any) -> torch.Tensor:
        """``loss x weight``; with weight 0 the loss's ``nan`` (a mean over no token) is made 0 first, so its
        gradient is 0, not ``nan``."""
        return (loss.nan_to_num(0.0) if weight == 0 else loss) * weight


def resolve_weighting(option: LossWeighting | str, *, causal_lm: bool, rank: int, runtime: str
                      ) -> LossTokens | None:
    """The run's ``LossTokens`` (None: weighted by samples) for ``option``; the choice is logged once on rank 0.

    ``causal_lm``: the model is a Hugging Face causal LM (``auto`` means ``tokens``; its labels are shifted by one)."""
    given = check_weighting(option)
    chosen = given if given is not LossWeighting.auto else (
        LossWeighting.tokens if causal_lm else LossWeighting.samples)
    counted = "labels[..., 1:] != -100, a causal LM's shifted labels" if causal_lm else "labels != -100"
    rank_zero_info(rank, "%s: loss_weighting=%s%s: each rank's loss is weighted by its %s", runtime, chosen.value,
                   " (auto)" if given is LossWeighting.auto else "",
                   f"counted tokens ({counted})" if chosen is LossWeighting.tokens else "samples")
    return LossTokens(shifted=causal_lm) if chosen is LossWeighting.tokens else None


def holds_causal_lm(module: Any) -> bool:
    """Whether ``module`` holds one Hugging Face causal LM as a direct child (``hf.lightning_adapter.hf_model_of``,
    its ``loss_type`` ``ForCausalLM``: its loss shifts its labels).  Several models (a teacher and a student): no,
    ``auto`` does not guess which loss is trained."""
    from het_strategy.hf.lightning_adapter import hf_model_of

    try:
        model = hf_model_of(module)
    except ConfigError:
        return False
    return model is not None and getattr(model, "loss_type", None) == "ForCausalLM"


def batch_labels(batch: Any) -> torch.Tensor | None:
    """The labels of a batch: a mapping's ``labels``, or the second element of a tuple or list; else None."""
    if isinstance(batch, Mapping):
        labels = batch.get("labels")
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        labels = batch[1]
    else:
        return None
    return labels if isinstance(labels, torch.Tensor) else None


def has_ignored_labels(batch: Any) -> bool:
    """Whether ``batch``'s integer labels hold a ``-100`` (a token no loss counts: padding, a prompt)."""
    labels = batch_labels(batch)
    return labels is not None and not labels.is_floating_point() and bool((labels == IGNORE_INDEX).any())


def summed_count(local: int, device: Any, group: Any = None) -> int:
    """``local`` summed over the ranks of ``group`` (every rank: None): the step's count of a token-weighted loss,
    one small all-reduce before backward (a collective: every rank of the group calls it)."""
    value = torch.tensor([local], dtype=torch.int64, device=device)
    dist.all_reduce(value, group=group)
    return int(value.item())


class RankLossCounts:
    """A data-parallel rank's count its current batch's loss is weighted by: its samples (the loader's), or its
    counted label tokens, every rank's summed once per batch (``hetero``'s ``loss_weighting``).

    ``resolve`` once at setup; ``begin_batch`` at each step; ``counts`` where the loss is weighted (before
    backward, unsummed: the extension sums over its group) or a mean is reduced (summed over the world)."""

    def __init__(self, option: LossWeighting | str, runtime: str) -> None:
        self.option = check_weighting(option)
        """The ``loss_weighting`` option as given (``auto`` is resolved at setup)."""
        self.runtime = runtime
        self.tokens: LossTokens | None = None
        """How the labels' tokens are counted when losses are weighted by them (from ``resolve``), else None."""
        self._resolved = False
        self._labels_checked = False
        self._current: tuple[int, int | None] | None = None

    def resolve(self, module: Any, rank: int) -> None:
        """Decide the weighting for ``module`` (once: a later setup keeps it)."""
        if not self._resolved:
            self.tokens = resolve_weighting(self.option, rank=rank, runtime=self.runtime,
                                            causal_lm=holds_causal_lm(module))
            self._resolved = True

    def begin_batch(self, batch: Any, samples: tuple[int, int] | None, training_rank: int | None) -> None:
        """This batch's counted label tokens (not summed yet) when losses are weighted by tokens (a filler's: 0);
        an evaluation batch without labels is weighted by its samples.

        ``training_rank`` (a training batch's rank): a samples-weighted run whose first training batch's labels
        carry ``-100`` is told once that its update is exact only if every rank holds as many counted tokens."""
        self._current = None
        if self.tokens is None:
            if training_rank is not None and not self._labels_checked:
                self._labels_checked = True
                if has_ignored_labels(batch):
                    rank_zero_warning(training_rank, f"{self.runtime}: the labels carry -100 (tokens no loss counts) "
                                      "and each rank's loss is weighted by its samples: the update is the "
                                      "single-process one only if every rank's batch holds as many counted tokens; "
                                      "for a loss averaged over tokens pass loss_weighting='tokens'")
            return
        if samples is not None and (training_rank is not None or batch_labels(batch) is not None):
            self._current = (self.tokens.of_batch(batch, "training batch") if samples[0] else 0, None)

    def counts(self, samples: tuple[int, int] | None, device: Any, summed: bool) -> tuple[int, int | None] | None:
        """(this rank's, every rank's) count: ``samples`` (the loader's), or the counted tokens, every rank's
        summed when ``summed`` (one small all-reduce per batch: a collective), else None until the extension sums
        it."""
        if self.tokens is None or self._current is None:
            return samples
        local, total = self._current
        if summed and total is None:
            total = summed_count(local, device)
            self._current = (local, total)
        return local, total

    def weighted(self, loss: torch.Tensor, weight: Any) -> torch.Tensor:
        """``loss`` times its weight (``LossTokens.weighted`` under token weighting)."""
        return loss * weight if self.tokens is None else LossTokens.weighted(loss, weight)
