"""The price and the memory of a ``hetero_fsdp`` plan: fully sharded data parallelism, shards by memory.

A ``hetero_fsdp`` plan is a data-parallel plan (one single-device stage per rank, ``samples`` = the rank's share
``n_r``, micro-batches of ``m_r``) with ``plan.shards``: the fraction ``f_r`` of every flat parameter rank r keeps
(``core/shard_sizes.py`` cuts unit u's ``P_u`` elements into pieces ``s_{u,r}``); ``W`` ranks, all in every
collective. ``CostModel.score`` of a plan with shards comes here (``FsdpCost.score``).

* **Units** (``fsdp_units``): a root unit first (every layer not named ``block*``: embedding, head, norms; a tied
  head counted once), kept gathered for the whole micro-step; then one unit per block, gathered for its forward,
  again for its backward (the last block stays gathered between the two), its gradient reduce-scattered after.
* **Micro-steps**: every rank runs ``K = max_r ceil(n_r / m_r)`` micro-steps in lockstep (each gathers every unit
  and reduce-scatters every gradient, so every rank runs as many forwards and backwards); a rank with fewer
  micro-batches runs a weight-0 filler sample in each micro-step left (``FILLER_SAMPLES``).
* **Collectives** on padded pieces: ``W`` pieces of the largest ``M_u = max_r s_{u,r}`` over the ring the cost
  model prices all-reduces on: ``AG_u = (W-1)(alpha + M_u b_param / bw)``, ``RS_u`` the same in ``b_grad``.
* **Time** (``FsdpCost.price``): per micro-step, the next unit's gather under this unit's compute, a
  reduce-scatter under the next unit's backward; ``step = sum_j T_micro(j) + max_r f_r update_r``.
* **Memory** (``FsdpCost.memory``): shard + gathered units + activations + framework per rank; the fractions
  ``f_r = free_r / sum free`` (``memory_fractions``): free memory after every term but the shard, so the plan
  fits iff the sharded state is at most the ranks' free memory together; even FSDP is ``f_r = 1 / W``.

A layout that does not fit is refused (``FsdpCost.memory_refusal``) naming ``plan.shards.<device>``, the rank,
its need by part and its memory. Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.memory import GiB, overhead_bytes
from het_strategy.core.network import SyncRoute
from het_strategy.core.plan_score import PlanScore, StageCost
from het_strategy.core.shard_sizes import shard_sizes

if TYPE_CHECKING:
    from het_strategy.core.plan import Plan
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import WorkloadSpec

__all__ = ["FsdpUnit", "RankMemory", "FsdpStep", "fsdp_units", "shard_bytes_per_param", "memory_fractions",
           "even_fractions", "FsdpCost", "micro_step_sizes", "FILLER_SAMPLES"]

FILLER_SAMPLES = 1
"""Samples a rank computes (with loss weight 0) in a micro-step after its last micro-batch: it must take part in
every unit's collectives, which its forward and backward drive."""
ADAM_STATE_BYTES = 8
"""Adam's m and v per parameter, fp32."""
MASTER_BYTES = 4
"""The shard itself: fp32 master values in every training dtype (the runtime gathers it cast to the compute
dtype; ``fsdp.FlatUnit``)."""


@dataclass(frozen=True)
class FsdpUnit:
    """One flat parameter the runtime gathers and reduces as a whole."""

    name: str
    """``root`` or the block layer's name."""
    layers: tuple[int, ...]
    """The workload layers it holds."""
    params: int
    """Elements of its flat parameter."""


@dataclass(frozen=True)
class RankMemory:
    """One rank's peak bytes by part (``FsdpCost.memory``'s ``need_r``)."""

    shard: float
    """Its pieces of every unit x ``shard_bytes_per_param``."""
    gathered: float
    """The root and the two largest blocks gathered, with their gradients."""
    activations: float
    """The memory model's activations at its largest micro-batch."""
    framework: float
    """The framework's memory outside the allocator and ``settings.memory_reserve_gb``."""
    capacity: float
    """The device's memory."""

    @property
    def need(self) -> float:
        return self.shard + self.gathered + self.activations + self.framework

    @property
    def free_for_shard(self) -> float:
        """Capacity less everything but the shard."""
        return self.capacity - self.gathered - self.activations - self.framework

    def fits(self) -> bool:
        return self.need <= self.capacity


