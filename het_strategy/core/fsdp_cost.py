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
* **Memory** (``FsdpCost.memory``): per rank the largest, over the runtime's phases (``FsdpCost.phases``), of
  shard + gathered units + in-flight collective buffers (pieces padded to ``M_u``) + activations + framework;
  the fractions ``f_r = free_r / sum free`` (``FsdpCost.fractions``), free memory taken after the phases' terms
  that do not scale with the rank's shard (the method docstrings have the phases and the terms); even FSDP is
  ``f_r = 1 / W``.

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
from het_strategy.core.shard_sizes import shard_sizes_of_each

if TYPE_CHECKING:
    from het_strategy.core.plan import Plan
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.core.workload import WorkloadSpec

__all__ = ["FsdpUnit", "RankMemory", "MemoryPhase", "FsdpStep", "fsdp_units", "shard_bytes_per_param",
           "memory_fractions", "even_fractions", "FsdpCost", "micro_step_sizes", "FILLER_SAMPLES", "MASTER_BYTES",
           "ADAM_STATE_BYTES"]

FILLER_SAMPLES = 1
"""Samples a rank computes (with loss weight 0) in a micro-step after its last micro-batch: it must take part in
every unit's collectives, which its forward and backward drive."""
ADAM_STATE_BYTES = 8
"""Adam's m and v per parameter, fp32."""
MASTER_BYTES = 4
"""The shard itself and its gradient: fp32 master values in every training dtype (the runtime gathers it cast to
the compute dtype and adds each reduced piece to ``shard.grad`` in the master dtype; ``fsdp.FlatUnit``)."""
FRACTION_ROUNDS = 50
"""At most this many rounds of ``FsdpCost.fractions`` (fractions -> largest pieces -> collective buffers ->
fractions) before it takes the last."""


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
    """One rank's peak bytes by part, at its peak phase (``FsdpCost.memory``'s ``need_r``)."""

    shard: float
    """Its pieces of every unit: fp32 values and Adam's m and v (12 B an element), and the fp32 gradient of every
    unit reduced by then (``M_u`` elements, the reduce-scatter's padded receive buffer, where
    ``FsdpCost.grad_in_padded_piece``; else its piece)."""
    gathered: float
    """The gathered units, their whole gradients and the root's gradient held by autograd (``MemoryPhase``)."""
    collectives: float
    """The padded buffers of the collectives in flight."""
    activations: float
    """The memory model's saved activations still held, at the phase's micro-batch."""
    framework: float
    """The framework's memory outside the allocator and ``settings.memory_reserve_gb``."""
    capacity: float
    """The device's memory."""
    phase: str = ""
    """The phase of the peak (``MemoryPhase.name``; ``later micro-step`` appended where it is in one)."""

    @property
    def need(self) -> float:
        return self.shard + self.gathered + self.collectives + self.activations + self.framework

    @property
    def free_for_shard(self) -> float:
        """Capacity less everything but the shard, at the peak phase."""
        return self.capacity - self.gathered - self.collectives - self.activations - self.framework

    def fits(self) -> bool:
        return self.need <= self.capacity


