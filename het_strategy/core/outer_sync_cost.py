"""The price of low-communication training (``strategy="hetero_diloco"``): inner steps and outer exchanges.

A low-communication plan (``core/outer_sync.py``) runs in rounds: every group
takes H inner steps, side by side, then the groups exchange once.  So

    round_s = H x inner_step_s + exchange_s        step_time_s = round_s / H

``OuterSyncCost`` prices one group split on one ``CostModel``:

- ``device_step_s``: device i's inner step on its b_i samples, ``cost_i(b_i) =
  compute_i(b_i) + post_g`` (its replica's forward + backward, then its group's
  gradient allreduce and optimizer update);
- ``inner_step_s``: the slowest device's ``cost_i`` (the slowest group sets the
  pace: every group takes H steps);
- ``exchange`` (an ``ExchangePrice``): the outer exchange in one codec,
  everything between a round's last inner step and the next round's first;
- ``figures`` and ``score``: a plan's predicted figures and its ``PlanScore``.

A leader's payload is ``outer_payload_bytes``, from the codec's ``CodecSpec``
(``core/codecs.py``) as the runtime sends it, and encoding is priced at
``compressed_sync.codec_bandwidth``, as the compressed gradient sync is.  Beside
its replica every device keeps ``OUTER_STATE_BYTES`` per parameter: a micro-batch
fits when both do, and the plan's memory figures include them.  Pure Python +
numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from het_strategy.core.codecs import CODECS, Codec, CodecParams, Exchange, packed_bytes
from het_strategy.core.compressed_sync import codec_bandwidth, wire_fraction
from het_strategy.core.cost_model import CostModel
from het_strategy.core.network import NodeTuple, SyncRoute, ring_allreduce_bytes
from het_strategy.core.plan_score import PlanScore
from het_strategy.core.outer_sync import outer_codec
from het_strategy.core.plan import Pipeline, Plan, Stage

__all__ = ["FP32_BYTES", "OUTER_STATE_BYTES", "ExchangePrice", "OuterSyncCost", "outer_payload_bytes"]

FP32_BYTES = 4
"""Bytes per element of the pseudo-gradient and of the broadcast sum (fp32, whatever the training dtype)."""
OUTER_STATE_BYTES = 3 * FP32_BYTES
"""Bytes per parameter the outer loop keeps on a device (``diloco/outer_loop.py``): the outer parameters, the
outer optimizer's momentum and the error-feedback residual, each fp32."""


def outer_payload_bytes(token: Any, num_params: int, params: CodecParams = CodecParams()) -> int:
    """Bytes one leader's encoded pseudo-gradient of ``num_params`` fp32 elements takes in codec ``token``."""
    spec = CODECS[outer_codec(token, "plan.outer_sync.codec")]
    if spec.exchange is Exchange.QUANTIZED:
        assert spec.bits is not None
        padded = math.ceil(num_params / params.bucket_size) * params.bucket_size
        return packed_bytes(padded, spec.bits, params)
    per_element = spec.bytes_per_element("fp32", params)
    assert per_element is not None  # OUTER_CODECS: casts and quantizers
    return int(per_element * num_params)


@dataclass(frozen=True)
class ExchangePrice:
    """One outer exchange in one codec (``OuterSyncCost.exchange``, steps 1-5)."""

    codec: Codec
    payload_bytes: int
    """One leader's encoded pseudo-gradient."""
    encode_s: float
    """The slowest leader's encode (0 for a cast)."""
    allgather_s: float
    """The leaders' all-gather of the payloads."""
    decode_broadcast_s: float
    """The slowest group's decode of G payloads + broadcast of the sum inside the group."""
    outer_step_s: float
    """The slowest device's outer Nesterov step (step 5)."""
    inter_node_bytes: float
    """Bytes that cross inter-node links in one exchange (the all-gather's and the broadcasts' hops between
    nodes)."""

    @property
    def total_s(self) -> float:
        return self.encode_s + self.allgather_s + self.decode_broadcast_s + self.outer_step_s


