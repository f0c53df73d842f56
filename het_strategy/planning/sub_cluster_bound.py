"""Lower bounds on the step time of any plan that uses every device of a sub-cluster (``objective``'s search).

The search visits sub-clusters in the order of ``step_time_s`` and skips one that ``exceeds`` shows cannot
beat the best plan found; neither may exceed a plan's step time (a plan would be lost).

1. **Closed form** (the order).  Kind ``k`` (equal ``CostModel.device_key`` and node size) spends at least
   ``c[k][l]`` device-seconds per sample on layer ``l`` (best over micro-batches 1..max and tp degrees t of
   t x one micro-batch's seconds / micro-batch).  ``w[l] = min_k c[k][l]``, ``s[d] = max_l w[l] / c[k(d)][l]``:
   ``T >= B sum(w) / sum_d s[d]``, tight when kinds keep their speed ratio across layers (datasheet FLOPs),
   several times too low under the roofline (memory-bound embedding, compute-bound blocks).
2. **The LP with overheads** (``exceeds``).  Every device's step holds its own compute plus an overhead: in
   1F1B the first micro-batch crosses every other stage before it and the last after it (``pipeline_time_s``),
   and its optimizer update follows the slowest pipeline (``CostModel.score``).  Per layer that is one sample
   at the fastest wall time of any kept device (another stage's layer) or its own update (its stage's), so
   ``o[k] = sum_l min(wall[l], update[k][l])``.  Fractions ``x[k][l]``, ``sum_k x[k][l] = B``,
   ``sum_l c[k][l] x[k][l] <= n_k (T - o[k])`` exist; any ``y >= 0`` gives the dual bound
   ``T >= (B sum_l min_k c[k][l] y_k + sum_k n_k y_k o[k]) / sum_k n_k y_k``.  ``y`` starts at the best of a
   family (``_best_start``; exact for one kind), coordinate ascent (each at its best breakpoint), then
   multiplicative steps, until the bound passes the limit asked; every iterate is a valid bound.  tp degrees are limited to the kept
   devices of a node (a tp group lies in one node).
3. **Per tp degree** (``_per_tp_bound``): the same LP with a column per (kind, tp) at its own cost and overhead
   (a tp group splits the update but pays more device time); the plan picks the devices' degrees, so the bound
   is the least over one degree per kind (a linear-fractional minimum lies at a vertex).
Points 2 and 3 count overheads only where every plan is a pipeline plan (``with_overheads``: no fsdp plan,
whose update is sharded and whose step has no fill).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TP_DEGREES, TrainSettings

__all__ = ["SubClusterBound", "ASCENT_ROUNDS", "ASCENT_STEPS"]

ASCENT_ROUNDS = 6
"""Most rounds of coordinate ascent on the LP's dual per check (each iterate is a valid bound)."""
ASCENT_STEPS = 40
"""Most multiplicative ascent steps on the LP's dual per check, after the coordinate ascent."""