@dataclass(frozen=True)
class MemoryPhase:
    """One point of a micro-step where a rank's held bytes peak (``FsdpCost.phases``): what it holds then besides
    its shard's values, their gradient and Adam's state. Alike on every rank but for the activations' micro-batch."""

    name: str
    gathered: float
    """Gathered units, whole-unit gradients, and the root's gradient from the layers after the blocks (held by
    autograd from their backward until the root's whole gradient is joined)."""
    collectives: float
    """Padded buffers of the collectives in flight."""
    layers: int
    """The saved activations of layers ``[0, layers)``."""
    reduced: int
    """Units whose shard gradient exists in a step's first micro-step: the first ``reduced`` of the backward's
    reduction order (the blocks last to first, then the root)."""


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
    """Bytes per parameter of a rank's whole shard state: its fp32 master values (the shard the optimizer steps, in
    every training dtype), their gradient (the master dtype, whatever the reduction's: ``FlatUnit.finish_reduce``)
    and Adam's m and v: 16 B (with fp32 reductions the gradient's storage is the largest rank's piece:
    ``FsdpCost.grad_in_padded_piece``)."""
    return 2 * MASTER_BYTES + ADAM_STATE_BYTES


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
        self._unit_compute: dict[tuple, list[float]] = {}
        first_block = min((u.layers[0] for u in self.units[1:]), default=cm.workload.num_layers)
        self._lead = tuple(i for i in self.units[0].layers if i < first_block)
        self._trail = tuple(i for i in self.units[0].layers if i > first_block)
        self._phases: dict[tuple[int, ...], list[MemoryPhase]] = {}
        self._act: dict[tuple[int, int], float] = {}
        self._non_shard: dict[tuple, float] = {}
        self._peaks: dict[tuple, tuple[MemoryPhase, int, int, str]] = {}

    # -- memory ----------------------------------------------------------------------------------
    def activation_bytes(self, micro_batch: int, layers: int | None = None) -> float:
        """The memory model's saved activations of layers ``[0, layers)`` (default: the whole model) at
        ``micro_batch`` (one micro-batch in flight)."""
        L = self.cm.workload.num_layers if layers is None else layers
        if micro_batch <= 0 or L <= 0:
            return 0.0
        key = (micro_batch, L)
        hit = self._act.get(key)
        if hit is None:
            hit = self._act[key] = (self.cm.memory.stage_bytes(0.0, 0, L, 1, micro_batch, 1, 1)
                                    - self.settings.memory_reserve_gb * GiB)
        return hit

    def framework_bytes(self, device: str) -> float:
        return overhead_bytes(self.cm.cluster.device(device), 1) + self.settings.memory_reserve_gb * GiB

    def piece_sizes(self, fractions: Sequence[float]) -> list[list[int]]:
        """Per unit, the per-rank element counts (``shard_sizes``)."""
        return shard_sizes_of_each([u.params for u in self.units], fractions)

    def even_largest(self, world: int) -> list[int]:
        """Per unit, the largest piece of the even layout (``ceil(P_u / W)``): the least any layout's largest piece
        can be."""
        return [-(-u.params // world) for u in self.units]

    def phases(self, largest: Sequence[int], world: int) -> list[MemoryPhase]:
        """The phases of one micro-step (``fsdp.ShardedModel``'s order) for a layout of ``W = world`` ranks whose unit
        u has largest piece ``M_u = largest[u]``::

            G_u  = P_u b_param                        unit u gathered (its whole gradient: the same again)
            AG_u = (W + 1) M_u b_param                a gather in flight: this rank's piece padded to M_u and the
                                                      W padded pieces it receives (0 where every piece is M_u: the
                                                      gather writes into the unit); the cast shard it sends is
                                                      not priced (the shard itself in fp32)
            RS_u = (W + 1) M_u b_red                  a reduce-scatter in flight: the W padded pieces it sends and
                                                      the piece it receives (b_red: the wider of the reduction's
                                                      and the compute dtype's bytes, ``FlatUnit.reduce_dtype``)
            T    = P_trail b_param                    the gradients of the root's layers after the blocks, held by
                                                      autograd from their backward until the root's is joined

        Blocks ``u = 1 .. U-1`` (layer ``l_u``), unit 0 the root (gathered through the micro-step); ``A[0, n)``
        the saved activations of layers ``[0, n)``; ``red``: shard gradients present (the first of the reduction
        order U-1, .., 1, 0)::

            forward u      G_0 + G_u + G_{u+1} + AG_{u+1}                    A[0, l_u + 1)   (u+1's gather ahead)
            loss           G_0 + G_{U-1} + AG_{U-1}                          A[0, L)         (the backward's first)
            backward u     G_0 + T + G_u + G_{u-1} + AG_{u-1} + RS_{u+1}     A[0, l_u + 1)   red U-u-2
            gradient u     the same + G_u (its whole gradient)               A[0, l_u)       red U-u-2
            root gradient  G_0 + G_0 + RS_1                                  none            red U-2
            root reduced   RS_0                                              none            red U-1
            update         nothing                                           none            red U

        ([x]: a term of a unit that is not a block is 0; a block before the first one's backward is the root.)
        Not priced: temporaries inside one operation (a synchronous collective's buffers; the join of a unit's
        per-view gradients into its whole gradient, ``G_u`` for the moment of the copy), autograd's activation
        gradients between nodes, the allocator's rounding."""
        key = (*largest, world)
        hit = self._phases.get(key)
        if hit is not None:
            return hit
        s, units = self.settings, self.units
        U, W = len(units), world
        bp, bg = s.param_bytes, max(s.grad_bytes, s.param_bytes)
        G = [float(u.params * bp) for u in units]
        AG = [0.0 if m * W == u.params else float((W + 1) * m * bp) for u, m in zip(units, largest)]
        RS = [float((W + 1) * m * bg) for m in largest]
        T = float(sum(self.cm.workload.layers[i].total_params for i in self._trail) * bp)
        L = self.cm.workload.num_layers

        def blk(x: list[float], u: int) -> float:
            return x[u] if 1 <= u < U else 0.0

        out = [MemoryPhase("forward root", G[0] + blk(G, 1), blk(AG, 1), len(self._lead), 0)]
        for u in range(1, U):
            layer = units[u].layers[0]
            out.append(MemoryPhase(f"forward {units[u].name}", G[0] + G[u] + blk(G, u + 1), blk(AG, u + 1),
                                   layer + 1, 0))
        out.append(MemoryPhase("loss", G[0] + blk(G, U - 1), blk(AG, U - 1), L, 0))
        for u in range(U - 1, 0, -1):
            layer, red = units[u].layers[0], max(U - u - 2, 0)
            held = G[0] + T + G[u] + blk(G, u - 1)
            flight = blk(AG, u - 1) + blk(RS, u + 1)
            out.append(MemoryPhase(f"backward {units[u].name}", held, flight, layer + 1, red))
            out.append(MemoryPhase(f"gradient {units[u].name}", held + G[u], flight, layer, red))
        out.append(MemoryPhase("root gradient", 2 * G[0], blk(RS, 1), 0, max(U - 2, 0)))
        out.append(MemoryPhase("root reduced", 0.0, RS[0], 0, U - 1))
        out.append(MemoryPhase("update", 0.0, 0.0, 0, U))
        self._phases[key] = out
        return out

    def largest_pieces(self, fractions: Sequence[float]) -> list[int]:
        """Per unit, the largest rank's piece ``M_u`` (what every collective pads to)."""
        return [max(p) for p in self.piece_sizes(fractions)]

    def _cases(self, micro_sizes: Sequence[int], largest: Sequence[int],
               world: int) -> list[tuple[MemoryPhase, int, int, str]]:
        """(phase, samples, shard gradients present, where) over a rank's micro-steps (``micro_sizes``): every phase
        of the first with the gradients its reductions have landed, and, after it, every phase with them all."""
        phases = self.phases(largest, world)
        out = [(p, micro_sizes[0], p.reduced, "") for p in phases]
        if len(micro_sizes) > 1:
            out += [(p, max(micro_sizes[1:]), len(self.units), ", later micro-step") for p in phases]
        return out

    @property
    def grad_in_padded_piece(self) -> bool:
        """A shard's gradient is its reduce-scatter's receive buffer, ``M_u`` elements on every rank
        (``FlatUnit.finish_reduce`` keeps the view of it when the reduction dtype is the master dtype: fp32
        reductions, or an fp32 compute dtype), rather than a piece of its own ``s_{u,r}`` elements."""
        return max(self.settings.grad_bytes, self.settings.param_bytes) == MASTER_BYTES

    def _reduced_bytes(self, held: Sequence[int]) -> list[float]:
        """Shard gradient bytes after the first n reductions (blocks last to first, then the root), for n = 0 .. U,
        of gradients of ``held[u]`` elements."""
        order = list(range(len(self.units) - 1, 0, -1)) + [0]
        out = [0.0]
        for u in order:
            out.append(out[-1] + held[u] * MASTER_BYTES)
        return out

    def non_shard_bytes(self, micro_batch: int, largest: Sequence[int] | None = None, world: int | None = None,
                        micro_sizes: Sequence[int] | None = None) -> float:
        """The largest over the phases of a rank's micro-steps (``micro_sizes``, default one of ``micro_batch``) of
        gathered + collectives + activations, and the shard gradients where they are padded pieces
        (``grad_in_padded_piece``: they do not scale with the rank's shard); ``largest``: the layout's largest
        pieces, default ``even_largest``; ``world`` default: every device of the cluster."""
        world = len(self.cm.cluster.devices) if world is None else world
        largest = self.even_largest(world) if largest is None else largest
        key = (tuple(micro_sizes or [micro_batch]), tuple(largest), world)  # the same on every rank of a layout
        hit = self._non_shard.get(key)
        if hit is None:
            grads = self._reduced_bytes(largest) if self.grad_in_padded_piece else [0.0] * (len(self.units) + 1)
            hit = self._non_shard[key] = max(p.gathered + p.collectives + self.activation_bytes(b, p.layers)
                                             + grads[red] for p, b, red, _ in self._cases(list(key[0]), largest, world))
        return hit

    def free_for_shards(self, device: str, micro_batch: int, largest: Sequence[int] | None = None,
                        world: int | None = None, micro_sizes: Sequence[int] | None = None) -> float:
        """``free_r``: the capacity of ``device`` less the framework and ``non_shard_bytes`` (``largest`` default:
        the even layout's, the least any layout has, and one micro-step: a negative value means no layout leaves
        room at ``micro_batch``)."""
        cap = self.cm.memory_capacity_bytes(self.cm.cluster.device(device))
        return cap - self.non_shard_bytes(micro_batch, largest, world, micro_sizes) - self.framework_bytes(device)

    def shard_element_bytes(self) -> int:
        """Bytes an element of a rank's shard adds at every phase for the rule of the fractions: its fp32 value and
        Adam's m and v, and its gradient where that is a piece of its own (not ``grad_in_padded_piece``; at most
        4 B, counted whole)."""
        return MASTER_BYTES + ADAM_STATE_BYTES + (0 if self.grad_in_padded_piece else MASTER_BYTES)

    def fractions(self, devices: Sequence[str], micro_batches: Sequence[int],
                  shares: Sequence[int] | None = None) -> dict[str, float] | None:
        """The fractions by memory: ``f_r = free_r / sum free`` (``memory_fractions``; a rank with none free gets
        0), ``free_r`` at the rank's largest micro-batch ``m_r``: in one micro-step where every share is one
        micro-batch (``shares``), else in a first micro-step and a later one too (every shard gradient there: the
        most any later micro-step holds); the collective buffers and padded gradients priced from the fractions' own
        largest pieces: from the even layout's, each round's fractions give the next round's pieces, until the
        pieces repeat (at most ``FRACTION_ROUNDS``). A rank needs at most ``shard_element_bytes x its elements +
        (capacity - free_r)`` at every phase, so with the pieces repeated every rank fits when the sharded state at
        ``shard_element_bytes`` is at most ``sum free`` (to the rounding of ``shard_sizes``). None when nothing is
        free."""
        one = shares is not None and all(n <= m for n, m in zip(shares, micro_batches))
        largest = self.even_largest(len(devices))
        out = None
        for _ in range(FRACTION_ROUNDS):
            out = memory_fractions({d: max(self.free_for_shards(d, m, largest, len(devices), [m] if one else [m, m]),
                                            0.0) for d, m in zip(devices, micro_batches)})
            if out is None:
                return None
            pieces = self.largest_pieces([out[d] for d in devices])
            if pieces == largest:
                break
            largest = pieces
        return out

    def rank_memory(self, device: str, micro_sizes: Sequence[int], pieces: Sequence[int],
                    largest: Sequence[int], world: int) -> RankMemory:
        """One rank's peak over every phase of each of its micro-steps (``micro_sizes``: the samples of each; the
        shard's gradient exists whole from the second), its pieces ``pieces`` per unit."""
        grads = self._reduced_bytes(largest if self.grad_in_padded_piece else pieces)
        state = float(sum(pieces) * (MASTER_BYTES + ADAM_STATE_BYTES))
        framework = self.framework_bytes(device)
        cap = self.cm.memory_capacity_bytes(self.cm.cluster.device(device))
        key = (tuple(micro_sizes), tuple(largest), world)
        peak = self._peaks.get(key) if self.grad_in_padded_piece else None
        if peak is None:  # the peak phase; with padded gradients the same on every rank of the layout
            peak = max(self._cases(micro_sizes, largest, world),
                       key=lambda c: grads[c[2]] + c[0].gathered + c[0].collectives
                       + self.activation_bytes(c[1], c[0].layers))
            if self.grad_in_padded_piece:
                self._peaks[key] = peak
        p, b, red, where = peak
        return RankMemory(shard=state + grads[red], gathered=p.gathered, collectives=p.collectives,
                          activations=self.activation_bytes(b, p.layers), framework=framework, capacity=cap,
                          phase=p.name + where)

    def memory(self, devices: Sequence[str], micro_batches: Sequence[int], fractions: Sequence[float],
               shares: Sequence[int] | None = None) -> dict[str, RankMemory]:
        """Each rank's need by part at its peak phase; ``micro_batches``: the largest micro-batch each rank runs (at
        most its share: ``FsdpCost.layout``), ``shares`` (default: ``micro_batches``, one micro-batch each) its
        samples, cut by ``micro_step_sizes`` into the lockstep micro-steps::

            need_r   = max over its micro-steps j and the phases p (``phases``) of
                       shard_r(p, j) + gathered(p) + collectives(p) + A_r(p, b_{r,j}) + framework_r
            shard_r  = sum_u s_{u,r} x (4 + 8)      fp32 values, Adam's m and v
                       + sum_{u reduced by p} g_u x 4 in the first micro-step (Lightning's zero_grad leaves no
                         gradient: each lands as its unit's reduce-scatter ends), sum_u g_u x 4 in a later one;
                         g_u = M_u where the gradient is the reduce-scatter's padded receive buffer
                         (``grad_in_padded_piece``: fp32 reductions), else s_{u,r}
            A_r      = the memory model's activations of the layers p still holds (``core/memory.py``) at the
                       micro-step's samples b_{r,j}
            framework_r = ``memory.overhead_bytes`` + ``settings.memory_reserve_gb``

        with the collective buffers priced from this layout's largest piece per unit. A rank fits when ``need_r``
        is at most its device's memory.
        """
        pieces = self.piece_sizes(fractions)
        largest = [max(p) for p in pieces]
        shares = list(micro_batches) if shares is None else list(shares)
        K = max(math.ceil(n / m) for n, m in zip(shares, micro_batches))
        return {d: self.rank_memory(d, micro_step_sizes(n, m, K), [p[r] for p in pieces], largest, len(devices))
                for r, (d, n, m) in enumerate(zip(devices, shares, micro_batches))}

    def memory_refusal(self, devices: Sequence[str], micro_batches: Sequence[int], fractions: Sequence[float],
                       shares: Sequence[int] | None = None) -> ConfigError | None:
        """The ``ConfigError`` for the rank that overshoots its memory most (None when every rank fits)."""
        mem = self.memory(devices, micro_batches, fractions, shares)
        over = [(m.need - m.capacity, r, d) for r, (d, m) in enumerate(mem.items()) if not m.fits()]
        if not over:
            return None
        _, _, r, d = max((o, -r, r, d) for o, r, d in over)  # ties: the lower rank
        m = mem[d]
        return field_error(
            f"plan.shards.{d}", round(fractions[r], 6),
            f"leave room on device {d} (rank {r}): it needs {_size(m.need)} there at its peak ({m.phase}): shard "
            f"{_size(m.shard)} + gathered units {_size(m.gathered)} + in-flight collectives "
            f"{_size(m.collectives)} + activations {_size(m.activations)} at micro-batch {micro_batches[r]} + "
            f"framework {_size(m.framework)}; it has {_size(m.capacity)} ({_size(m.free_for_shard)} free for its "
            "shard)",
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
        devices, shares, mbs, fractions = self.layout(plan)
        err = self.memory_refusal(devices, mbs, fractions, shares)
        if err is not None:
            raise err

    def score(self, plan: "Plan") -> PlanScore:
        """``CostModel.score`` of an fsdp plan: the step above, per-rank compute as its pipeline time, the exposed
        communication as the sync, memory per rank (``PlanScore.memory_parts`` by part)."""
        plan.check_against(self.cm.cluster, self.cm.workload)
        devices, shares, mbs, fractions = self.layout(plan)
        step = self.price(devices, shares, mbs, fractions)
        mem = self.memory(devices, mbs, fractions, shares)
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
            memory_parts={d: {"shard": m.shard, "gathered": m.gathered, "collectives": m.collectives,
                              "activations": m.activations, "framework": m.framework} for d, m in mem.items()})

