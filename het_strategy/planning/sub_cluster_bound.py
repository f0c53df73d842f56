"""Lower bounds on the step time of any plan that uses every device of a sub-cluster (``objective``'s search).

``objective.search_objective`` visits sub-clusters in the order of ``SubClusterBound.step_time_s`` (the closed
form below) and skips one whose ``exceeds`` check shows it cannot beat the best plan found; neither may exceed
a plan's step time, or a plan would be lost.

1. **Closed form** (``step_time_s``, the order).  Kind ``k`` (devices of equal ``CostModel.device_key`` and node
   size) spends at least ``c[k][l]`` device-seconds per sample on layer ``l``: its best over micro-batches
   1..max and tensor-parallel degrees t of t x (one micro-batch's seconds at tp t) / micro-batch.  With
   ``w[l] = min_k c[k][l]`` and ``s[d] = max_l w[l] / c[k(d)][l]``, ``T >= B sum(w) / sum_d s[d]``: tight when
   kinds' speeds keep their ratio across layers (the datasheet model's case), several times too low under the
   roofline (a memory-bound embedding and compute-bound blocks give kinds different ratios per layer).
2. **The LP with overheads** (``exceeds``).  A plan's step is at least, for every device d, its own compute
   over the step plus its overhead ``o[d]``: in 1F1B the first micro-batch crosses every other stage before it
   and the last one after it (``pipeline_time_s``: fill + bottlenecks, each stage busy for all its micro-batches),
   and its optimizer update follows the slowest pipeline (``CostModel.score``).  Each layer is either on d's
   stage (its update, at d's tp) or on another (at least one sample through it, at the fastest wall time any
   kept device has), so ``o[k] = sum_l min(wall[l], update[k][l])``.  Fractions ``x[k][l] >= 0`` with
   ``sum_k x[k][l] = B`` and ``sum_l c[k][l] x[k][l] <= n_k (T - o[k])`` then exist; any ``y >= 0`` with
   ``sum_k n_k y_k = 1`` gives ``T >= B sum_l min_k c[k][l] y_k + sum_k n_k y_k o[k]`` (the LP's dual).
   ``y_k`` starts at one over kind k's whole-model time per sample (exact for one kind) and takes
   multiplicative ascent steps until the bound passes the limit asked about; every step is a valid bound.
   Here a kind is also limited to tp degrees within its node's *kept* devices (tp groups lie in one node).
   The overheads count only where every plan is a pipeline plan (``with_overheads``: no fsdp plan can be
   chosen, whose update is sharded and whose step has no fill); otherwise ``o = 0``.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TP_DEGREES, TrainSettings

__all__ = ["SubClusterBound", "ASCENT_STEPS"]

ASCENT_STEPS = 40
"""Most multiplicative ascent steps on the LP's dual per check (each iterate is a valid bound)."""


