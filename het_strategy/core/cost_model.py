"""The cost model: predicted step time and memory of any Plan.

One function, ``CostModel.score(plan)``, scores every plan — planned here, read
from a file, or hand-made — so plans from different sources compare on equal
terms; the planners price their candidates with the same ``CostModel``.

A plan's step is its slowest pipeline's 1F1B time (``pipeline_time_s``), then
every device's gradient allreduce with the replicas of its layers and its
optimizer update (``CostModel.score``).  A stage's compute per micro-batch is
its measured profile where one covers the device type and tp, else FLOPs over
the sustained rate or, with ``settings.compute_model=roofline``,
``core/compute_model.py``'s roofline (``CostModel._compute_layer_prefix``).
Transfers are priced by ``network.Network`` (the one place for the link model),
a compressed inter-node hop by ``core/compressed_sync.py``, memory by
``core/memory.py``.

What every caller may rely on:

- a send overlaps nothing on either side (the runtime's sends and receives are
  blocking), so per micro-batch a stage is busy for its compute plus every
  transfer at its two boundaries (``bottleneck_s``);
- gradient sync is not overlapped with backward: the model errs on the slow side;
- devices with equal ``device_key`` cost the same per layer, and a stage's
  figures are prefix-sum differences over its layers ``[start, stop)``, so a
  planner may group devices and price layer ranges in O(1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import numpy as np

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.device_spec import DeviceSpec
from het_strategy.core.compute_model import ComputeCalibration, device_roofline, layer_seconds
from het_strategy.core.compressed_sync import codec_bandwidth, hierarchical_sync_s, wire_fraction
from het_strategy.core.network import BLOCK_TP_ALLREDUCES, NO_SYNC, Network, SyncRoute, routes
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.core.train_settings import SyncModel, TrainSettings
from het_strategy.core.dtypes import DTYPE_BYTES
from het_strategy.core.holder_sync import HolderSchedule, holder_reductions, schedule
from het_strategy.core.memory import MemoryModel, overhead_bytes
from het_strategy.core.plan_score import PlanScore, StageCost
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

__all__ = ["CostModel", "pipeline_time_s", "fill_s", "bottleneck_s"]


class CostModel:
    """Scores plans for one cluster, workload and set of training settings."""

    def __init__(self, cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings,
                 profile: MeasuredProfile | None = None, network: Network | None = None,
                 calibration: ComputeCalibration | None = None) -> None:
        self.cluster = cluster
        self.calibration = calibration or ComputeCalibration.shipped()  # the roofline's constants
        if network is None:
            network = profile.network(cluster) if profile is not None and profile.network is not None \
                else Network(cluster)
        self.network = network
        self.workload = workload
        self.settings = settings
        self.profile = profile
        if profile is not None:
            profile.check_matches(workload)
        layers = workload.layers
        act_scale = settings.param_bytes / DTYPE_BYTES[workload.dtype]
        self._params = _prefix([layer.params for layer in layers])
        self._expert_params = [layer.moe.params_per_expert * layer.moe.num_experts if layer.moe else 0
                               for layer in layers]
        self._out = [layer.output_bytes_per_sample * act_scale for layer in layers]
        self.memory = MemoryModel(workload, settings)
        """The memory model (``core/memory.py``)."""
        self._representative: dict[tuple, DeviceSpec] = {}
        self._device_keys: dict[str, tuple[DeviceSpec, tuple]] = {}
        self._prefix_cache: dict[tuple, tuple[list[float], list[float]]] = {}
        self._replicated_prefix_cache: dict[tuple, np.ndarray] = {}

    def with_compression(self, token: str) -> "CostModel":
        """The same model, pricing the inter-node hop of gradient syncs in ``token`` (``compressed_sync``)."""
        settings = dataclasses.replace(self.settings, inter_node_compression=token)
        return CostModel(self.cluster, self.workload, settings, self.profile, self.network, self.calibration)

    # -- per-layer times ------------------------------------------------------------------------
    def device_key(self, device: DeviceSpec) -> tuple:
        """Devices with equal keys cost the same per layer (the planner groups them).  Kept per device object: the
        planner asks for every device of a large cluster many times."""
        hit = self._device_keys.get(device.name)
        if hit is not None and hit[0] is device:
            return hit[1]
        key = (device.type, tuple(sorted(device.tflops.items())), device.efficiency, device.memory_gb,
               device.memory_bandwidth_gbs, device.emulated_speed, self.cluster.node(device.node).intra_bandwidth_gbs,
               device.compute_units, device.tf32_tflops)
        self._representative.setdefault(key, device)
        self._device_keys[device.name] = (device, key)
        return key

    def uses_profile(self, device: DeviceSpec, tp: int) -> bool:
        return self.profile is not None and self.profile.covers(device.type, tp)

    def _layer_compute_prefix(self, device: DeviceSpec, tp: int, micro_batch: int
                              ) -> tuple[list[float], list[float]]:
        """Prefix sums of (fwd + bwd) and optimizer-update seconds per layer (dense part), cached."""
        cache_key = (self.device_key(device), tp, micro_batch)
        hit = self._prefix_cache.get(cache_key)
        if hit is None:
            hit = self._prefix_cache[cache_key] = self._compute_layer_prefix(device, tp, micro_batch)
        return hit

    def _compute_layer_prefix(self, device: DeviceSpec, tp: int, micro_batch: int
                              ) -> tuple[list[float], list[float]]:
        """Prefix sums of (fwd + bwd) and optimizer-update seconds per layer for one micro-batch.

        Forward + backward is the measured profile where it covers (device type, tp), measured tensor-parallel
        times included; else ``_analytic_compute`` plus, at tp > 1, the tensor-parallel communication over the
        node's own link, not overlapped: 2 activation allreduces per transformer block forward and 2 backward
        (+2 with activation checkpointing: the recomputed forward), and for an LM head split by vocabulary
        (``tensor_parallel``: a column-parallel linear with gathered logits) an all-gather of its output forward
        and an allreduce of its input's gradient backward.  Activation checkpointing adds one forward.
        """
        ckpt = self.settings.activation_checkpointing
        if self.uses_profile(device, tp):
            rows = self.profile.layer_times(device.type, tp, micro_batch)  # type: ignore[union-attr]
            comp = [f + b + (f if ckpt else 0.0) for f, b, _ in rows]
            upd = [u for _, _, u in rows]
            if any(u is None for u in upd):  # not measured (AMP times forward only): priced as below
                analytic = self._update_s(device, tp)
                upd = [a if u is None else u for u, a in zip(upd, analytic)]
        else:
            comp = self._analytic_compute(device, tp, micro_batch, ckpt)
            upd = self._update_s(device, tp)
            if tp > 1:
                # Megatron: 2 allreduces of the block's output forward, 2 backward, +2 in a recomputed forward
                count = BLOCK_TP_ALLREDUCES * (3 if ckpt else 2)
                for i, layer in enumerate(self.workload.layers):
                    if layer.name.startswith("block") or layer.moe:
                        comp[i] += count * self.network.tp_allreduce_s(self._out[i] * micro_batch, device.node, tp)
                    elif layer.name == "head" and i > 0:
                        # the logits all-gathered forward (half an allreduce), the input's gradient all-reduced
                        comp[i] += (self.network.tp_allreduce_s(self._out[i] * micro_batch, device.node, tp) / 2
                                    + self.network.tp_allreduce_s(self._out[i - 1] * micro_batch, device.node, tp))
        return _prefix(comp), _prefix(upd)

    def _analytic_compute(self, device: DeviceSpec, tp: int, micro_batch: int, ckpt: bool) -> list[float]:
        """Per layer, fwd + bwd (+ a recomputed fwd) seconds of a micro-batch: the roofline, else FLOPs / rate."""
        dtype = self.settings.compute_dtype(device)
        rate = device.flops_per_second(dtype, self.settings.float32_matmul_precision) * tp
        roof = device_roofline(device, dtype, self.settings.float32_matmul_precision) \
            if self.settings.compute_model == "roofline" else None
        comp = []
        for layer in self.workload.layers:
            if roof is not None and layer.shape is not None:
                fwd, bwd = layer_seconds(layer.shape, self.workload.seq_len, micro_batch, tp, DTYPE_BYTES[dtype],
                                         roof, self.calibration)
            else:
                fwd = layer.flops_per_sample * micro_batch / rate
                bwd = 2.0 * fwd
            comp.append(fwd + bwd + (fwd if ckpt else 0.0))
        return comp

    def _update_s(self, device: DeviceSpec, tp: int) -> list[float]:
        """Optimizer-update seconds per layer: Adam is memory bound (read/write the fp32 master, m, v and the
        gradient: 16 bytes per parameter)."""
        bw = device.memory_bandwidth_gbs * 1e9
        return [layer.total_params / tp * 16 / bw for layer in self.workload.layers]

    def replicated_compute_prefix(self, device: DeviceSpec, tp: int, micro_batch: int) -> np.ndarray:
        """Prefix sums over layers of one micro-batch's forward + backward seconds, every expert held locally.

        What a stage costs before any expert placement: ``p[stop] - p[start]``.
        """
        key = (self.device_key(device), tp, micro_batch)
        hit = self._replicated_prefix_cache.get(key)
        if hit is None:
            dense = np.asarray(self._layer_compute_prefix(device, tp, micro_batch)[0])
            tokens = micro_batch * self.workload.seq_len
            experts = _prefix(self.expert_compute_s(device, tp, layer, layer + 1, tokens, None, 0.0)
                              for layer in range(self.workload.num_layers))
            hit = self._replicated_prefix_cache[key] = dense + np.asarray(experts)
        return hit

    def stage_compute_s(self, device: DeviceSpec, tp: int, micro_batch: int, start: int, stop: int) -> float:
        """Forward + backward seconds of layers [start, stop) for one micro-batch (dense part)."""
        comp, _ = self._layer_compute_prefix(device, tp, micro_batch)
        return comp[stop] - comp[start]

    def stage_update_s(self, device: DeviceSpec, tp: int, start: int, stop: int, dp: int) -> float:
        _, upd = self._layer_compute_prefix(device, tp, 1)
        return (upd[stop] - upd[start]) / self.settings.zero_shards(dp).optimizer

    def send_s(self, micro_batch: int, last_layer: int, src: str, dst: str,
               route: SyncRoute | None = None) -> float:
        """Activation forward + gradient backward across a stage boundary between two single devices."""
        return self.stage_send_s(micro_batch, last_layer, (src,), (dst,), route)

    def stage_send_s(self, micro_batch: int, last_layer: int, senders: tuple[str, ...], receivers: tuple[str, ...],
                     route: SyncRoute | None = None) -> float:
        """Activation forward + gradient backward between two stages' tensor-parallel groups, partitioned as
        the runtime sends them (``ds_runtime.stage_exchange``), sharing the nodes' interfaces with the
        concurrent sends ``route.send_flows`` counts.

        One way, groups of ``a`` and ``b`` devices: the tensor in ``n = lcm(a, b)`` chunks, chunk ``c`` from
        sender ``c mod a`` to receiver ``c mod b``, each device's chunks one after another (the slower of the
        busiest sender and the busiest receiver), then an all-gather over the receiving group (half a tp
        allreduce).  Backward: the same, reversed.  With ``a = b = 1``: one send each way.
        """
        flows, size = route.send_flows if route is not None else (1, 1), self._out[last_layer] * micro_batch
        return self._one_way_s(size, senders, receivers, flows) + self._one_way_s(size, receivers, senders, flows)

    def _one_way_s(self, size: float, src: tuple[str, ...], dst: tuple[str, ...], flows: tuple[int, int]) -> float:
        a, b = len(src), len(dst)
        n = math.lcm(a, b)
        chunk = size / n
        send = self.network.send_s
        busiest_sender = max(sum(send(chunk, src[i], dst[c % b], flows) for c in range(i, n, a)) for i in range(a))
        busiest_receiver = max(sum(send(chunk, src[c % a], dst[j], flows) for c in range(j, n, b))
                               for j in range(b))
        gather = self.network.tp_allreduce_s(size, self.cluster.device(dst[0]).node, b) / 2
        return max(busiest_sender, busiest_receiver) + gather

    def stage_param_count(self, start: int, stop: int, experts_held: dict[int, int] | None = None) -> float:
        """Parameters a stage holds: dense part + all experts, or only the experts placed on it."""
        dense = self._params[stop] - self._params[start] - self.workload.tied_within(start, stop)  # tied: held once
        expert = 0.0
        for layer in range(start, stop):
            moe = self.workload.layers[layer].moe
            if moe is None:
                continue
            held = moe.num_experts if experts_held is None or layer not in experts_held else experts_held[layer]
            expert += held * moe.params_per_expert
        return dense + expert

    def stage_memory_bytes(self, start: int, stop: int, tp: int, micro_batch: int, in_flight: int, dp: int,
                           experts_held: dict[int, int] | None = None) -> float:
        """Peak bytes per device of a stage: model state, activations, headroom (``MemoryModel.stage_bytes``; the
        framework's overhead comes on top: ``memory.overhead_bytes``)."""
        return self.memory.stage_bytes(self.stage_param_count(start, stop, experts_held), start, stop, tp,
                                       micro_batch, in_flight, dp)

    def memory_matrix(self, tp: int, micro_batch: int, in_flight: int, dp: int) -> np.ndarray:
        """``stage_memory_bytes`` for every range [i, j) at once (experts all held), as an (L+1)^2 array."""
        return self.memory.matrix(tp, micro_batch, in_flight, dp)

    def post_matrix(self, device: DeviceSpec, tp: int, dp: int, route: SyncRoute) -> np.ndarray:
        """Gradient sync + optimizer update of every range [i, j) on ``device``, as an (L+1)^2 array."""
        P = np.asarray(self._params)
        held = P[None, :] - P[:, None]
        held[0] -= self.workload.tied_prefix  # a stage holding the embedding and a tied head syncs the matrix once
        grad_bytes = held / tp * self.settings.grad_bytes
        sync = self.allreduce_s(grad_bytes, dp, route)
        _, upd = self._layer_compute_prefix(device, tp, 1)
        U = np.asarray(upd) / self.settings.zero_shards(dp).optimizer
        return sync + (U[None, :] - U[:, None])

    def memory_capacity_bytes(self, device: DeviceSpec) -> float:
        return device.memory_bytes

    def memory_budget_bytes(self, device: DeviceSpec, tp: int) -> float:
        """What ``stage_memory_bytes`` may reach on ``device`` at ``tp`` (its memory less the framework's)."""
        return MemoryModel.budget_bytes(device, tp)

    def allreduce_s(self, num_bytes: Any, group_size: int, route: SyncRoute) -> Any:
        """Gradient allreduce of ``num_bytes`` (a number or an array) among ``group_size`` replicas along
        ``route``, plus ZeRO-3's parameter all-gathers (1.5x).

        A ring over the replicas whose route (``ring_bandwidths``) knows which nodes it spans and how many other
        rings cross each node's interface at the same time (``network.Network.ring_allreduce_s``); the
        hierarchical exchange (``core/compressed_sync.py``) where the route crosses nodes and the settings
        compress the inter-node hop.
        """
        if group_size <= 1 or route.members <= 1:
            return np.zeros_like(num_bytes, dtype=float) if isinstance(num_bytes, np.ndarray) else 0.0
        if route.members != group_size:
            route = SyncRoute(group_size, route.nodes, route.flows, route.send_flows)
        factor = 1.5 if self.settings.zero_stage >= 3 else 1.0
        token = self.settings.inter_node_compression
        if route.inter_node and token != "none":
            return factor * self._hierarchical_sync_s(num_bytes, route, token)
        return factor * self.network.ring_allreduce_s(num_bytes, route)

    def _hierarchical_sync_s(self, num_bytes: Any, route: SyncRoute, token: str) -> Any:
        """The inter-node hop compressed: node sums, the leaders' ring in ``token``, broadcasts (compressed_sync)."""
        leaders = SyncRoute(len(route.nodes), route.nodes, route.flows, route.send_flows)
        wire = np.asarray(num_bytes, dtype=float) * wire_fraction(token, self.settings.grad_reduce_dtype)
        local = -(-route.members // len(route.nodes))
        # per message size where the network model is measured (Sailor's fits give one figure per size)
        intra_bw = np.minimum.reduce([np.asarray(self.network.intra_bandwidth(n, local, num_bytes), dtype=float)
                                      for n in route.nodes])
        codec_bw = min(codec_bandwidth(d) for d in self.cluster.devices if d.node in route.nodes)
        return hierarchical_sync_s(num_bytes, route.members, len(route.nodes), intra_bw,
                                   self.network.ring_allreduce_s(wire, leaders), self.network.latency_s, codec_bw,
                                   token)

    def analytic_rates(self, devices: Iterable[DeviceSpec]) -> str:
        """One line for the plan table: the rate the analytic model priced each of ``devices``' types at
        (``DeviceSpec.matmul_rate``: the unit its dtype's matmuls run on, TF32 for fp32 under
        ``float32_matmul_precision`` high or medium), and how: FLOPs at that rate x the type's efficiency
        (``compute_model=flops``, and under the roofline a device it does not describe) or the roofline; ""
        for no device."""
        precision = self.settings.float32_matmul_precision
        by_type: dict[str, str] = {}
        fp32_run = False
        for device in devices:
            if device.type in by_type:
                continue
            dtype = self.settings.compute_dtype(device)
            fp32_run = fp32_run or dtype == "fp32"
            unit, tflops = device.matmul_rate(dtype, precision)
            roofline = self.settings.compute_model == "roofline" and device_roofline(device, dtype, precision)
            how = "" if roofline else f" x {device.efficiency:g} efficiency" + (
                f" x emulated speed {device.emulated_speed:g}" if device.emulated_speed else "") + (
                " (FLOPs: no roofline for it)" if self.settings.compute_model == "roofline" else "")
            by_type[device.type] = f"{device.type} at {unit} {tflops:g} TFLOPS{how}"
        if not by_type:
            return ""
        model = "FLOPs over the datasheet rate" if self.settings.compute_model == "flops" else "the roofline"
        return (f"{model} (compute_model={self.settings.compute_model}"
                + (f", float32_matmul_precision={precision}" if fp32_run else "") + "): "
                + ", ".join(by_type[t] for t in sorted(by_type)))

    # -- MoE ----------------------------------------------------------------------------------
    def _experts_by_device(self, plan: Plan) -> dict[str, dict[int, int]]:
        held: dict[str, dict[int, int]] = {}
        for layer, mapping in plan.experts.items():
            for dev, ids in mapping.items():
                held.setdefault(dev, {})[layer] = len(ids)
        return held

    def expert_compute_s(self, device: DeviceSpec, tp: int, start: int, stop: int, tokens_per_microbatch: float,
                         experts_held: dict[int, int] | None, group_tokens_per_microbatch: float) -> float:
        """Expert FLOPs of one micro-batch step on ``device`` for MoE layers in [start, stop).

        Without a placement each replica holds every expert and runs its own
        tokens (top-k per token).  With a placement, the tokens of the whole
        expert-parallel group are routed uniformly to experts, so a device holding
        n of E experts runs n/E of the group's routed tokens.
        """
        rate = device.flops_per_second(self.settings.compute_dtype(device), self.settings.float32_matmul_precision) * tp
        total = 0.0
        for layer in range(start, stop):
            moe = self.workload.layers[layer].moe
            if moe is None:
                continue
            if experts_held is None or layer not in experts_held:
                tokens = tokens_per_microbatch * moe.top_k
            else:
                tokens = group_tokens_per_microbatch * moe.top_k * experts_held[layer] / moe.num_experts
            total += 3.0 * tokens * moe.flops_per_token_per_expert / rate
        return total

    # -- scoring ------------------------------------------------------------------------------
    def score(self, plan: Plan) -> PlanScore:
        """Predicted step time, throughput and per-device memory of ``plan`` (in the compression it carries, if it
        carries one; else in the settings').

        Step time = max over pipelines of their 1F1B time (``pipeline_cost``) + max over devices of (gradient
        sync + optimizer update), the update memory-bound.
        """
        if plan.shards:  # fully sharded data parallelism (hetero_fsdp): core/fsdp_cost.py prices it
            from het_strategy.core.fsdp_cost import FsdpCost
            return FsdpCost(self).score(plan)
        token = plan.compression.get("inter_node")
        if token is not None and token != self.settings.inter_node_compression:
            return self.with_compression(token).score(plan)
        plan.check_against(self.cluster, self.workload)
        dp = plan.num_pipelines
        experts_by_dev = self._experts_by_device(plan)
        # tokens the expert-parallel group routes per step (MoE placement only): a holder runs its experts' part
        # of them over its own pipeline's micro-batches
        step_tokens = plan.global_batch_size * self.workload.seq_len
        pipeline_times: list[float] = []
        stage_costs: list[list[StageCost]] = []
        memory: dict[str, float] = {}
        capacity: dict[str, float] = {}
        all_routes = self.ring_bandwidths([tuple(st.devices for st in pipe.stages) for pipe in plan.pipelines])
        for pipe, routes in zip(plan.pipelines, all_routes):
            time_s, costs, mem = self.pipeline_cost(pipe, dp, experts_by_dev, step_tokens / pipe.num_micro_batches,
                                                    routes)
            pipeline_times.append(time_s)
            stage_costs.append(costs)
            memory.update(mem)
            capacity.update({d: self.memory_capacity_bytes(self.cluster.device(d)) for d in mem})
        post = self.post_times_s(plan)
        kinds = ((self.cluster.device(st.devices[0]).type, st.tp) for pipe in plan.pipelines for st in pipe.stages)
        analytic = [self.cluster.device(st.devices[0]) for pipe in plan.pipelines for st in pipe.stages
                    if not self.uses_profile(self.cluster.device(st.devices[0]), st.tp)]
        compute = "; ".join(part for part in ("" if self.profile is None else self.profile.coverage(kinds),
                                              self.analytic_rates(analytic)) if part)
        last_device = max(post, key=lambda d: sum(post[d]))
        sync, update = post[last_device]
        step = max(pipeline_times) + sync + update
        return PlanScore(step_time_s=step, samples_per_s=plan.global_batch_size / step,
                         pipeline_times_s=pipeline_times, sync_time_s=sync, update_time_s=update,
                         memory_bytes=memory, memory_capacity_bytes=capacity, stage_costs=stage_costs,
                         grad_dtype=self.settings.grad_reduce_dtype, network=self.network.describe(),
                         compute=compute,
                         device_sync_s={d: t[0] for d, t in post.items()},
                         device_update_s={d: t[1] for d, t in post.items()})

    def pipeline_cost(self, pipe: Pipeline, dp: int, experts_by_dev: dict[str, dict[int, int]] | None = None,
                      group_tokens: float = 0.0, routes: list[SyncRoute] | None = None
                      ) -> tuple[float, list[StageCost], dict[str, float]]:
        """(1F1B time, per-stage costs at the full micro-batch, memory per device) of one pipeline.

        A device's memory is its stage's (``core/memory.py``) with the ``min(S - s, n)`` micro-batches 1F1B keeps
        in flight on stage ``s`` of ``S``, plus the framework's overhead outside the allocator.

        ``routes`` (from ``ring_bandwidths``) tell how many sends share each boundary's interfaces;
        None: every send alone."""
        experts_by_dev = experts_by_dev or {}
        routes = routes or [NO_SYNC] * len(pipe.stages)
        seq = self.workload.seq_len
        n = pipe.num_micro_batches
        last = pipe.samples - (n - 1) * pipe.micro_batch_size
        costs_full: list[StageCost] = []
        costs_last: list[StageCost] = []
        memory: dict[str, float] = {}
        for s, stage in enumerate(pipe.stages):
            start, stop = stage.layers
            nxt = pipe.stages[s + 1] if s + 1 < len(pipe.stages) else None

            def _stage(mb: int, stage: Stage = stage, start: int = start, stop: int = stop,
                       nxt: Stage | None = nxt, route: SyncRoute = routes[s]) -> tuple[float, float]:
                comp = max(self.stage_compute_s(self.cluster.device(d), stage.tp, mb, start, stop)
                           + self.expert_compute_s(self.cluster.device(d), stage.tp, start, stop, mb * seq,
                                                   experts_by_dev.get(d), group_tokens)
                           for d in stage.devices)
                send = 0.0
                if nxt is not None:
                    send = self.stage_send_s(mb, stop - 1, stage.devices, nxt.devices, route)
                return comp, send

            in_flight = min(len(pipe.stages) - s, n)
            for d in stage.devices:
                memory[d] = (self.stage_memory_bytes(start, stop, stage.tp, pipe.micro_batch_size, in_flight, dp,
                                                     experts_by_dev.get(d))
                             + overhead_bytes(self.cluster.device(d), stage.tp))
            comp_full, send_full = _stage(pipe.micro_batch_size)
            comp_last, send_last = _stage(last) if last != pipe.micro_batch_size else (comp_full, send_full)
            costs_full.append(StageCost(comp_full, send_full, max(memory[d] for d in stage.devices)))
            costs_last.append(StageCost(comp_last, send_last, costs_full[-1].memory_bytes))
        return pipeline_time_s(costs_full, costs_last, n), costs_full, memory

    def post_times_s(self, plan: Plan) -> dict[str, tuple[float, float]]:
        """Per device: (gradient sync, optimizer update) seconds after the slowest pipeline.

        Replicas alike (the same boundaries and tp at every stage): each device allreduces the gradients of its
        layers with the replicas of those layers in the other pipelines, over the bandwidth ``ring_bandwidths``
        gives its stage.  Replicas that differ: the holder sets in the runtime's order (``holder_sync_schedule``).
        """
        if self.syncs_by_holder_sets(plan):
            sync = self.holder_sync_schedule(plan).device_s
            return {st_d: (sync.get(st_d, 0.0), self.stage_update_s(self.cluster.device(st_d), stage.tp,
                                                                     *stage.layers, plan.num_pipelines))
                    for pipe in plan.pipelines for stage in pipe.stages for st_d in stage.devices}
        dp = plan.num_pipelines
        rings = self.ring_bandwidths([tuple(st.devices for st in pipe.stages) for pipe in plan.pipelines])
        out: dict[str, tuple[float, float]] = {}
        for pipe, ring in zip(plan.pipelines, rings):
            for stage, bw in zip(pipe.stages, ring):
                start, stop = stage.layers
                for d in stage.devices:
                    out[d] = (self.stage_sync_s(start, stop, stage.tp, dp, bw),
                              self.stage_update_s(self.cluster.device(d), stage.tp, start, stop, dp))
            tied = self.tied_sync_s(pipe)
            for d in (*pipe.stages[0].devices, *pipe.stages[-1].devices) if tied else ():
                out[d] = (out[d][0] + tied, out[d][1])
        return out

    def syncs_by_holder_sets(self, plan: Plan) -> bool:
        """The plan's replicas differ in boundaries or in tp at some stage, so its gradients are reduced per holder
        set (``core/holder_sync.py``), the inter-node hop is not compressed (the holder sets reduce
        uncompressed; a compressed plan keeps the per-stage rings of ``compressed_sync``) and
        ``settings.sync_model`` is ``holder_sets``."""
        if (plan.num_pipelines < 2 or self.settings.inter_node_compression != "none"
                or self.settings.sync_model == SyncModel.stage_rings):
            return False
        first = plan.pipelines[0]
        shape = (first.boundaries(), tuple(st.tp for st in first.stages))
        return any((pipe.boundaries(), tuple(st.tp for st in pipe.stages)) != shape for pipe in plan.pipelines[1:])

    def holder_sync_schedule(self, plan: Plan) -> HolderSchedule:
        """The holder sets' allreduces of ``plan`` in the runtime's order over this cluster's links
        (``core/holder_sync.py``), in ``settings.grad_dtype``, ZeRO-3's parameter all-gathers as 1.5x the bytes."""
        factor = 1.5 if self.settings.zero_stage >= 3 else 1.0
        return schedule(holder_reductions(plan, self.workload, self.settings.grad_bytes * factor), self.network)

    def tied_sync_s(self, pipe: Pipeline) -> float:
        """The tied matrix's gradient allreduce between a pipeline's first and last stage, when it puts the tied
        embedding and head on different stages (each holds a copy, ``ds_runtime.tied_weights``): a ring of two,
        the first and last stage's lead devices, before the data-parallel sync; 0 otherwise."""
        tied = self.workload.layers[-1].tied_params
        if not tied or len(pipe.stages) < 2:
            return 0.0
        a, b = pipe.stages[0].devices[0], pipe.stages[-1].devices[0]
        nodes = tuple(sorted({self.cluster.device(a).node, self.cluster.device(b).node}))
        route = SyncRoute(members=2, nodes=nodes, flows=(1,) * len(nodes))
        return float(self.network.ring_allreduce_s(tied * self.settings.grad_bytes, route))

    def ring_bandwidths(self, structure: list[tuple[tuple[str, ...], ...]]) -> list[list[SyncRoute]]:
        """Per pipeline, per stage: its gradient ring's route and its send's sharing (``network.routes``)."""
        return routes(self.cluster, structure)

    def stage_sync_s(self, start: int, stop: int, tp: int, dp: int, route: SyncRoute) -> float:
        """Gradient allreduce of a stage's dense parameters among ``dp`` replicas: each device its ``1/tp``
        shard, in ``settings.grad_dtype`` (fp32 unless set: mixed precision keeps fp32 gradients).  At tp > 1 the
        replicated parameters count as split too (``LayerCost.tp_replicated_params``, whole on every tp rank, are
        priced as the runtime reduces them only where replicas differ: ``core/holder_sync.py``)."""
        grad_bytes = (self._params[stop] - self._params[start] - self.workload.tied_within(start, stop)) / tp \
            * self.settings.grad_bytes
        return self.allreduce_s(grad_bytes, dp, route)


def pipeline_time_s(costs: list[StageCost], costs_last: list[StageCost], num_micro_batches: int) -> float:
    """1F1B time of one pipeline: fill with the first micro-batch, then one bottleneck per micro-batch.

    Per micro-batch, stage ``s`` costs ``t_s`` (``StageCost.compute_s``: the forward + backward of its layers on
    its slowest device, tp communication and MoE expert work included) and ``c_s`` (``StageCost.send_s``: the
    activation forward + the gradient backward over the link to the next stage).  With ``n`` micro-batches:

        T_p = fill + (n - 1) x bottleneck
        fill = sum_s (t_s + c_s)                                (fill_s: the first micro-batch)
        bottleneck = max_s (c_{s-1} + t_s + c_s), c_{-1} = 0    (bottleneck_s)

    The last micro-batch may be smaller and is costed at its own size (``costs_last``).
    """
    first = costs if num_micro_batches > 1 else costs_last
    fill = fill_s(first)
    if num_micro_batches == 1:
        return fill
    return fill + (num_micro_batches - 2) * bottleneck_s(costs) + bottleneck_s(costs_last)


def fill_s(costs: list[StageCost]) -> float:
    """One micro-batch through every stage and back: all its compute and all its sends."""
    return sum(c.compute_s + c.send_s for c in costs)


def bottleneck_s(costs: list[StageCost]) -> float:
    """The 1F1B steady state's time per micro-batch: the busiest stage's compute plus the sends at both its
    boundaries.

    A send overlaps nothing on either side: the runtime's sends and receives are blocking (DeepSpeed's
    ``PipelineEngine._exec_send_activations`` -> ``p2p.send`` -> ``dist.send``, ``_exec_recv_activations`` ->
    ``p2p.recv``; ``ds_runtime.stage_exchange.send_tensors``/``recv_tensors``: blocking ``send``/``recv`` per
    chunk), so a stage is busy for its compute plus every transfer at its two boundaries, one after another
    (``benchmarks/pipeline_slow_link.py`` measures it on shaped links).
    """
    return max(c.compute_s + c.send_s + (costs[s - 1].send_s if s else 0.0) for s, c in enumerate(costs))


def _prefix(values: Iterable[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out