@dataclass(frozen=True)
class FsdpStep:
    """The priced step of one fsdp layout (what ``FsdpCost.price`` finds)."""

    step_time_s: float
    micro_steps: int
    """``K``: the lockstep micro-steps."""
    compute_s: list[float]
    """Per rank: forward + backward of its own micro-batches."""
    critical_compute_s: float
    """Sum over micro-steps and phases of the slowest rank's compute."""
    update_s: list[float]
    """Per rank: its shard's optimizer update."""
    full_micro_batch_s: list[float]
    """Per rank: forward + backward of one full micro-batch."""

    @property
    def exposed_comm_s(self) -> float:
        """What the step adds to the slowest rank's own compute and the update: the collectives not hidden under
        compute and the lockstep (each unit waits for its slowest rank); never negative."""
        return max(self.step_time_s - max(self.compute_s) - max(self.update_s), 0.0)


def fsdp_units(workload: "WorkloadSpec") -> list[FsdpUnit]:
    """The root unit (every layer not named ``block*``; a tied head's copy counted once), then one unit per block."""
    root = tuple(i for i, layer in enumerate(workload.layers) if not layer.name.startswith("block"))
    root_params = sum(workload.layers[i].total_params for i in root)
    if 0 in root:
        root_params -= sum(workload.layers[i].tied_params for i in root)
    units = [FsdpUnit("root", root, root_params)]
    units += [FsdpUnit(layer.name, (i,), layer.total_params) for i, layer in enumerate(workload.layers)
              if layer.name.startswith("block")]
    return units


def shard_bytes_per_param(settings: "TrainSettings") -> int:
    """Bytes per parameter of a rank's shard: its fp32 master values (the shard the optimizer steps, in every
    training dtype), their gradient (the reduction dtype) and Adam's m and v: 16 B with fp32 reductions."""
    return MASTER_BYTES + settings.grad_bytes + ADAM_STATE_BYTES


def even_fractions(devices: Sequence[str]) -> dict[str, float]:
    """Even FSDP: every rank ``1 / W``."""
    return {d: 1.0 / len(devices) for d in devices}


def memory_fractions(free: Mapping[str, float]) -> dict[str, float] | None:
    """``f_r = free_r / sum free`` (None when some ``free_r < 0`` or nothing is free).

    ``free_r``: rank r's memory less every term that does not scale with its shard (``FsdpCost.free_for_shards``).
    Each rank then needs ``free_r x S / sum free`` for its shard (``S``: the whole sharded state), so every rank
    fits iff ``S <= sum_r free_r`` (to the rounding of ``shard_sizes``).
    """
    if any(v < 0 for v in free.values()):
        return None
    total = math.fsum(free.values())
    if total <= 0:
        return None
    out = {d: v / total for d, v in free.items()}
    # the last rank takes the rounding, so the fractions sum to 1 to the last bit shard_sizes checks
    last = next(reversed(out))
    out[last] = max(0.0, 1.0 - math.fsum(v for d, v in out.items() if d != last))
    return out


def micro_step_sizes(samples: int, micro_batch: int, micro_steps: int) -> list[int]:
    """Samples a rank computes in each of the ``micro_steps`` lockstep micro-steps: ``micro_batch`` each, the
    remainder last, then a ``FILLER_SAMPLES`` filler in each micro-step left."""
    n = math.ceil(samples / micro_batch)
    sizes = [micro_batch] * (n - 1) + [samples - (n - 1) * micro_batch]
    return sizes + [FILLER_SAMPLES] * (micro_steps - n)


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GiB:.2f} GiB" if abs(num_bytes) >= 0.01 * GiB else f"{num_bytes / 2**20:.2f} MiB"