class SubClusterBound:
    """Lower bounds on the step time of any plan that uses every device of a sub-cluster."""

    def __init__(self, cm: CostModel, settings: TrainSettings, with_overheads: bool = False) -> None:
        self.cm, self.settings, self.with_overheads = cm, settings, with_overheads
        self.batch = settings.global_batch_size
        cluster = cm.cluster
        self._sizes = range(1, max(settings.micro_batch_sizes) + 1)
        self._dp_max = max(1, min(cluster.num_devices, settings.global_batch_size))
        per_kind: dict[tuple, list[float]] = {}
        kind_of: dict[str, tuple] = {}
        for d in cluster.devices:
            key = (cm.device_key(d), len(cluster.node(d.node).devices))
            kind_of[d.name] = key
            if key not in per_kind:
                per_kind[key] = [float(x) for x in self._figures(d, key[1])[0]]
        layers = range(cm.workload.num_layers)
        weights = [min(c[layer] for c in per_kind.values()) for layer in layers]
        self.work = sum(weights)
        rate = {k: max((w / c[layer] for layer, w in zip(layers, weights) if w > 0), default=math.inf)
                for k, c in per_kind.items()}
        self.rate = {name: rate[k] for name, k in kind_of.items()}
        self._slot_figures: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._slots: dict[tuple[str, ...], tuple[tuple[tuple, int], ...]] = {}

    # -- per-device figures ---------------------------------------------------------------------------
    def _figures(self, device, tp_cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per layer: (least device-seconds per sample, least wall seconds per sample, least update seconds) over
        tp degrees <= ``tp_cap`` and micro-batches 1..max."""
        cm, L = self.cm, self.cm.workload.num_layers
        tps = [t for t in TP_DEGREES if t <= self.settings.max_tp and t <= tp_cap]
        once = [[[cm.stage_compute_s(device, t, m, layer, layer + 1) for layer in range(L)] for m in self._sizes]
                for t in tps]
        device_s = np.array([min(t * once[i][j][layer] / m for i, t in enumerate(tps)
                                 for j, m in enumerate(self._sizes)) for layer in range(L)], dtype=float)
        wall_s = np.array([min(once[i][j][layer] / m for i in range(len(tps)) for j, m in enumerate(self._sizes))
                           for layer in range(L)], dtype=float)
        update_s = np.array([[cm.stage_update_s(device, t, layer, layer + 1, self._dp_max) for layer in range(L)]
                             for t in tps], dtype=float).reshape(len(tps), L).min(axis=0)
        return device_s, wall_s, update_s

    def _slot(self, name: str, tp_cap: int) -> tuple:
        d = self.cm.cluster.device(name)
        key = (self.cm.device_key(d), tp_cap)
        if key not in self._slot_figures:
            self._slot_figures[key] = self._figures(d, tp_cap)
        return key

    def _kinds(self, kept: tuple[str, ...]) -> tuple[tuple[tuple, int], ...]:
        """(kind, count) of ``kept``, a kind being (device key, kept devices in its node)."""
        hit = self._slots.get(kept)
        if hit is None:
            cluster = self.cm.cluster
            per_node = Counter(cluster.device(d).node for d in kept)
            kinds = Counter(self._slot(d, per_node[cluster.device(d).node]) for d in kept)
            hit = self._slots[kept] = tuple(sorted(kinds.items(), key=repr))
        return hit

    # -- the bounds -----------------------------------------------------------------------------------
    def step_time_s(self, kept: tuple[str, ...]) -> float:
        """The closed-form bound (point 1 of the module docstring; seconds; 0.0 where nothing is priced)."""
        total = sum(self.rate[d] for d in kept)
        return 0.0 if self.work <= 0 or math.isinf(total) else self.batch * self.work / total

    def max_samples_per_s(self, kept: tuple[str, ...]) -> float:
        lower = self.step_time_s(kept)
        return self.batch / lower if lower > 0 else math.inf

    def exceeds(self, kept: tuple[str, ...], limit_s: float) -> bool:
        """Whether every plan using all of ``kept`` takes longer than ``limit_s`` (point 2: True only once a dual
        point of the LP shows it; False when none found does)."""
        if self.step_time_s(kept) > limit_s:
            return True
        kinds = self._kinds(kept)
        c = np.array([self._slot_figures[k][0] for k, _ in kinds])
        if not (np.all(np.isfinite(c)) and np.all(c > 0)):
            return False
        n = np.array([float(count) for _, count in kinds])
        if self.with_overheads:
            wall = np.min([self._slot_figures[k][1] for k, _ in kinds], axis=0)
            upd = np.array([self._slot_figures[k][2] for k, _ in kinds])
            over = np.minimum(wall[None, :], upd).sum(axis=1)
        else:
            over = np.zeros(len(kinds))
        B = float(self.batch)
        cols = np.arange(c.shape[1])
        y = 1.0 / c.sum(axis=1)
        step = 0.5
        for _ in range(ASCENT_STEPS):
            cap = float(np.dot(n, y))
            scaled = c * y[:, None]
            low = scaled.argmin(axis=0)
            g = B * float(scaled[low, cols].sum())
            total = g + float(np.dot(n * over, y))
            if total / cap > limit_s:
                return True
            if len(kinds) == 1:
                return False  # one kind: y is the LP's optimum
            # d log(bound) / d log(y_k): the kind's share of the dual's value less its share of the capacity
            grad = np.zeros_like(y)
            np.add.at(grad, low, B * c[low, cols])
            direction = y * (grad + n * over) / total - n * y / cap
            if np.max(np.abs(direction)) < 1e-9:
                return False
            y = y * np.exp(step * direction)
            step *= 0.92
        return False