class OuterSyncCost:
    """Prices inner steps and outer exchanges of one group split on one cost model (module docstring).

    Every device keeps ``OUTER_STATE_BYTES`` per parameter beside its replica (``CostModel.stage_memory_bytes``):
    the outer parameters and the outer optimizer's momentum in fp32, and a leader's error-feedback residual
    (counted on every device: any may lead).
    """

    def __init__(self, cm: CostModel, groups: Sequence[Sequence[str]], params: CodecParams = CodecParams()) -> None:
        self.cm = cm
        self.groups = tuple(tuple(g) for g in groups)
        self.params = params
        self.group_of = {d: g for g, group in enumerate(self.groups) for d in group}
        self.routes = _group_routes(cm, self.groups)
        """Per group: the ring of its gradient allreduce and of its leader's broadcast."""
        self.leader_route = _ring_route(cm, [g[0] for g in self.groups], flows_of={})
        """The ring of the leaders' all-gather (one ring: each node's interface carries one edge each way)."""
        L = cm.workload.num_layers
        self._sync = [cm.stage_sync_s(0, L, 1, len(g), r) for g, r in zip(self.groups, self.routes)]
        self._update = [max(cm.stage_update_s(cm.cluster.device(d), 1, 0, L, len(g)) for d in g) for g in self.groups]
        self._post = [s + u for s, u in zip(self._sync, self._update)]
        self._compute: dict[tuple, tuple[float, int | None]] = {}
        self._exchanges: dict[Codec, ExchangePrice] = {}

    # -- inner steps ----------------------------------------------------------------------------
    def post_s(self, group: int) -> float:
        """``post_g``: the allreduce of the gradients among ``group``'s devices only, over its route
        (``CostModel.stage_sync_s``: a ring inside the node for a node's group; nothing for a one-device group),
        plus its slowest optimizer update (``CostModel.stage_update_s``)."""
        return self._post[group]

    def compute_s(self, device: str, samples: int) -> float:
        """``compute_i(b)``: forward + backward of ``samples`` on a replica of the whole model on ``device``, the
        best over the micro-batch sizes whose replica (and outer state) fits the device (``CostModel.pipeline_cost``
        of a one-device pipeline: what the dp planner prices), ZeRO sharding over the group's replicas (inf: none
        fits)."""
        return self._best(device, samples)[0]

    def micro_batch(self, device: str, samples: int) -> int | None:
        """The micro-batch size ``compute_s`` chose (None: no size fits the device)."""
        return self._best(device, samples)[1]

    def device_step_s(self, device: str, samples: int) -> float:
        """``cost_i(b)``: the device's compute on ``samples`` + its group's sync and update."""
        return self.compute_s(device, samples) + self._post[self.group_of[device]]

    def inner_step_s(self, shares: Mapping[str, int]) -> float:
        """One inner step of every group with these per-device shares: the slowest device's ``cost_i``.

        A group's allreduce starts when its slowest device has finished its backward, so group g's step is
        ``max_{i in g} compute_i + post_g``, and the slowest group sets the pace (every group takes H steps).
        """
        return max(self.device_step_s(d, shares[d]) for d in self.group_of)

    def _best(self, device: str, samples: int) -> tuple[float, int | None]:
        cm, dev = self.cm, self.cm.cluster.device(device)
        dp = len(self.groups[self.group_of[device]])
        key = (cm.device_key(dev), dp, samples)
        hit = self._compute.get(key)
        if hit is not None:
            return hit
        L = cm.workload.num_layers
        budget = cm.memory_budget_bytes(dev, 1) - OUTER_STATE_BYTES * cm.workload.total_params
        sizes = cm.settings.micro_batch_sizes
        first_above = min((m for m in sizes if m >= samples), default=None)  # one micro-batch of the whole share
        best: tuple[float, int | None] = (math.inf, None)
        for m in sizes:
            if (m > samples and m != first_above) or cm.stage_memory_bytes(0, L, 1, m, 1, dp) > budget:
                continue
            time_s = cm.pipeline_cost(Pipeline((Stage((device,), (0, L)),), m, samples), dp)[0]
            if time_s < best[0]:
                best = (time_s, m)
        self._compute[key] = best
        return best

    def inner_inter_node_bytes(self) -> float:
        """Bytes crossing inter-node links in one inner step: the allreduces of groups that span nodes."""
        settings = self.cm.settings
        grad, token = self.cm.workload.total_params * settings.grad_bytes, settings.inter_node_compression
        out = 0.0
        for g, route in zip(self.groups, self.routes):
            if not route.inter_node:
                continue
            nodes = len(route.nodes)  # a ring ordered node by node crosses one edge per node
            if token != "none":  # the hierarchical exchange: the node leaders' ring in the wire format
                wire = int(grad * wire_fraction(token, settings.grad_reduce_dtype))
                out += nodes * ring_allreduce_bytes(wire, nodes)
            else:
                out += nodes * ring_allreduce_bytes(int(grad), len(g))
        return out

    # -- outer exchange ---------------------------------------------------------------------------
    def exchange(self, token: Any) -> ExchangePrice:
        """The outer exchange in codec ``token`` (one of ``OUTER_CODECS``), as ``hetero_diloco`` runs it.

        1. Each group's leader (its first device) encodes its flat fp32 pseudo-gradient of P parameters
           (``WorkloadSpec.total_params``); the payload is ``outer_payload_bytes``:
           ``CodecSpec.bytes_per_element`` x P for a cast, the packed codes of P padded to whole buckets plus
           each bucket's metadata for a quantizer (``codecs.packed_bytes``).
        2. The G leaders all-gather the payloads: a ring over the leaders, node by node, each leader sending
           G-1 payloads over its edge; that is the all-gather half of a ring allreduce of G payloads
           (``Network.ring_allreduce_s`` / 2) on the leaders' route.
        3. Each leader decodes the G payloads and sums them.
        4. Each leader broadcasts the fp32 sum inside its group: ``(L-1)/L`` of it over the group's route, as
           ``compressed_sync`` prices a leader's broadcast (the all-gather half of a ring allreduce on the
           group's route).
        5. Every device takes the outer Nesterov step on its copy of the outer parameters: memory-bound, priced
           as one optimizer update (``CostModel.stage_update_s``, unsharded), the slowest device's.

        Encoding and decoding run at the leader's ``compressed_sync.codec_bandwidth`` (the rate of a quantize +
        dequantize round trip of fp32 input; one encode, or one decode, is priced as half a round trip); a cast
        is not priced, as ``compressed_sync`` does not price one.  The total (``ExchangePrice.total_s``) is the
        slowest leader's encode + the all-gather + the slowest group's decode + broadcast + the outer step.
        """
        token = outer_codec(token, "plan.outer_sync.codec")
        hit = self._exchanges.get(token)
        if hit is not None:
            return hit
        cm, G = self.cm, len(self.groups)
        numel = cm.workload.total_params
        payload = outer_payload_bytes(token, numel, self.params)
        net = cm.network
        allgather = net.ring_allreduce_s(G * payload, self.leader_route) / 2
        encodes = CODECS[token].exchange is not Exchange.ALLREDUCE
        fp32 = FP32_BYTES * numel

        def half_round_trip(leader: str) -> float:
            return fp32 / codec_bandwidth(cm.cluster.device(leader)) / 2

        encode = max(half_round_trip(g[0]) for g in self.groups) if encodes else 0.0
        tail = max((G * half_round_trip(g[0]) if encodes else 0.0) + net.ring_allreduce_s(fp32, r) / 2
                   for g, r in zip(self.groups, self.routes))
        crossing = 0.0
        if self.leader_route.inter_node:  # the ring crosses one edge per node, each carrying G - 1 payloads
            crossing += len(self.leader_route.nodes) * (G - 1) * payload
        for g, r in zip(self.groups, self.routes):
            if r.inter_node:
                crossing += len(r.nodes) * ring_allreduce_bytes(fp32, len(g)) / 2
        L = cm.workload.num_layers
        outer_step = max(cm.stage_update_s(d, 1, 0, L, 1) for d in cm.cluster.devices)
        price = self._exchanges[token] = ExchangePrice(token, payload, encode, allgather, tail, outer_step, crossing)
        return price

    # -- one round ------------------------------------------------------------------------------
    def figures(self, shares: Mapping[str, int], inner_steps: int, token: Any) -> dict[str, float]:
        """The predicted figures of a plan with these shares, H and codec (``Plan.predicted`` keys)."""
        inner = self.inner_step_s(shares)
        ex = self.exchange(token)
        round_s = inner_steps * inner + ex.total_s
        batch = sum(shares.values())
        step = round_s / inner_steps
        crossing = ex.inter_node_bytes + inner_steps * self.inner_inter_node_bytes()
        return {"inner_step_s": inner, "exchange_s": ex.total_s, "round_s": round_s, "step_time_s": step,
                "samples_per_s": batch / step, "bytes_per_sample": crossing / (inner_steps * batch),
                "sync_overhead": ex.total_s / round_s, "exchange_bytes_per_round": ex.inter_node_bytes,
                "payload_bytes": float(ex.payload_bytes), "inner_steps": inner_steps}

    def score(self, plan: Plan) -> PlanScore:
        """The cost model's figures for a low-communication plan: step time = round / H (``figures``), each
        device's compute as its pipeline time, the group syncs and the exchange's share as the sync."""
        assert plan.outer_sync is not None
        shares = {pipe.stages[0].devices[0]: pipe.samples for pipe in plan.pipelines}
        fig = self.figures(shares, plan.outer_sync.inner_steps, plan.outer_sync.codec)
        cm = self.cm
        memory: dict[str, float] = {}
        times, stage_costs = [], []
        for pipe in plan.pipelines:
            device = pipe.stages[0].devices[0]
            dp = len(self.groups[self.group_of[device]])
            time_s, costs, mem = cm.pipeline_cost(pipe, dp)
            times.append(time_s)
            stage_costs.append(costs)
            memory.update({d: b + OUTER_STATE_BYTES * cm.workload.total_params for d, b in mem.items()})
        sync = max(self._sync) + fig["exchange_s"] / plan.outer_sync.inner_steps
        return PlanScore(step_time_s=fig["step_time_s"], samples_per_s=fig["samples_per_s"], pipeline_times_s=times,
                         sync_time_s=sync, update_time_s=max(self._update), memory_bytes=memory,
                         memory_capacity_bytes={d: cm.memory_capacity_bytes(cm.cluster.device(d)) for d in memory},
                         stage_costs=stage_costs,
                         grad_dtype=cm.settings.grad_reduce_dtype, network=cm.network.describe())


def _group_routes(cm: CostModel, groups: Sequence[Sequence[str]]) -> list[SyncRoute]:
    """Per group, its ring's route; a node's interface is shared by every group ring that leaves it."""
    node_of = {d.name: d.node for d in cm.cluster.devices}
    flows: dict[str, int] = {}
    for g in groups:
        nodes = {node_of[d] for d in g}
        if len(nodes) > 1:
            for n in nodes:
                flows[n] = flows.get(n, 0) + 1
    return [_ring_route(cm, g, flows) for g in groups]


def _ring_route(cm: CostModel, members: Sequence[str], flows_of: Mapping[str, int]) -> SyncRoute:
    nodes = NodeTuple(sorted({cm.cluster.device(d).node for d in members}))
    flows = NodeTuple(max(1, flows_of.get(n, 1)) for n in nodes) if len(nodes) > 1 else ()
    return SyncRoute(len(members), nodes, flows)
