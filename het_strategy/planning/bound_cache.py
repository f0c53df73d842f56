"""The figures of ``bounds`` for one cost model: layer-range matrices, memory masks, DPs, cached.

A slot is described by ``(device key, tp, node)``.  Memory enters only as the
mask of layer ranges that fit, one per stage, deduplicated by content, so d
(ZeRO) or in-flight counts that change nothing share one.  The per-sample DPs
run stage by stage along tries of pipeline prefixes (by slot, mask and the
link figures at each stage's boundaries, without nodes): templates that share
a prefix share its work, and thousands of pipelines of one shape on nodes of
equal link figures cost one DP.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterable, Sequence

import numpy as np

from het_strategy.core.cost_model import CostModel
from het_strategy.core.network import NO_SYNC, SyncRoute
from het_strategy.planning.bounds import INFEASIBLE, CurveBound, PipelineBound, min_bottleneck, min_sum
from het_strategy.planning.pipeline import send_key, stage_matrices

__all__ = ["BoundCache"]

Slots = tuple[tuple[str, ...], ...]


class BoundCache:
    """Pipeline bounds for one cost model, cached by what they depend on.

    A slot is described by ``(device key, tp, node)``: devices of one key cost
    the same.  Memory enters only as the mask of layer ranges that fit, one per
    stage; masks are deduplicated by content, so d (ZeRO) or in-flight counts
    that change nothing share one.  ``tau`` and ``phi`` are computed stage by
    stage and cached per pipeline prefix (by slots and masks, without nodes):
    templates that share a prefix share its DP.

    ``fixed_in_flight``: stage s of an S-stage pipeline holds S - s micro-batches
    (how the families regime assembles, ``exact_in_flight=False``); otherwise one,
    the least any plan holds (valid for every assembly).

    The post figure comes in two strengths:

    * ``pipeline``: with the stages' actual gradient-ring routes (``ring_bandwidths``);
    * ``floor``: no routes needed; each stage's sync is priced on the cheapest
      route its ring could have: a ring inside the stage's node (only if that
      node holds >= d devices: the ring has d members) or a ring over the node
      and one other node, one flow each.  Valid because a ring's time does not
      fall when it spans more nodes or shares interfaces with more flows (the
      network model prices the slowest edge, and a flow's share of a node's
      interface falls with the flows).
    """

    def __init__(self, cm: CostModel, fixed_in_flight: bool = False) -> None:
        self.cm = cm
        self.fixed_in_flight = fixed_in_flight
        L = cm.workload.num_layers
        idx = np.arange(L + 1)
        self._valid = idx[:, None] < idx[None, :]
        self._start = np.where(idx == 0, 0.0, np.inf)
        self._m0 = min(cm.settings.micro_batch_sizes)
        self._sizes = range(1, max(cm.settings.micro_batch_sizes) + 1)
        self._device: dict[tuple, object] = {}
        self._slot_of: dict[tuple[str, ...], tuple] = {}
        self._per_sample: dict[tuple, np.ndarray] = {}
        self._masks: dict[tuple, np.ndarray] = {}
        self._by_content: dict[bytes, np.ndarray] = {}
        self._masked: dict[tuple, np.ndarray] = {}
        self._post: dict[tuple, np.ndarray] = {}
        self._floor: dict[tuple, np.ndarray] = {}
        self._raw_post: dict[tuple, np.ndarray] = {}
        self._raw_floor: dict[tuple, np.ndarray] = {}
        # prefix tries: (parent node, stage description, mask id[, d]) -> node; node -> DP vectors
        self._trie: dict[tuple, int] = {}
        self._trie_vecs: list[tuple[np.ndarray, np.ndarray]] = [(self._start, self._start)]
        self._floor_trie: dict[tuple, int] = {}
        self._floor_vecs: list[np.ndarray] = [self._start]
        self._dp_masks: dict[tuple, np.ndarray] = {}
        self._post_bound: dict[tuple, float] = {}
        self._refined: dict[tuple, CurveBound] = {}
        self._curves: dict[tuple, tuple] = {}
        self._at_size: dict[tuple, np.ndarray] = {}
        self._node_size = {n.name: len(n.devices) for n in cm.cluster.nodes}
        self._node_class = {n: cm.network.node_class(n) for n in self._node_size}
        self._class_nodes: dict[tuple, list[str]] = {}
        for n, c in self._node_class.items():
            self._class_nodes.setdefault(c, []).append(n)
        self._floor_key: dict[str, tuple] = {}
        self._names: dict[tuple, tuple[str, ...]] = {}
        self._link_keys: dict[tuple, tuple] = {}
        self._sends: dict[tuple, np.ndarray] = {}
        self._plus_sends_cache: dict[tuple, np.ndarray] = {}
        self._link_names: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def slot(self, devices: Sequence[str]) -> tuple:
        """The bound's description of a stage slot: (device key, tp, node)."""
        devices = tuple(devices)
        hit = self._slot_of.get(devices)
        if hit is None:
            dev = self.cm.cluster.device(devices[0])
            key = self.cm.device_key(dev)
            self._device.setdefault(key, dev)
            hit = self._slot_of[devices] = (key, len(devices), dev.node)
            self._names.setdefault(hit, devices)
        return hit

    # -- matrices ---------------------------------------------------------------------------------
    def _per_sample_matrix(self, key: tuple, tp: int) -> np.ndarray:
        """Per layer range: smallest compute seconds per sample over micro-batch sizes 1..M (inf if i >= j)."""
        hit = self._per_sample.get((key, tp))
        if hit is None:
            dev = self._device[key]
            best = None
            for k in self._sizes:
                p = self.cm.replicated_compute_prefix(dev, tp, k)
                per = (p[None, :] - p[:, None]) / k
                best = per if best is None else np.minimum(best, per)
            hit = self._per_sample[(key, tp)] = np.where(self._valid, best, np.inf)
        return hit

    def _mask(self, key: tuple, tp: int, dp: int, in_flight: int) -> np.ndarray:
        """Layer ranges that fit at the smallest micro-batch (canonical object per content)."""
        qkey = (key, tp, dp, in_flight)
        hit = self._dp_masks.get(qkey)
        if hit is None:
            capacity = self.cm.memory_budget_bytes(self._device[key], tp)
            mkey = (tp, in_flight, self.cm.settings.state_bytes_per_param(dp), capacity)
            hit = self._masks.get(mkey)
            if hit is None:
                ok = self._valid & (self.cm.memory_matrix(tp, self._m0, in_flight, dp) <= capacity)
                hit = self._masks[mkey] = self._by_content.setdefault(ok.tobytes(), ok)
            self._dp_masks[qkey] = hit
        return hit

    def masks(self, slots: Sequence[tuple], dp: int, fixed: bool | None = None) -> tuple[np.ndarray, ...]:
        """Per stage, the ranges that fit (``fixed``: S - s micro-batches in flight; default: the cache's)."""
        S = len(slots)
        fixed = self.fixed_in_flight if fixed is None else fixed
        return tuple(self._mask(key, tp, dp, S - s if fixed else 1) for s, (key, tp, _) in enumerate(slots))

    def _masked_per_sample(self, key: tuple, tp: int, mask: np.ndarray) -> np.ndarray:
        mkey = (key, tp, id(mask))
        hit = self._masked.get(mkey)
        if hit is None:
            hit = self._masked[mkey] = np.where(mask, self._per_sample_matrix(key, tp), np.inf)
        return hit

    def _post_matrix(self, key: tuple, tp: int, dp: int, route, mask: np.ndarray) -> np.ndarray:
        """Sync + update of every range, inf where the range does not fit (cached per route and mask)."""
        pkey = (key, tp, dp, route, id(mask))
        hit = self._post.get(pkey)
        if hit is None:
            rkey = (key, tp, dp, route)
            raw = self._raw_post.get(rkey)
            if raw is None:
                raw = self._raw_post[rkey] = self.cm.post_matrix(self._device[key], tp, dp, route)
            hit = self._post[pkey] = np.where(mask, raw, np.inf)
        return hit

    def _floor_node(self, node: str) -> tuple:
        """What the cheapest ring through ``node`` depends on: its link figures, its size, its peers' figures."""
        hit = self._floor_key.get(node)
        if hit is None:
            cls = self._node_class[node]
            if self.cm.cluster.links:  # explicit pair links: every node is its own case
                hit = ("node", node)
            else:
                hit = ("class", cls, self._node_size[node], len(self._class_nodes[cls]) > 1)
            self._floor_key[node] = hit
        return hit

    def _floor_matrix(self, key: tuple, tp: int, node: str, dp: int, mask: np.ndarray) -> np.ndarray:
        """Post on the cheapest route a ring of this stage could have (class docstring), masked."""
        fkey = (key, tp, self._floor_node(node), dp, id(mask))
        hit = self._floor.get(fkey)
        if hit is None:
            rkey = fkey[:4]
            raw = self._raw_floor.get(rkey)
            if raw is None:
                if dp <= 1:
                    cands = [NO_SYNC]
                else:
                    # one peer per class of link figures (equal figures price alike), or every node with links
                    peers = ([n for n in self._node_size if n != node] if self.cm.cluster.links else
                             [next((n for n in nodes if n != node), None) for nodes in self._class_nodes.values()])
                    cands = [SyncRoute(dp, tuple(sorted((node, other))), (1, 1)) for other in peers if other]
                    if self._node_size[node] >= dp:
                        cands.append(SyncRoute(dp, (node,), ()))
                dev = self._device[key]
                raw = self.cm.post_matrix(dev, tp, dp, cands[0])
                for route in cands[1:]:
                    raw = np.minimum(raw, self.cm.post_matrix(dev, tp, dp, route))
                self._raw_floor[rkey] = raw
            hit = self._floor[fkey] = np.where(mask, raw, np.inf)
        return hit

    # -- DPs ------------------------------------------------------------------------------------
    def _compute(self, slots: Sequence[tuple], masks: tuple) -> tuple[float, float]:
        """(tau, phi): min bottleneck and min sum of the per-sample figures over the stages' splits.

        The DP runs stage by stage along a trie of prefixes (by slot, mask and the links at the stage's two
        boundaries), so pipelines that share a prefix share its work."""
        if not slots or len(slots) > self.cm.workload.num_layers:
            return math.inf, math.inf
        return self._descend([((key, tp, id(mask)), functools.partial(self._masked_per_sample, key, tp, mask))
                              for (key, tp, _), mask in zip(slots, masks)], slots)

    def _descend(self, stages: Iterable[tuple[tuple, Callable[[], np.ndarray]]],
                 slots: Sequence[tuple], size: int | None = None) -> tuple[float, float]:
        """Min bottleneck and min sum over the layer splits of per-sample stage matrices plus the sends at the
        stages' boundaries (``_send_per_sample``), stage by stage along the trie of prefixes: each stage is
        (what its compute matrix depends on, how to build it)."""
        node = 0
        links = [self._link(a, b) for a, b in zip(slots, slots[1:])] + [None]
        prev = None
        for (part, matrix), link in zip(stages, links):
            tkey = (node, *part, prev, link)
            child = self._trie.get(tkey)
            if child is None:
                g, f = self._trie_vecs[node]
                fill = self._plus_sends(part, matrix, None, link, size)
                bott = self._plus_sends(part, matrix, prev, link, size)
                self._trie_vecs.append((np.maximum(g[:, None], bott).min(axis=0), (f[:, None] + fill).min(axis=0)))
                child = self._trie[tkey] = len(self._trie_vecs) - 1
            node, prev = child, link
        g, f = self._trie_vecs[node]
        return float(g[-1]), float(f[-1])

    def _plus_sends(self, part: tuple, matrix: Callable[[], np.ndarray], incoming: tuple | None,
                    outgoing: tuple | None, size: int | None) -> np.ndarray:
        """A stage's per-sample compute matrix plus its send out at the stop and (for the bottleneck) its send
        in at the start, per sample."""
        if incoming is None and outgoing is None:
            return matrix()
        pkey = (part, incoming, outgoing, size)
        hit = self._plus_sends_cache.get(pkey)
        if hit is None:
            hit = matrix()
            if outgoing is not None:
                hit = hit + self._send_per_sample(outgoing, size)[None, :]
            if incoming is not None:
                hit = hit + self._send_per_sample(incoming, size)[:, None]
            self._plus_sends_cache[pkey] = hit
        return hit

    def _link(self, a: tuple, b: tuple) -> tuple:
        """What the send from slot ``a`` to slot ``b`` is priced from (``pipeline.send_key``, alone on the link:
        sharing only slows a send) and the two groups' sizes."""
        hit = self._link_keys.get((a, b))
        if hit is None:
            names_a, names_b = self._names[a], self._names[b]
            hit = self._link_keys[(a, b)] = (send_key(self.cm, names_a[0], names_b[0], None), a[1], b[1])
            self._link_names.setdefault(hit, (names_a, names_b))
        return hit

    def _send_per_sample(self, link: tuple, size: int | None) -> np.ndarray:
        """Per stop layer j, a send's seconds per sample across ``link`` at micro-batch ``size`` (None: the least
        over sizes 1..M, which every micro-batch's send is at least, per sample)."""
        hit = self._sends.get((link, size))
        if hit is None:
            src, dst = self._link_names[link]
            sizes = self._sizes if size is None else (size,)
            by_bytes: dict[float, float] = {}  # layers of equal output size send alike
            per = [0.0]
            for j, layer in enumerate(self.cm.workload.layers):
                out = layer.output_bytes_per_sample
                if out not in by_bytes:
                    by_bytes[out] = min(self.cm.stage_send_s(m, j, src, dst) / m for m in sizes)
                per.append(by_bytes[out])
            hit = self._sends[(link, size)] = np.array(per)
        return hit

    def _floor_post(self, slots: Sequence[tuple], masks: tuple, dp: int) -> float:
        """Min over splits of the largest stage floor post (same trie scheme, nodes of equal figures alike)."""
        node = 0
        for (key, tp, where), mask in zip(slots, masks):
            tkey = (node, key, tp, self._floor_node(where), id(mask), dp)
            child = self._floor_trie.get(tkey)
            if child is None:
                g = self._floor_vecs[node]
                self._floor_vecs.append(np.maximum(g[:, None], self._floor_matrix(key, tp, where, dp, mask)
                                                   ).min(axis=0))
                child = self._floor_trie[tkey] = len(self._floor_vecs) - 1
            node = child
        return float(self._floor_vecs[node][-1])

    def _per_sample_at(self, key: tuple, tp: int, m: int, memory_dp: int) -> np.ndarray:
        """Compute seconds per sample of every range at micro-batch ``m``, inf where the range does not fit at
        ``m`` with one micro-batch in flight (the loosest memory)."""
        akey = (key, tp, m, memory_dp)
        hit = self._at_size.get(akey)
        if hit is None:
            dev = self._device[key]
            p = self.cm.replicated_compute_prefix(dev, tp, m)
            fits = self._valid & (self.cm.memory_matrix(tp, m, 1, memory_dp)
                                  <= self.cm.memory_budget_bytes(dev, tp))
            hit = self._at_size[akey] = np.where(fits, (p[None, :] - p[:, None]) / m, np.inf)
        return hit

    def _compute_at(self, slots: Sequence[tuple], m: int, memory_dp: int) -> tuple[float, float]:
        """(tau_m, phi_m): min bottleneck and min sum of the stages' compute per sample at micro-batch ``m``
        (``_per_sample_at``), over the splits."""
        return self._descend([((key, tp, m, memory_dp), functools.partial(self._per_sample_at, key, tp, m, memory_dp))
                              for key, tp, _ in slots], slots, m)

    def compute_curve(self, slots: Sequence[tuple], memory_dp: int) -> tuple[tuple[float, float, float, float], ...]:
        """The pieces of ``refined``'s curve from compute alone, without routes: ``(1, M, 0, phi)`` for one
        micro-batch and, per micro-batch size m on the menu, ``(m + 1, inf, m phi_m - 2 m tau_m + m tau,
        tau_m)`` (module ``bounds``; each send priced alone on its link, syncs left out: both keep a lower bound), with
        memory for one micro-batch in flight as if there were ``memory_dp`` replicas (the loosest any
        structure here has).  () when nothing fits."""
        links = tuple(self._link(a, b) for a, b in zip(slots, slots[1:]))
        ckey = (tuple((key, tp) for key, tp, _ in slots), links, memory_dp)
        hit = self._curves.get(ckey)
        if hit is None:
            tau, phi = self._compute(slots, self.masks(slots, memory_dp, fixed=False))
            pieces: list[tuple[float, float, float, float]] = []
            if math.isfinite(tau):
                pieces.append((1.0, float(self._sizes[-1]), 0.0, phi))
                for m in self.cm.settings.micro_batch_sizes:
                    t_m, f_m = self._compute_at(slots, m, memory_dp)
                    if math.isfinite(t_m):
                        pieces.append((float(m + 1), math.inf, m * f_m - 2 * m * t_m + m * tau, t_m))
            hit = self._curves[ckey] = tuple(pieces)
        return hit

    # -- bounds ---------------------------------------------------------------------------------
    def floor_shape(self, slots: Sequence[tuple]) -> tuple:
        """What ``floor`` of a pipeline depends on (equal shapes on other nodes of equal figures share it)."""
        return tuple((key, tp, self._floor_node(node)) for key, tp, node in slots)

    def floor(self, slots: Sequence[tuple], dp: int, memory_dp: int | None = None) -> PipelineBound:
        """Bound figures with each stage's sync on its cheapest possible route (no routes needed).

        Memory as for one micro-batch in flight (the loosest; stages in any position then share one
        mask, so pipelines of any length share their prefixes' DPs).  ``memory_dp`` (>= dp): judge memory
        as if there were that many replicas (ZeRO shards more, so more fits: still a lower bound, and
        pipelines of any d up to it share one DP).
        """
        masks = self.masks(slots, dp if memory_dp is None else memory_dp, fixed=False)
        tau, phi = self._compute(slots, masks)
        if not math.isfinite(tau):
            return INFEASIBLE
        return PipelineBound(tau, phi, self._floor_post(slots, masks, dp))

    def pipeline(self, slots: Sequence[tuple], dp: int, routes: Sequence) -> PipelineBound:
        """Bound figures of a pipeline given as slot descriptions (``slot``), with d = ``dp`` and its routes.

        Without ``fixed_in_flight`` the figures for shares past (S - 1) M samples (>= S micro-batches,
        stage s holding S - s) come too (``PipelineBound.beyond``).
        """
        masks = self.masks(slots, dp)
        tau, phi = self._compute(slots, masks)
        if not math.isfinite(tau):
            return INFEASIBLE
        pkey = (tuple((key, tp) for key, tp, _ in slots), tuple(map(id, masks)), dp, tuple(routes))
        post = self._post_bound.get(pkey)
        if post is None:
            post = self._post_bound[pkey] = min_bottleneck(
                [self._post_matrix(key, tp, dp, r, m) for (key, tp, _), r, m in zip(slots, routes, masks)])
        S = len(slots)
        if self.fixed_in_flight or S == 1:
            return PipelineBound(tau, phi, post)
        full = tuple(self._mask(key, tp, dp, S - s) for s, (key, tp, _) in enumerate(slots))
        tau_full, phi_full = self._compute(slots, full)
        return PipelineBound(tau, phi, post, (S - 1) * self._sizes[-1], tau_full, phi_full)

    def refined(self, names: Slots, dp: int, routes: Sequence) -> CurveBound:
        """Per micro-batch size m, from the very matrices the layer split uses (sends and all, at size m):

        * one micro-batch (b <= M samples): ``fill(b) >= b phi``;
        * n >= 2 micro-batches of m: ``T >= m phi_m + (b - 2m) tau_m + m tau``, where tau_m and phi_m are
          the min bottleneck and min fill per sample at size m (the last micro-batch, of l <= m samples,
          costs >= l tau); with memory for one micro-batch in flight while b <= (S - 1) m and for
          S - s on stage s beyond (then n >= S), unless ``fixed_in_flight``.
        """
        key = (names, dp, tuple(routes))
        hit = self._refined.get(key)
        if hit is not None:
            return hit
        slots = [self.slot(sl) for sl in names]
        S = len(slots)
        masks = self.masks(slots, dp)
        tau, phi = self._compute(slots, masks)
        if not math.isfinite(tau):
            self._refined[key] = hit = CurveBound((), math.inf)
            return hit
        M = self._sizes[-1]
        full = [S - s for s in range(S)]
        loose = full if self.fixed_in_flight else [1] * S
        post = min_bottleneck(stage_matrices(self.cm, names, self._m0, loose, dp, routes)[2])
        pieces = [(1.0, float(M), 0.0, phi)]
        for m in self.cm.settings.micro_batch_sizes:
            if self.fixed_in_flight or S == 1:
                regimes = [(full, m + 1, math.inf)]
            else:
                regimes = [(loose, m + 1, (S - 1) * m), (full, max(m + 1, (S - 1) * m + 1), math.inf)]
            for flight, lo, hi in regimes:
                if lo > hi:
                    continue
                bott, fill, _ = stage_matrices(self.cm, names, m, flight, dp, routes)
                t_m = min_bottleneck(bott) / m
                if math.isfinite(t_m):
                    f_m = min_sum(fill) / m
                    pieces.append((float(lo), hi, m * f_m - 2 * m * t_m + m * tau, t_m))
        self._refined[key] = hit = CurveBound(tuple(pieces), post)
        return hit

    def named_pipeline(self, slots: Sequence[tuple[str, ...]], dp: int, routes: Sequence) -> PipelineBound:
        """``pipeline`` for stage slots given as device names."""
        return self.pipeline([self.slot(sl) for sl in slots], dp, routes)
