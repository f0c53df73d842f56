"""Detect slow ranks online and rebalance the global batch without restarting.

**Detection** (``ShiftDetector``, one per rank): on its per-sample compute time (a change of share is not a
change of speed) relative to the median rank of the same step.  A straggler is a rank slower than the others,
not a step slower than the last: a load that slows every rank alike moves no work and raises no alarm.  (With
two ranks each is compared with the other.)  Each rank's absolute per-sample seconds are tracked beside it
(``levels``) for the re-plan, which needs seconds.

**Mitigation ladder** (``StragglerMitigation``), decided identically on every rank from the same gathered
telemetry (no extra agreement step):

a. re-plan from the measured speeds (``planning.rebalance``) and hand the Plan to the strategy's run
   (``apply_plan``) from the first step no rank has produced yet, so every rank switches at the same step and
   each update stays exact and each sample is used once per epoch;
b. a rank slower than ``evict_ratio`` x the median keeps only ``min_share`` of the batch;
c. a rank slower than ``stop_ratio`` x the median: a checkpoint and a stop naming it, for an elastic restart.

Every decision is printed on rank 0, logged and kept in ``decisions`` (and in checkpoints, with the detectors'
state), naming each rank by its device.  Steps prefetched with the old shares feed no detector.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from het_strategy.callbacks.telemetry import FIELDS, StepTelemetry
from het_strategy.core.errors import field_error, require_int
from het_strategy.core.log import logger as het_logger, rank_debug
from het_strategy.planning.rebalance import rebalance
from het_strategy.planning.strategy_plans import shares_in_rank_order

__all__ = ["Shift", "ShiftDetector", "Decision", "StragglerMitigation"]

_MAD_SCALE = 1.4826  # MAD of a normal distribution -> its standard deviation


@dataclass(frozen=True)
class Shift:
    """A persistent change of a series' level."""

    old: float
    new: float

    @property
    def ratio(self) -> float:
        return self.new / self.old


class ShiftDetector:
    """Online detector of persistent level shifts in a positive series.

    The baseline is the median of the current regime's recent values (up to ``window``) before the last
    ``consecutive`` ones; its spread the scaled MAD.  A shift is declared when *every one* of the last
    ``consecutive`` values lies beyond both ``baseline x (1 + threshold)`` and ``baseline + z x MAD`` (or below
    ``baseline / (1 + threshold)`` and ``baseline - z x MAD``: a recovery); the new regime then starts from those
    values.  A spike shorter than ``consecutive`` steps cannot trigger it; noise of +-n% per step cannot when
    ``threshold`` > 2n.  Tuning: lower ``threshold`` to catch smaller shifts, lower ``consecutive`` to react
    faster (at more risk from bursts of noise).
    """

    def __init__(self, threshold: float = 0.25, consecutive: int = 4, window: int = 32, warmup: int = 8,
                 z: float = 4.0) -> None:
        if not (isinstance(threshold, (int, float)) and threshold > 0):
            raise field_error("threshold", threshold, "be > 0 (a relative shift, e.g. 0.25 = 25%)")
        for name, value, least in (("consecutive", consecutive, 1), ("window", window, 2), ("warmup", warmup, 1)):
            require_int(value, name, minimum=least)
        if window <= consecutive:
            raise field_error("window", window, f"be > consecutive ({consecutive})")
        if not (isinstance(z, (int, float)) and z >= 0):
            raise field_error("z", z, "be >= 0 (MADs)")
        self.threshold, self.consecutive, self.window, self.warmup, self.z = threshold, consecutive, window, warmup, z
        self.history: deque[float] = deque(maxlen=window)
        self._min_baseline = warmup
        self._last_level: float | None = None

    @property
    def level(self) -> float | None:
        """The current regime's median (the last known one right after a restart)."""
        return statistics.median(self.history) if self.history else self._last_level

    def update(self, value: float) -> Shift | None:
        """Add one value; a Shift when the last ``consecutive`` values confirm a new level."""
        self.history.append(float(value))
        values = list(self.history)
        k = self.consecutive
        if len(values) < self._min_baseline + k:
            return None
        base, recent = values[:-k], values[-k:]
        b = statistics.median(base)
        mad = _MAD_SCALE * statistics.median(abs(v - b) for v in base)
        high = max(b * (1 + self.threshold), b + self.z * mad)
        low = min(b / (1 + self.threshold), b - self.z * mad)
        if min(recent) > high or max(recent) < low:
            self.history = deque(recent, maxlen=self.window)
            self._min_baseline = 0  # the new regime's baseline is the values that confirmed it
            return Shift(old=b, new=statistics.median(recent))
        return None

    def adopt_recent(self) -> Shift:
        """Make the last ``consecutive`` values the new regime, because another detector confirmed a change at
        them; the Shift from the values before them (or the last known level) to them."""
        values = list(self.history)
        base, recent = values[:-self.consecutive], values[-self.consecutive:]
        new = statistics.median(recent) if recent else (self._last_level or 0.0)
        old = statistics.median(base) if base else (self._last_level if self._last_level is not None else new)
        self.history = deque(recent, maxlen=self.window)
        self._min_baseline = 0
        return Shift(old=old, new=new)

    def restart(self) -> None:
        """Forget the regime (after this rank's share changed); the next ``consecutive`` values found the next."""
        self._last_level = self.level
        self.history.clear()
        self._min_baseline = self.consecutive

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "min_baseline": self._min_baseline, "last_level": self._last_level}

    @override
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in state["history"]), maxlen=self.window)
        self._min_baseline = int(state["min_baseline"])
        self._last_level = state["last_level"]


