"""Gradient compression in the Trainer's loggers (wandb, CSV).

``CompressionMonitor`` reads the hetero strategy's ``compression_state`` on
rank 0 (the hook's counters are this rank's; every rank sends the same number
of bytes) and logs:

- ``compression/wire_ratio`` — fp32-allreduce bytes over the bytes sent so far,
  every ``every_n_steps`` steps and with every new decision, with the two
  totals behind it: ``compression/raw_bytes_total`` and
  ``compression/wire_bytes_total`` (this rank's; per step and per rank they
  are ``telemetry/rank{r}/raw_bytes`` and ``wire_bytes``, from ``StepTelemetry``);
- ``compression/bits/<layer>`` — each eligible layer's bits per element on the
  wire (32 = uncompressed fp32, 16 = uncompressed bf16), at every re-solve of the adaptive controller (the
  same per-layer decisions the hook prints).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from het_strategy.core.errors import require_int
from het_strategy.callbacks.runtime import runtime_of

__all__ = ["CompressionMonitor"]


class CompressionMonitor(pl.Callback):
    """Log the compression hook's wire saving and per-layer decisions (rank 0)."""

    def __init__(self, every_n_steps: int = 10) -> None:
        self.every_n_steps = require_int(every_n_steps, "every_n_steps", minimum=1)
        self._logged_through = -1  # decisions up to this step are logged

    def metrics(self, state: Any, step: int) -> dict[str, float]:
        """What to log at ``step`` for a ``CompressionState`` (empty: nothing new)."""
        out: dict[str, float] = {}
        for row in state.decisions:
            if row["step"] > self._logged_through:
                out[f"compression/bits/{row['layer']}"] = float(row["bits_per_element"])
        if state.decisions:
            self._logged_through = max(self._logged_through, state.decisions[-1]["step"])
        if out or step % self.every_n_steps == 0:
            out["compression/wire_ratio"] = float(state.wire_ratio)
            out["compression/raw_bytes_total"] = float(state.bytes_fp32)
            out["compression/wire_bytes_total"] = float(state.bytes_sent)
        return out

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state = runtime.compression_state if (runtime := runtime_of(trainer.strategy)) is not None else None
        if state is None or not trainer.is_global_zero:
            return
        metrics = self.metrics(state, trainer.global_step)
        if metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