@dataclass(frozen=True)
class _Figures:
    """One (device key, tp cap)'s per-layer figures (seconds per sample, or per update)."""

    device_s: np.ndarray
    """Least device-seconds per sample over tp degrees and micro-batches."""
    wall_s: np.ndarray
    """Least wall seconds per sample over tp degrees and micro-batches."""
    update_s: np.ndarray
    """Least update seconds over tp degrees."""
    per_tp: np.ndarray
    """(tp degree, layer): least device-seconds per sample over micro-batches."""
    update: np.ndarray
    """(tp degree, layer): update seconds."""


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
                per_kind[key] = [float(x) for x in self._figures(d, key[1]).device_s]
        layers = range(cm.workload.num_layers)
        weights = [min(c[layer] for c in per_kind.values()) for layer in layers]
        self.work = sum(weights)
        rate = {k: max((w / c[layer] for layer, w in zip(layers, weights) if w > 0), default=math.inf)
                for k, c in per_kind.items()}
        self.rate = {name: rate[k] for name, k in kind_of.items()}
        self._slot_figures: dict[tuple, _Figures] = {}
        self._slots: dict[tuple[str, ...], tuple[tuple[tuple, int], ...]] = {}

    # -- per-device figures ---------------------------------------------------------------------------
    def _figures(self, device, tp_cap: int) -> "_Figures":
        """Per layer and tp degree <= ``tp_cap``: the least device-seconds and wall seconds per sample over
        micro-batches 1..max, and the update seconds."""
        cm, L = self.cm, self.cm.workload.num_layers
        tps = [t for t in TP_DEGREES if t <= self.settings.max_tp and t <= tp_cap]
        once = [[[cm.stage_compute_s(device, t, m, layer, layer + 1) for layer in range(L)] for m in self._sizes]
                for t in tps]
        per_tp = np.array([[min(t * once[i][j][layer] / m for j, m in enumerate(self._sizes)) for layer in range(L)]
                           for i, t in enumerate(tps)], dtype=float).reshape(len(tps), L)
        device_s = np.array([min(t * once[i][j][layer] / m for i, t in enumerate(tps)
                                 for j, m in enumerate(self._sizes)) for layer in range(L)], dtype=float)
        wall_s = np.array([min(once[i][j][layer] / m for i in range(len(tps)) for j, m in enumerate(self._sizes))
                           for layer in range(L)], dtype=float)
        update = np.array([[cm.stage_update_s(device, t, layer, layer + 1, self._dp_max) for layer in range(L)]
                           for t in tps], dtype=float).reshape(len(tps), L)
        return _Figures(device_s, wall_s, update.min(axis=0), per_tp, update)

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
        c = np.array([self._slot_figures[k].device_s for k, _ in kinds])
        if not (np.all(np.isfinite(c)) and np.all(c > 0)):
            return False
        n = np.array([float(count) for _, count in kinds])
        if self.with_overheads:
            wall = np.min([self._slot_figures[k].wall_s for k, _ in kinds], axis=0)
            upd = np.array([self._slot_figures[k].update_s for k, _ in kinds])
            over = np.minimum(wall[None, :], upd).sum(axis=1)
        else:
            wall, over = None, np.zeros(len(kinds))
        B = float(self.batch)
        y = _best_start(c, n, over, B)
        if (B * float((c * y[:, None]).min(axis=0).sum()) + float(np.dot(n * over, y))) / float(np.dot(n, y)) \
                > limit_s:
            return True
        for _ in range(ASCENT_ROUNDS if len(kinds) > 1 else 0):
            moved = False
            for k in range(len(kinds)):
                # the bound as a function of y_k alone is largest at a breakpoint: y_k = (the others' least
                # c[j][l] y_j) / c[k][l] for some layer l
                others = np.delete(c * y[:, None], k, axis=0).min(axis=0)
                trial = np.concatenate(([y[k]], others / c[k]))
                low = np.minimum(c[k][None, :] * trial[:, None], others[None, :])
                rest_cap = float(np.dot(n, y)) - n[k] * y[k]
                rest_over = float(np.dot(n * over, y)) - n[k] * over[k] * y[k]
                values = (B * low.sum(axis=1) + rest_over + n[k] * over[k] * trial) / (rest_cap + n[k] * trial)
                pick = int(np.argmax(values))
                if values[pick] > limit_s:
                    return True
                if pick and values[pick] > values[0] * (1 + 1e-12):
                    y[k], moved = trial[pick], True
            if not moved:
                break
        if len(kinds) > 1 and _multiplicative_ascent(c, n, over, B, limit_s):
            return True
        return wall is not None and self._per_tp_bound(kinds, n, y, wall) > limit_s

    def _per_tp_bound(self, kinds: tuple[tuple[tuple, int], ...], n: np.ndarray, y: np.ndarray,
                      wall: np.ndarray) -> float:
        """Point 3 of the module docstring: the LP with one column per (kind, tp degree), each with its own
        overhead, at its least over the plans' choices of one tp degree per kind."""
        figs = [self._slot_figures[k] for k, _ in kinds]
        best_total = np.array([f.device_s.sum() for f in figs])
        # y per (kind, tp): the kind's weight, scaled so a tp degree's whole-model device time weighs alike
        ys = [y[i] * best_total[i] / f.per_tp.sum(axis=1) for i, f in enumerate(figs)]
        over = [np.minimum(wall[None, :], f.update).sum(axis=1) for f in figs]
        g = float(self.batch) * float(np.min(np.concatenate([f.per_tp * yk[:, None] for f, yk in zip(figs, ys)]),
                                             axis=0).sum())
        if len(figs) > 4 or math.prod(len(yk) for yk in ys) > 256:
            return 0.0
        least = math.inf
        for choice in itertools.product(*(range(len(yk)) for yk in ys)):
            cap = sum(n[i] * ys[i][t] for i, t in enumerate(choice))
            fixed = sum(n[i] * ys[i][t] * over[i][t] for i, t in enumerate(choice))
            least = min(least, (g + fixed) / cap)
        return least


def _best_start(c: np.ndarray, n: np.ndarray, over: np.ndarray, batch: float) -> np.ndarray:
    """The best dual point of one family: for a set of kinds taken as doing the work, ``w[l]`` = the least of their
    ``c[k][l] / (k's whole-model time)``, and every kind at the least ``y_k`` with ``c[k][l] y_k >= w[l]`` (a kind
    outside the set weighs only what it could take of the work)."""
    K = c.shape[0]
    unit = c / c.sum(axis=1, keepdims=True)
    sets = [np.ones(K, dtype=bool)] if K > 6 else [np.array(bits, dtype=bool)
                                                   for bits in itertools.product((False, True), repeat=K) if any(bits)]
    best, best_y = -math.inf, 1.0 / c.sum(axis=1)
    for active in sets:
        w = unit[active].min(axis=0)
        y = (w[None, :] / c).max(axis=1)
        value = (batch * float(w.sum()) + float(np.dot(n * over, y))) / float(np.dot(n, y))
        if value > best:
            best, best_y = value, y
    return best_y


def _multiplicative_ascent(c: np.ndarray, n: np.ndarray, over: np.ndarray, batch: float, limit_s: float) -> bool:
    """From ``y_k`` = one over kind k's whole-model time, multiplicative steps along d log(bound) / d log(y):
    whether some iterate's bound passes ``limit_s`` (coordinate ascent can stall at a kink this passes)."""
    cols = np.arange(c.shape[1])
    y = 1.0 / c.sum(axis=1)
    step = 0.5
    for _ in range(ASCENT_STEPS):
        cap = float(np.dot(n, y))
        scaled = c * y[:, None]
        low = scaled.argmin(axis=0)
        total = batch * float(scaled[low, cols].sum()) + float(np.dot(n * over, y))
        if total / cap > limit_s:
            return True
        grad = np.zeros_like(y)
        np.add.at(grad, low, batch * c[low, cols])
        direction = y * (grad + n * over) / total - n * y / cap
        if np.max(np.abs(direction)) < 1e-9:
            return False
        y = y * np.exp(step * direction)
        step *= 0.92
    return False