class FsdpCost:
    """Prices fsdp layouts (shares, micro-batches, fractions) with one cost model's compute, links and memory."""

    def __init__(self, cm: Any) -> None:
        """``cm``: the ``core.cost_model.CostModel`` whose compute, links and memory model price the layouts (not
        imported here: ``CostModel.score`` imports this module)."""
        self.cm = cm
        self.units = fsdp_units(cm.workload)
        self.settings = cm.settings
        self.bytes_per_param = shard_bytes_per_param(cm.settings)
        blocks = sorted((u.params for u in self.units[1:]), reverse=True)
        in_flight = self.units[0].params + sum(blocks[:2])
        self.gathered_bytes = float(in_flight * (cm.settings.param_bytes + cm.settings.grad_bytes))
        """The root unit and the two largest block units, gathered with their gradients (every rank alike)."""
        self._unit_compute: dict[tuple, list[float]] = {}
        first_block = min((u.layers[0] for u in self.units[1:]), default=cm.workload.num_layers)
        self._lead = tuple(i for i in self.units[0].layers if i < first_block)
        self._trail = tuple(i for i in self.units[0].layers if i > first_block)

    # -- memory ----------------------------------------------------------------------------------
    def activation_bytes(self, micro_batch: int) -> float:
        """The memory model's activations of the whole model at ``micro_batch`` (one micro-batch in flight)."""
        if micro_batch <= 0:
            return 0.0
        L = self.cm.workload.num_layers
        return self.cm.memory.stage_bytes(0.0, 0, L, 1, micro_batch, 1, 1) - self.settings.memory_reserve_gb * GiB

    def framework_bytes(self, device: str) -> float:
        return overhead_bytes(self.cm.cluster.device(device), 1) + self.settings.memory_reserve_gb * GiB

    def free_for_shards(self, device: str, micro_batch: int) -> float:
        """Capacity of ``device`` less the gathered units, the activations at ``micro_batch`` and the framework."""
        cap = self.cm.memory_capacity_bytes(self.cm.cluster.device(device))
        return cap - self.gathered_bytes - self.activation_bytes(micro_batch) - self.framework_bytes(device)

    def piece_sizes(self, fractions: Sequence[float]) -> list[list[int]]:
        """Per unit, the per-rank element counts (``shard_sizes``)."""
        return [shard_sizes(u.params, fractions) for u in self.units]

    def rank_memory(self, device: str, micro_batch: int, shard_elements: int) -> RankMemory:
        return RankMemory(shard=float(shard_elements * self.bytes_per_param), gathered=self.gathered_bytes,
                          activations=self.activation_bytes(micro_batch), framework=self.framework_bytes(device),
                          capacity=self.cm.memory_capacity_bytes(self.cm.cluster.device(device)))

    def memory(self, devices: Sequence[str], micro_batches: Sequence[int],
               fractions: Sequence[float]) -> dict[str, RankMemory]:
        """Each rank's need by part; ``micro_batches``: the largest micro-batch each rank runs (at most its share:
        ``FsdpCost.layout``)::

            need_r        = shard_r + gathered + activations_r + framework_r
            shard_r       = sum_u s_{u,r} x shard_bytes_per_param   (fp32 master, its gradient, Adam's m and v)
            gathered      = (P_root + P_b1 + P_b2) x (b_param + b_grad)   (the root and the two largest blocks in
                            flight, in the training dtype, with their gradients in backward)
            activations_r = the memory model's activations of the whole model at m_r (``core/memory.py``)
            framework_r   = ``memory.overhead_bytes`` + ``settings.memory_reserve_gb``

        A rank fits when ``need_r`` is at most its device's memory.
        """
        pieces = self.piece_sizes(fractions)
        return {d: self.rank_memory(d, m, sum(p[r] for p in pieces))
                for r, (d, m) in enumerate(zip(devices, micro_batches))}

    def memory_refusal(self, devices: Sequence[str], micro_batches: Sequence[int],
                       fractions: Sequence[float]) -> ConfigError | None:
        """The ``ConfigError`` for the rank that overshoots its memory most (None when every rank fits)."""
        mem = self.memory(devices, micro_batches, fractions)
        over = [(m.need - m.capacity, r, d) for r, (d, m) in enumerate(mem.items()) if not m.fits()]
        if not over:
            return None
        _, _, r, d = max((o, -r, r, d) for o, r, d in over)  # ties: the lower rank
        m = mem[d]
        return field_error(
            f"plan.shards.{d}", round(fractions[r], 6),
            f"leave room on device {d} (rank {r}): it needs {_size(m.need)} there: shard {_size(m.shard)} + "
            f"gathered units {_size(m.gathered)} + activations {_size(m.activations)} at micro-batch "
            f"{micro_batches[r]} + framework {_size(m.framework)}; it has {_size(m.capacity)} "
            f"({_size(m.free_for_shard)} free for its shard)",
            "shards sized by memory (hetero_fsdp's plan), activation checkpointing "
            "(settings.activation_checkpointing=true), smaller micro-batches or more devices")

    # -- time ------------------------------------------------------------------------------------
    def phase_compute_s(self, device: str, micro_batch: int) -> list[float]:
        """Forward + backward seconds of ``micro_batch`` samples on ``device`` (0 for none) per phase: the root's
        layers before the first block (lead), each block, the root's other layers (trail)."""
        dev = self.cm.cluster.device(device)
        key = (self.cm.device_key(dev), micro_batch)
        hit = self._unit_compute.get(key)
        if hit is None:
            if micro_batch <= 0:
                hit = [0.0] * (len(self.units) + 1)
            else:
                tokens = micro_batch * self.cm.workload.seq_len

                def layers_s(layers: Sequence[int]) -> float:
                    return sum(self.cm.stage_compute_s(dev, 1, micro_batch, i, i + 1)
                               + self.cm.expert_compute_s(dev, 1, i, i + 1, tokens, None, 0.0) for i in layers)
                hit = [layers_s(self._lead)] + [layers_s(u.layers) for u in self.units[1:]] + [layers_s(self._trail)]
            self._unit_compute[key] = hit
        return hit

    def route(self, devices: Sequence[str]) -> SyncRoute:
        """The ring of every rank (the route the cost model gives a data-parallel gradient ring)."""
        return self.cm.ring_bandwidths([((d,),) for d in devices])[0][0]

    def collective_s(self, elements: int, element_bytes: int, route: SyncRoute) -> float:
        """One all-gather (or reduce-scatter) of ``W`` pieces of ``elements``: half a ring all-reduce of them."""
        if route.members <= 1 or elements <= 0:
            return 0.0
        return float(self.cm.network.ring_allreduce_s(float(route.members * elements * element_bytes), route)) / 2

    def price(self, devices: Sequence[str], shares: Sequence[int], micro_batches: Sequence[int],
              fractions: Sequence[float]) -> FsdpStep:
        """The step of one layout (``micro_batches``: the largest micro-batch each rank runs, at most its share).

        Collectives of unit u on padded pieces, one communication stream (``collective_s``)::

            AG_u = (W - 1)(alpha + M_u b_param / bw) = ring_allreduce_s(W M_u b_param) / 2   (all-gather)
            RS_u = (W - 1)(alpha + M_u b_grad / bw)  = ring_allreduce_s(W M_u b_grad) / 2    (reduce-scatter)

        ``b_param``: the training dtype's bytes (units are gathered in it), ``b_grad``: the reduction dtype's
        (``settings.grad_dtype``, fp32 unless set); ``bw``, ``alpha``: the ring's slowest edge and latency
        (``network.Network``). Even shards (``M_u = P_u / W``) make a gather half an all-reduce.

        Compute per phase (``phase_compute_s``: the root's layers before the first block ``lead``, blocks
        u = 1 .. U-1, the root's others ``trail``): the cost model's forward + backward of its layers for ``b``
        samples on rank r's device (``CostModel.stage_compute_s`` + experts); forward ``1/3`` of it (backward =
        2 x forward), ``1/4`` with activation checkpointing (the recomputed forward is in the backward). In
        micro-step j every phase waits for its slowest rank: ``F_u = max_r fwd_{u,r}(b_{r,j})``, ``B_u``
        likewise. As the runtime orders them (``fsdp.ShardedModel``; unit 0 the root, [x]: 0 where x is no
        block)::

            T_micro = AG_0                                        (the root, gathered before the forward)
                    + max(F_lead, AG_1) + sum_{u=1..U-1} max(F_u, AG_{u+1} [u+1 < U]) + F_trail
                    + max(B_trail, AG_{U-1})                      (the last block gathered again, ahead)
                    + sum_{u=U-1..1} max(B_u, AG_{u-1} [u-1 >= 1] + RS_{u+1} [u+1 < U])
                    + max(B_lead, RS_1) + RS_0                    (the root's gradient reduced last)
            step    = sum_j T_micro(j) + max_r f_r update_r

        ``update_r``: the cost model's optimizer update of the whole model on rank r's device (Adam, memory
        bound), of which the rank steps its fraction.
        """
        W = len(devices)
        route = self.route(devices)
        pieces = self.piece_sizes(fractions)
        largest = [max(p) for p in pieces]
        s = self.settings
        ag = [self.collective_s(m, s.param_bytes, route) for m in largest]
        rs = [self.collective_s(m, s.grad_bytes, route) for m in largest]
        fwd_share = 0.25 if s.activation_checkpointing else 1.0 / 3.0
        counts = [math.ceil(n / m) for n, m in zip(shares, micro_batches)]
        K = max(counts)
        steps = [micro_step_sizes(n, m, K) for n, m in zip(shares, micro_batches)]
        U = len(self.units)
        memo: dict[tuple[int, ...], tuple[float, float]] = {}
        total = critical = 0.0

        def ag_(u: int) -> float:  # the gather of block u (none beyond the blocks)
            return ag[u] if 1 <= u < U else 0.0

        def rs_(u: int) -> float:
            return rs[u] if 1 <= u < U else 0.0

        for j in range(K):
            sig = tuple(steps[r][j] for r in range(W))
            if sig not in memo:
                comp = [self.phase_compute_s(d, b) for d, b in zip(devices, sig)]
                slowest = [max(c[p] for c in comp) for p in range(U + 1)]  # phases: lead, blocks 1..U-1, trail
                F = [c * fwd_share for c in slowest]
                Bw = [c * (1 - fwd_share) for c in slowest]
                t = ag[0] + max(F[0], ag_(1)) + sum(max(F[u], ag_(u + 1)) for u in range(1, U)) + F[U]
                t += max(Bw[U], ag_(U - 1))
                t += sum(max(Bw[u], ag_(u - 1) + rs_(u + 1)) for u in range(U - 1, 0, -1))
                t += max(Bw[0], rs_(1)) + rs[0]
                memo[sig] = (t, sum(slowest))
            total += memo[sig][0]
            critical += memo[sig][1]
        L = self.cm.workload.num_layers
        update = [fractions[r] * self.cm.stage_update_s(self.cm.cluster.device(d), 1, 0, L, 1)
                  for r, d in enumerate(devices)]
        compute = [sum(sum(self.phase_compute_s(d, b)) for b in steps[r]) for r, d in enumerate(devices)]
        full = [sum(self.phase_compute_s(d, m)) for d, m in zip(devices, micro_batches)]
        return FsdpStep(total + max(update), K, compute, critical, update, full)

    # -- a plan ----------------------------------------------------------------------------------
    def layout(self, plan: "Plan") -> tuple[list[str], list[int], list[int], list[float]]:
        """(devices, shares, micro-batch sizes, fractions) of an fsdp plan, in its pipelines' order."""
        if not plan.shards or not plan.is_pure_dp:
            raise field_error("plan.shards", dict(plan.shards), "be given for a pure data-parallel plan (an fsdp "
                              "plan: one single-device stage per rank and every rank's fraction)")
        devices = [p.stages[0].devices[0] for p in plan.pipelines]
        return (devices, [p.samples for p in plan.pipelines],
                [min(p.micro_batch_size, p.samples) for p in plan.pipelines],  # a size above the share runs it whole
                [float(plan.shards[d]) for d in devices])

    def check_fits(self, plan: "Plan") -> None:
        """Raise the refusal of ``plan`` when some rank's need exceeds its memory."""
        devices, _, mbs, fractions = self.layout(plan)
        err = self.memory_refusal(devices, mbs, fractions)
        if err is not None:
            raise err

    def score(self, plan: "Plan") -> PlanScore:
        """``CostModel.score`` of an fsdp plan: the step above, per-rank compute as its pipeline time, the exposed
        communication as the sync, memory per rank (``PlanScore.memory_parts`` by part)."""
        plan.check_against(self.cm.cluster, self.cm.workload)
        devices, shares, mbs, fractions = self.layout(plan)
        step = self.price(devices, shares, mbs, fractions)
        mem = self.memory(devices, mbs, fractions)
        worst = max(range(len(devices)), key=lambda r: step.update_s[r])
        cm = self.cm
        return PlanScore(
            step_time_s=step.step_time_s, samples_per_s=plan.global_batch_size / step.step_time_s,
            pipeline_times_s=step.compute_s, sync_time_s=step.exposed_comm_s, update_time_s=step.update_s[worst],
            memory_bytes={d: m.need for d, m in mem.items()},
            memory_capacity_bytes={d: m.capacity for d, m in mem.items()},
            stage_costs=[[StageCost(step.full_micro_batch_s[r], 0.0, mem[d].need)] for r, d in enumerate(devices)],
            grad_dtype=cm.settings.grad_reduce_dtype, network=cm.network.describe(),
            compute="" if cm.profile is None else cm.profile.coverage((cm.cluster.device(d).type, 1)
                                                                      for d in devices),
            device_sync_s={d: step.exposed_comm_s for d in devices},
            device_update_s={d: u for d, u in zip(devices, step.update_s)},
            memory_parts={d: {"shard": m.shard, "gathered": m.gathered, "activations": m.activations,
                              "framework": m.framework} for d, m in mem.items()})