@dataclass
class Decision:
    """One action of the ladder, with its reason."""

    step: int
    """Steps completed when decided."""
    effective_step: int
    """First step (counted like ``step``) that runs with the new shares."""
    action: str
    """``rebalance``, ``minimum_share`` or ``stop``."""
    ranks: list[int]
    """The ranks that moved against the median rank (``stop``: the ranks stopped for)."""
    shares_before: list[int]
    """Samples per rank of a full global batch before, in rank order."""
    shares_after: list[int]
    """... and from ``effective_step`` on."""
    reason: str
    """What was measured, naming each rank by its device (``mid (rank1) per-sample compute ...``)."""
    devices: list[str] = field(default_factory=list)
    """The cluster's names of the devices ``ranks`` play, in the same order (empty in checkpoints made before
    this field existed, until the callback is set up again)."""


def _reference(per_sample: dict[int, float], rank: int) -> float | None:
    """What rank ``rank``'s per-sample time is compared with: the median over the ranks of this step (the other
    rank in a world of two, where a median of two would halve every ratio's move); None alone."""
    if len(per_sample) < 2:
        return None
    if len(per_sample) == 2:
        return next(t for r, t in per_sample.items() if r != rank)
    return statistics.median(per_sample.values())


class StragglerMitigation(StepTelemetry):
    """Telemetry + online detection + the mitigation ladder, for the ``hetero`` strategy.

    Args:
        every_n_steps: telemetry exchange period (decisions happen then).
        threshold: the relative shift a detector reports (0.25: a 25% change of per-sample time).
        consecutive: values in a row that must confirm a shift.
        window: values a detector keeps for the regime's median.
        warmup: values before a detector reports anything.
        z: how many median absolute deviations off the regime's median a value must be to count toward a shift.
        min_share: the least fraction of the global batch a rank keeps (0 to 1/world).
        evict_ratio: rank slower than this x the median keeps only ``min_share`` (> 1; None: off).
        stop_ratio: rank slower than this x the median: checkpoint and stop (> 1; None: off).
        checkpoint_dir: where the stop checkpoint goes (default: the Trainer's root dir).
        log: log telemetry and decisions to the Trainer's loggers.
        verbose: print decisions on rank 0.
    """

    def __init__(self, every_n_steps: int = 2, threshold: float = 0.25, consecutive: int = 4, window: int = 32,
                 warmup: int = 8, z: float = 4.0, min_share: float = 0.0, evict_ratio: float | None = None,
                 stop_ratio: float | None = None, checkpoint_dir: str | Path | None = None, log: bool = True,
                 verbose: bool = True) -> None:
        super().__init__(every_n_steps=every_n_steps, log=log)
        self._detector_args = dict(threshold=threshold, consecutive=consecutive, window=window, warmup=warmup, z=z)
        ShiftDetector(**self._detector_args)  # validates them now, not at setup
        if not (isinstance(min_share, (int, float)) and 0 <= min_share < 1):
            raise field_error("min_share", min_share, "be a fraction of the global batch in [0, 1/world]")
        for name, ratio in (("evict_ratio", evict_ratio), ("stop_ratio", stop_ratio)):
            if ratio is not None and not (isinstance(ratio, (int, float)) and ratio > 1):
                raise field_error(name, ratio, "be > 1 (times the median per-sample time) or None")
        if evict_ratio is not None and stop_ratio is not None and stop_ratio <= evict_ratio:
            raise field_error("stop_ratio", stop_ratio, f"be > evict_ratio ({evict_ratio}): stopping is the last rung")
        self.min_share, self.evict_ratio, self.stop_ratio = float(min_share), evict_ratio, stop_ratio
        self.checkpoint_dir = checkpoint_dir
        self.verbose = verbose
        self.detectors: list[ShiftDetector] = []
        """Per rank: its per-sample compute time / the step's median over ranks (decides)."""
        self.levels: list[ShiftDetector] = []
        """Per rank: its per-sample compute seconds (what the re-plan is priced with)."""
        self.decisions: list[Decision] = []
        self._settle_until = 0
        """Rows of steps before this one ran with shares already replaced: they feed no detector."""
        self._restored: dict[str, Any] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        world = trainer.world_size
        if self.min_share > 1 / world:
            raise field_error("min_share", self.min_share, f"be <= 1/world = {1 / world:.4g} (every rank can't "
                              "keep more than an equal share)")
        if len(self.detectors) != world:
            self.detectors = [ShiftDetector(**self._detector_args) for _ in range(world)]
            self.levels = [ShiftDetector(**self._detector_args) for _ in range(world)]
        if self._restored is not None:
            self._load_detectors(self._restored)
        self._name_decisions()

    def _device_names(self) -> list[str] | None:
        """Rank r's device name in the cluster (rank r plays ``cluster.devices[r]``), when the runtime is known."""
        cluster = self.runtime.cluster if self.runtime is not None else None
        return [d.name for d in cluster.devices] if cluster is not None else None

    def _who(self, rank: int) -> str:
        """``mid (rank1)``: the device's name, and the rank where the name is not already it."""
        name = self._name(rank)
        return name if name == f"rank{rank}" else f"{name} (rank{rank})"

    def _name_decisions(self) -> None:
        """Decisions restored with ranks but no device names get the names of the cluster's devices."""
        names = self._device_names()
        if names is None:
            return
        for d in self.decisions:
            if not d.devices and d.ranks and max(d.ranks) < len(names):
                d.devices = [names[r] for r in d.ranks]

    # -- deciding -------------------------------------------------------------------------------
    def on_window(self, trainer: pl.Trainer, pl_module: pl.LightningModule, window: torch.Tensor,
                  batch_idx: int) -> None:
        """Feed each step of the gathered window to the detectors; act on ranks that moved against the median.

        Every rank holds the same window and runs the same detectors, so every rank finds the same shifts.
        """
        step_i, samples_i, compute_i = FIELDS.index("step"), FIELDS.index("samples"), FIELDS.index("compute_s")
        shifted: dict[int, tuple[Shift, Shift]] = {}
        alike: set[int] = set()
        for s in range(window.shape[1]):
            if int(window[0, s, step_i]) < self._settle_until:
                continue  # prefetched with the shares a decision already replaced
            per_sample = {r: float(window[r, s, compute_i]) / float(window[r, s, samples_i])
                          for r in range(window.shape[0]) if float(window[r, s, samples_i]) > 0}
            for r, t in per_sample.items():
                absolute = self.levels[r].update(t)
                reference = _reference(per_sample, r)
                if reference is None:
                    continue  # no other rank to compare with this step
                relative = self.detectors[r].update(t / reference)
                if relative is not None:
                    shifted[r] = (relative, absolute if absolute is not None else self.levels[r].adopt_recent())
                elif absolute is not None:
                    alike.add(r)
        if alike - set(shifted):
            rank_debug(trainer.global_rank, "straggler: per-sample compute of rank(s) %s shifted alike with the "
                       "median rank (a machine-wide change): no straggler", sorted(alike - set(shifted)))
        if shifted:
            self._act(trainer, self._movers(shifted), batch_idx)

    def _movers(self, shifted: dict[int, tuple[Shift, Shift]]) -> dict[int, tuple[Shift, Shift]]:
        """The ranks to name among those whose ratio to the median moved: the ones whose own seconds moved too.

        When one of two ranks slows 3x, both ratios move (3x up, 3x down) but only the slow one's seconds
        did; when three of four slow alike, only the fast one's ratio moves, and it is named (all are named
        when none's seconds moved beyond ``threshold``).
        """
        limit = math.log1p(self._detector_args["threshold"])
        moved = {r: pair for r, pair in shifted.items() if abs(math.log(max(pair[1].ratio, 1e-12))) >= limit}
        return moved or shifted

    def _act(self, trainer: pl.Trainer, shifted: dict[int, tuple[Shift, Shift]], batch_idx: int) -> None:
        runtime = self.runtime
        assert runtime is not None and runtime.plan is not None and runtime.cluster is not None
        before = list(runtime.current_shares())
        total = sum(before)
        levels = [det.level for det in self.levels]
        if any(t is None for t in levels):
            return  # a rank has never computed a sample yet: nothing to compare
        t = [float(x) for x in levels if x is not None]
        median_t = statistics.median(t)
        reasons = [f"{self._who(r)} per-sample compute {a.old * 1e3:.2f} -> {a.new * 1e3:.2f} ms ({a.ratio - 1:+.0%}), "
                   f"{rel.old:.2f}x -> {rel.new:.2f}x the median rank for {self.detectors[r].consecutive} "
                   "consecutive steps" for r, (rel, a) in sorted(shifted.items())]
        if self.stop_ratio is not None:
            stop = [r for r in range(len(t)) if t[r] > self.stop_ratio * median_t]
            if stop:
                self._stop(trainer, stop, before, t, median_t, reasons)
                return
        min_samples = int(self.min_share * total)
        evicted = [r for r in range(len(t)) if self.evict_ratio is not None and t[r] > self.evict_ratio * median_t]
        caps = [min_samples if r in evicted else None for r in range(len(t))]
        plan = rebalance(runtime.plan, runtime.cluster, t, minimum=[min_samples] * len(t), cap=caps)
        if plan is None:
            return
        after = shares_in_rank_order(plan, runtime.cluster)
        if after == before:
            return
        action = "minimum_share" if evicted else "rebalance"
        if evicted:
            reasons.append(f"{', '.join(self._who(r) for r in evicted)} slower than {self.evict_ratio}x the median "
                           f"per-sample time ({median_t * 1e3:.2f} ms): minimum share {min_samples}")
        first_step = runtime.next_safe_step()
        runtime.apply_plan(plan, first_step)
        for r, (old, new) in enumerate(zip(before, after)):
            if old != new:
                self.levels[r].restart()
        for det in self.detectors:
            det.restart()  # every ratio to the median moves when the median rank's share does
        done = self.steps_seen
        effective = done + first_step - (batch_idx + 1)
        self._settle_until = effective
        self._record(trainer, Decision(step=done, effective_step=effective, action=action, ranks=sorted(shifted),
                                       shares_before=before, shares_after=after, reason="; ".join(reasons),
                                       devices=[self._name(r) for r in sorted(shifted)]))

    def _name(self, rank: int) -> str:
        names = self._device_names()
        return names[rank] if names is not None and rank < len(names) else f"rank{rank}"

    def _stop(self, trainer: pl.Trainer, ranks: list[int], before: list[int], t: list[float], median_t: float,
              reasons: list[str]) -> None:
        folder = Path(self.checkpoint_dir or trainer.default_root_dir)
        path = folder / f"straggler-stop-step{self.steps_seen}.ckpt"
        reason = (f"{', '.join(self._who(r) for r in ranks)} slower than {self.stop_ratio}x the median per-sample "
                  f"time ({', '.join(f'{t[r] * 1e3:.2f}' for r in ranks)} vs {median_t * 1e3:.2f} ms): saved {path} "
                  "and stopped; restart without them (e.g. an elastic launcher and a cluster without those devices)")
        self._record(trainer, Decision(step=self.steps_seen, effective_step=self.steps_seen, action="stop",
                                       ranks=ranks, shares_before=before, shares_after=before,
                                       reason="; ".join(reasons + [reason]), devices=[self._name(r) for r in ranks]))
        trainer.save_checkpoint(path)
        trainer.should_stop = True

    def _record(self, trainer: pl.Trainer, decision: Decision) -> None:
        self.decisions.append(decision)
        if trainer.global_rank != 0:
            return
        if self.verbose:
            names = self._device_names()
            order = f" (devices {', '.join(names)})" if names is not None else ""
            # through the het_strategy logger: a line of its own, above the progress bar
            het_logger.info("het_strategy straggler [%s after step %d, effective from step %d]: shares %s -> %s%s; %s",
                            decision.action, decision.step, decision.effective_step, decision.shares_before,
                            decision.shares_after, order, decision.reason)
        if self.log:
            for logger in trainer.loggers:
                logger.log_metrics({f"straggler/share_rank{r}": float(s) for r, s in
                                    enumerate(decision.shares_after)}, step=decision.step)

    # -- checkpoints ----------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict[str, Any]:
        return super().state_dict() | {"detectors": [d.state_dict() for d in self.detectors],
                                       "levels": [d.state_dict() for d in self.levels],
                                       "settle_until": self._settle_until,
                                       "decisions": [asdict(d) for d in self.decisions]}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.decisions = [Decision(**d) for d in state_dict.get("decisions", [])]
        self._settle_until = int(state_dict.get("settle_until", 0))
        restored = {"relative": state_dict.get("detectors", []), "levels": state_dict.get("levels", [])}
        if self.detectors and len(self.levels) == len(restored["levels"]):
            self._load_detectors(restored)
        else:
            self._restored = restored  # loaded at setup, once the world size is known
        self._name_decisions()

    def _load_detectors(self, restored: dict[str, Any]) -> None:
        for det, state in zip(self.levels, restored["levels"]):
            det.load_state_dict(state)
        for det, state in zip(self.detectors, restored["relative"]):
            det.load_state_dict(state)
        self._restored = None
