"""Sailor's runtime simulator, re-implemented to score our ``Plan`` objects.

Source read: ``sailor/Planner/simulations/runtime_simulator.py`` (``Simulator.simulate_iteration_time``)
in the Sailor fork ``saha18uiuc/sailor`` at commit fb8d0e81972909aef932f3e9b1533f2adcc68ca6 (also
13b79423; the charged terms are the same in ``taoyanda/sailor`` 95d07eef), with its helpers
``sailor/profiling/profile_utils.py`` (all-reduce and send times), ``sailor/providers/gcp/model_networking.py``
(evaluating a fit) and ``sailor/Planner/sailor_planner/constants.py`` (the 5e8 bucket).  Sailor is MIT
licensed (SOSP'25, ETH Zurich); this is our own code computing the same numbers from the vendored data.

``sailor_iteration_time`` charges what the simulator charges for one optimizer step (its six rules:
``SailorEstimate``): per stage the slowest replica's compute from Sailor's measured layer profiles, one
optimizer update, the pipeline sends at the inter-node fits, Sailor's pipeline formula, and a gradient sync
overlapped with nothing.
``sailor_send_time_s`` and ``sailor_allreduce_time_s`` are its transfer times: a send of x bytes takes
``x / 1e9 / bw`` seconds, ``bw`` the fit's GB/s (a polynomial in log2 MB), no cap at the fit's peak and no
latency; the intra-node fits are loaded by the simulator but never used.  ``BackwardSend`` picks the size of
the backward send: Sailor's own rule (the default, which reproduces its published figures) or its slip
corrected; ``MicroBatches`` the micro-batches charged: Sailor's rule (the default) or the plan's own.

Translation: our pipelines with the same stage boundaries become one Sailor pipeline whose stage ``s``
has our pipelines' ``s``-th stages as its replicas, in plan order; a stage's devices must be one GPU type
on one node (Sailor's simulator gives a multi-node tensor-parallel group a different, compute-free
formula, which is not reproduced).  Where Sailor would read a missing table entry as 0 s or fail with a
``KeyError``, this module raises ``ConfigError`` naming the plan field.  Pure Python: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from het_strategy.core.catalog import lookup_device_type
from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.network import ring_steps
from het_strategy.core.plan import Plan
from het_strategy.reference.sailor_profiles import DEFAULT_ZONE, read_sailor_json

__all__ = ["SAILOR_BUCKET_BYTES", "BackwardSend", "MicroBatches", "SailorStageEstimate", "SailorPipelineEstimate", "SailorEstimate",
           "sailor_iteration_time", "sailor_send_time_s", "sailor_allreduce_time_s"]

SAILOR_BUCKET_BYTES = 500_000_000
"""Gradient bucket of Sailor's simulator (DeepSpeed's 5e8 all-reduce bucket, applied to bytes)."""

_TP_DIVISOR_CAP = 4
"""The simulator divides a stage's gradient bytes by at most 4 (its largest node size)."""


class BackwardSend(StrEnum):
    """The size a stage's backward send (the gradient to the previous stage) is charged at
    (``SailorEstimate``, rule 3).

    Sailor's own rule charges the output size of the stage's *own first* layer.  This is a slip: the gradient a
    stage sends back is the gradient of its input, so its size is the stage's input, not its first layer's
    output.  The two agree where the first layer keeps the hidden size (a block), and differ at the output
    head, whose output is the logits: for OPT-350 a stage starting at the head is charged 412 MB per sample of
    the micro-batch (103,022,593 floats) instead of the 8.4 MB hidden state (2,097,152 floats).  The
    correction changes only plans with a stage that starts at a layer whose output size differs from its
    input's (for OPT-350, the head), and there it lowers the charge: on every inter-node fit Sailor measured,
    a hidden-state send at mbs 1 to 8 takes less time than a logits send.
    """

    first_layer_output = "first_layer_output"
    """Sailor's own rule: the output size of the stage's first layer (logits-sized for a stage at the head)."""
    stage_input = "stage_input"
    """The slip corrected: the stage's input size (the output of the previous stage's last layer)."""


class MicroBatches(StrEnum):
    """How many micro-batches of which size each pipeline is charged (``SailorEstimate``, rule 4)."""

    sailor = "sailor"
    """Sailor's rule: one micro-batch size for the plan, ``m = ceil(global batch / (mbs x dp x pipelines))``
    for every pipeline (the plan's own counts unused; several sizes refused)."""
    plan = "plan"
    """Each Sailor pipeline at its plan pipelines' own micro-batch size and largest micro-batch count, pipelines of
    one boundary set but different sizes being separate Sailor pipelines (not in Sailor's simulator: for plans
    with several sizes or uneven shares, which Sailor's runtime does not run)."""


@dataclass(frozen=True)
class SailorStageEstimate:
    """One stage of a Sailor pipeline, per micro-batch except ``sync_s``."""

    layers: tuple[int, int]
    """Layer range ``[start, stop)``."""
    replicas: tuple[str, ...]
    """Each replica as ``<Sailor GPU>xtp``, in plan order."""
    compute_s: float
    """Forward + backward of the slowest replica."""
    send_s: float
    """Pipeline sends charged to the stage (``SailorEstimate``, rule 3)."""
    update_s: float
    """Optimizer update of the slowest replica (first layer's figure)."""
    sync_s: float
    """Gradient all-reduce across the stage's replicas, slowest neighbour pair."""


@dataclass(frozen=True)
class SailorPipelineEstimate:
    """One Sailor pipeline: our pipelines sharing a set of stage boundaries."""

    plan_pipelines: tuple[int, ...]
    """Indices of our plan's pipelines that are its replicas."""
    stages: tuple[SailorStageEstimate, ...]
    """Its stages in order."""
    bottleneck_stage: int
    """Index of the stage with the largest compute + sends."""
    bottleneck_s: float
    """That stage's compute + sends: the steady-state time per micro-batch."""
    fill_s: float
    """Sum over stages of compute + sends (one micro-batch through the pipeline)."""
    update_s: float
    """Largest stage update."""
    pipeline_s: float
    """(m - 1) x bottleneck + fill + update."""
    sync_s: float
    """Largest stage sync of this pipeline."""


@dataclass(frozen=True)
class SailorEstimate:
    """Sailor's simulated iteration time of a plan and its terms.

    What the simulator charges for one optimizer step (its validation runs it with ``fp16=False``, so every
    parameter, gradient and activation counts 4 bytes):

    1. **Compute per stage**: for each replica of the stage, the sum over its layers of forward + backward
       seconds from ``layer_profiles.json[model][gpu][mbs][tp]``; the stage is charged its slowest replica.
    2. **Optimizer update**: per stage, the slowest replica's update time of the stage's *first* layer only;
       the pipeline is charged the largest of those, once.
    3. **Pipeline sends**, per micro-batch, with the *inter-node* fit between the two replicas (GPU count on
       each side = its tp), whether or not they share a node.  Forward: the output of the stage's last layer
       (``act_output_floats`` at tp 1, x 4 bytes x mbs) to the same-index replica of the next stage;
       backward: to the previous stage, at a size set by ``backward_send``: the output size of the stage's
       own first layer (``first_layer_output``) or the stage's input size, the output of the previous
       stage's last layer (``stage_input``).  Each is the slowest replica's.  A stage is charged: forward +
       backward in the middle; twice the backward at the last stage; the forward at the first stage (twice
       it when there are more than 3 stages).
    4. **Pipeline time** = (m - 1) x max over stages of (compute + sends) + sum of sends + sum of compute
       + update, m = ceil(global batch / (mbs x dp x number of pipelines)).
    5. **Gradient sync**, not overlapped with anything: per stage, the parameter bytes of its layers divided
       by min(4, smallest tp among its replicas), all-reduced over its dp replicas in buckets of 5e8 bytes,
       each bucket costing 2 (dp - 1) x send time of bucket/dp.  The fit is the inter-node one between
       replicas j and j+1 taken as single GPUs (``[zone][gpu_j]["1"][zone][gpu_j+1]["1"]``), and the stage
       pays the slowest such neighbour pair.  A plan's sync is the largest stage figure over all pipelines,
       plus, when there are several pipelines, an all-reduce of the full (undivided) stage bytes across the
       pipelines, over the stages of the longest pipeline, each of its replicas with its own type's fit.
    6. **Iteration** = slowest pipeline time + sync.
    """

    iteration_s: float
    """pipeline_s + sync_s."""
    pipeline_s: float
    """The slowest pipeline's time (includes its update)."""
    slowest_pipeline: int
    """Index into ``pipelines`` of that pipeline."""
    bottleneck_s: float
    """The slowest pipeline's steady-state time per micro-batch."""
    update_s: float
    """The slowest pipeline's update term."""
    sync_s: float
    """sync_within_s + sync_across_s (not overlapped)."""
    sync_within_s: float
    """Largest stage all-reduce inside any pipeline."""
    sync_across_s: float
    """All-reduce across pipelines (0 with one pipeline)."""
    num_micro_batches: int
    """m, Sailor's rule: ceil(global batch / (mbs x dp x pipelines)) (``MicroBatches.plan``: the slowest
    pipeline's)."""
    micro_batch_size: int
    """mbs of every pipeline (``MicroBatches.plan``: the slowest pipeline's)."""
    pipelines: tuple[SailorPipelineEstimate, ...]
    """Per Sailor pipeline."""

    @property
    def iterations_per_s(self) -> float:
        return 1.0 / self.iteration_s


# -- Sailor's data ----------------------------------------------------------------------------


def _fit_gbs(coeffs: list[float], message_bytes: float) -> float:
    m = math.log2(message_bytes / 1e6)
    n = len(coeffs)
    return sum(c * m ** (n - 1 - i) for i, c in enumerate(coeffs))


def sailor_send_time_s(message_bytes: float, coeffs: list[float]) -> float:
    """Seconds to send ``message_bytes`` at the fit ``coeffs`` (GB/s polynomial in log2 MB), as Sailor:
    ``x / 1e9 / bw`` with ``bw = sum(c[i] * log2(x / 1e6) ** (n-1-i))`` GB/s.

    No peak cap and no latency term.  A fit that gives <= 0 GB/s at that size (Sailor would return a
    negative or infinite time) raises ConfigError.
    """
    if message_bytes == 0:
        return 0.0
    gbs = _fit_gbs(coeffs, message_bytes)
    if not gbs > 0:
        raise field_error("message_bytes", message_bytes,
                          f"be in the fit's range (it gives {gbs:.3g} GB/s there, so Sailor's time is meaningless)")
    return message_bytes / 1e9 / gbs


def sailor_allreduce_time_s(total_bytes: float, num_workers: int, coeffs: list[float]) -> float:
    """Ring all-reduce of ``total_bytes`` over ``num_workers`` in 5e8-byte buckets, as Sailor's simulator.

    Each bucket b costs ``2 (D - 1) x send(b / D)``; nothing with one worker.
    """
    if num_workers <= 1 or total_bytes <= 0:
        return 0.0
    total, remaining = 0.0, float(total_bytes)
    while remaining > 0:
        bucket = min(remaining, SAILOR_BUCKET_BYTES)
        total += ring_steps(num_workers) * sailor_send_time_s(bucket / num_workers, coeffs)
        remaining -= bucket
    return total


@dataclass(frozen=True)
class _Replica:
    """One tensor-parallel group as Sailor's simulator sees it."""

    gpu: str
    tp: int
    where: str


class _Tables:
    """Lookups into the vendored files for one model, zone and float size."""

    def __init__(self, model: str, zone: str, float_bytes: int) -> None:
        profiles, memory = read_sailor_json("layer_profiles.json"), read_sailor_json("layer_memory.json")
        if model not in profiles or model not in memory:
            raise field_error("model", model, "be a model Sailor profiled",
                              f"profiled: {', '.join(sorted(set(profiles) & set(memory)))}")
        inter = read_sailor_json("inter_node_bandwidth_fits.json")
        if zone not in inter:
            raise field_error("zone", zone, "be a zone Sailor measured", f"measured: {', '.join(sorted(inter))}")
        self.model, self.zone, self.profile, self.fits = model, zone, profiles[model], inter[zone]
        tp1 = memory[model]["1"]
        self.num_layers = len(tp1)
        self.act_bytes = [tp1[str(i)]["act_output_floats"] * float_bytes for i in range(self.num_layers)]
        self.param_bytes = [tp1[str(i)]["params_floats"] * float_bytes for i in range(self.num_layers)]

    def sailor_gpu(self, device_type: str, where: str) -> str:
        """Sailor's profile key for our catalog type (``A100-40GB`` -> ``A100-40``)."""
        if device_type in self.profile:
            return device_type
        for key in self.profile:
            try:
                if lookup_device_type(key, "gpu").name == device_type:
                    return key
            except ConfigError:
                continue
        raise field_error(where, device_type, f"be a GPU type Sailor profiled for {self.model}",
                          f"profiled: {', '.join(sorted(self.profile))}")

    def layer_rows(self, rep: _Replica, mbs: int, mbs_field: str) -> dict[str, list[float]]:
        by_mbs = self.profile[rep.gpu]
        if str(mbs) not in by_mbs:
            raise field_error(mbs_field, mbs, f"be a micro-batch size Sailor profiled on {rep.gpu}",
                              f"profiled: {', '.join(sorted(by_mbs, key=int))}")
        if str(rep.tp) not in by_mbs[str(mbs)]:
            raise field_error(f"{rep.where}.tp", rep.tp, f"be a tp Sailor profiled on {rep.gpu} at mbs {mbs}",
                              f"profiled: {', '.join(sorted(by_mbs[str(mbs)], key=int))}")
        return by_mbs[str(mbs)][str(rep.tp)]

    def coeffs(self, sender: _Replica, n_sender: int, receiver: _Replica, n_receiver: int) -> list[float]:
        """Inter-node fit between ``n_sender`` GPUs of the sender's type and ``n_receiver`` of the receiver's."""
        try:
            return self.fits[sender.gpu][str(n_sender)][self.zone][receiver.gpu][str(n_receiver)][0]
        except KeyError:
            raise field_error(f"{sender.where}.devices", f"{n_sender} x {sender.gpu} -> {n_receiver} x {receiver.gpu}",
                              f"be a link Sailor measured in {self.zone}") from None


# -- the simulator ----------------------------------------------------------------------------


def _replica(plan: Plan, cluster: ClusterSpec, tables: _Tables, p: int, s: int) -> _Replica:
    where = f"plan.pipelines[{p}].stages[{s}]"
    stage = plan.pipelines[p].stages[s]
    specs = [cluster.device(d) for d in stage.devices]
    types = {d.type for d in specs}
    if len(types) > 1:
        raise field_error(f"{where}.devices", list(stage.devices), "be of one GPU type (Sailor's tp groups are)")
    if len({d.node for d in specs}) > 1:
        raise field_error(f"{where}.devices", list(stage.devices),
                          "lie in one node (Sailor's simulator has no compute term for a multi-node tp group)")
    return _Replica(tables.sailor_gpu(specs[0].type, f"{where}.devices"), stage.tp, where)


def _stage_sends(tables: _Tables, reps: list[list[_Replica]], layers: list[tuple[int, int]], mbs: int,
                 backward_send: BackwardSend) -> list[float]:
    num_stages = len(layers)
    charges = []
    for i, (start, stop) in enumerate(layers):
        fwd = bwd = 0.0
        if i < num_stages - 1:
            nxt = reps[i + 1]
            size = tables.act_bytes[stop - 1] * mbs
            fwd = max(sailor_send_time_s(size, tables.coeffs(r, r.tp, nxt[j % len(nxt)], nxt[j % len(nxt)].tp))
                      for j, r in enumerate(reps[i]))
        if i > 0:
            prev = reps[i - 1]
            # Sailor charges the output of the stage's own first layer; the gradient sent is the stage input's
            first = start if backward_send == BackwardSend.first_layer_output else start - 1
            size = tables.act_bytes[first] * mbs
            bwd = max(sailor_send_time_s(size, tables.coeffs(r, r.tp, prev[j % len(prev)], prev[j % len(prev)].tp))
                      for j, r in enumerate(reps[i]))
        if 0 < i < num_stages - 1:
            charges.append(fwd + bwd)
        elif i == num_stages - 1:
            charges.append(2 * bwd)
        else:
            charges.append(fwd if num_stages <= 3 else 2 * fwd)
    return charges


def _stage_sync(tables: _Tables, reps: list[_Replica], layers: tuple[int, int]) -> float:
    tp_divisor = min([_TP_DIVISOR_CAP] + [r.tp for r in reps])
    size = sum(tables.param_bytes[l] / tp_divisor for l in range(*layers))
    return max((sailor_allreduce_time_s(size, len(reps), tables.coeffs(a, 1, b, 1)) for a, b in zip(reps, reps[1:])),
               default=0.0)


def _group_pipelines(plan: Plan) -> list[list[int]]:
    groups: dict[tuple[int, ...], list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        groups.setdefault(tuple(pipe.boundaries()), []).append(p)
    return list(groups.values())


def _pipeline_estimate(tables: _Tables, members: list[int], layers: list[tuple[int, int]],
                       reps: list[list[_Replica]], mbs: int, num_micro_batches: int,
                       backward_send: BackwardSend) -> SailorPipelineEstimate:
    """One Sailor pipeline (our pipelines ``members``, stage replicas ``reps``): rules 1 to 4 and its stages'
    syncs (rule 5, within the pipeline)."""
    compute, update = [], []
    for s, (start, stop) in enumerate(layers):
        rows = [tables.layer_rows(r, mbs, f"plan.pipelines[{members[0]}].micro_batch_size") for r in reps[s]]
        compute.append(max(sum(t[str(l)][0] + t[str(l)][1] for l in range(start, stop)) for t in rows))
        update.append(max(t[str(start)][2] for t in rows))
    sends = _stage_sends(tables, reps, layers, mbs, backward_send)
    per_stage = [c + x for c, x in zip(compute, sends)]
    bottleneck = max(range(len(layers)), key=per_stage.__getitem__)
    fill = sum(compute) + sum(sends)
    stages = tuple(
        SailorStageEstimate(layers=layers[s], replicas=tuple(f"{r.gpu}x{r.tp}" for r in reps[s]),
                            compute_s=compute[s], send_s=sends[s], update_s=update[s],
                            sync_s=_stage_sync(tables, reps[s], layers[s]))
        for s in range(len(layers)))
    return SailorPipelineEstimate(
        plan_pipelines=tuple(members), stages=stages, bottleneck_stage=bottleneck,
        bottleneck_s=per_stage[bottleneck], fill_s=fill, update_s=max(update),
        pipeline_s=(num_micro_batches - 1) * per_stage[bottleneck] + fill + max(update),
        sync_s=max(st.sync_s for st in stages))


def _group_by_size(plan: Plan) -> list[list[int]]:
    """``_group_pipelines``, each group split by micro-batch size (``MicroBatches.plan``: Sailor's layer times are
    per size, so one Sailor pipeline has one)."""
    groups: dict[tuple, list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        groups.setdefault((tuple(pipe.boundaries()), pipe.micro_batch_size), []).append(p)
    return list(groups.values())


def sailor_iteration_time(plan: Plan, cluster: ClusterSpec | str | None = None, model: str = "OPT-350",
                          zone: str = DEFAULT_ZONE, fp16: bool = False,
                          backward_send: BackwardSend | str = BackwardSend.first_layer_output,
                          micro_batches: MicroBatches | str = MicroBatches.sailor) -> SailorEstimate:
    """Sailor's simulated seconds per iteration of ``plan`` on ``cluster`` (default: ``plan.cluster``).

    ``model`` and ``zone`` pick Sailor's tables; ``fp16`` is the simulator's flag (2 instead of 4 bytes
    per activation and gradient element; Sailor's validation runs use False).  ``backward_send`` is the size
    the backward pipeline send is charged at: ``first_layer_output``, Sailor's own rule (the default, which
    reproduces its published figures), or ``stage_input``, that rule's slip corrected (``BackwardSend``).
    With ``micro_batches="sailor"`` (the default) the plan's own micro-batch counts are not used: Sailor derives
    m from the global batch; ``"plan"`` charges each pipeline its own size and count (``MicroBatches``; the
    estimate's ``micro_batch_size`` and ``num_micro_batches`` are then the slowest pipeline's).  Raises
    ConfigError for a plan it cannot score (GPU type, micro-batch size, tp or link not in Sailor's data; mixed
    micro-batch sizes under Sailor's rule; a tp group of several types or nodes).  The rules it charges:
    ``SailorEstimate``.
    """
    if backward_send not in tuple(BackwardSend):
        raise field_error("backward_send", backward_send, f"be one of {', '.join(BackwardSend)}")
    backward_send = BackwardSend(backward_send)
    if micro_batches not in tuple(MicroBatches):
        raise field_error("micro_batches", micro_batches, f"be one of {', '.join(MicroBatches)}")
    micro_batches = MicroBatches(micro_batches)
    cluster = load_cluster(cluster if cluster is not None else plan.cluster)
    tables = _Tables(model, zone, 2 if fp16 else 4)
    if int(plan.model.get("num_layers", tables.num_layers)) != tables.num_layers:
        raise field_error("plan.model.num_layers", plan.model.get("num_layers"),
                          f"equal the {tables.num_layers} layers Sailor profiled for {model}")
    mbs = plan.pipelines[0].micro_batch_size
    for p, pipe in enumerate(plan.pipelines):
        if pipe.micro_batch_size != mbs and micro_batches == MicroBatches.sailor:
            raise field_error(f"plan.pipelines[{p}].micro_batch_size", pipe.micro_batch_size,
                              f"equal the other pipelines' ({mbs}): Sailor's simulator takes one micro-batch size")

    groups = _group_pipelines(plan) if micro_batches == MicroBatches.sailor else _group_by_size(plan)
    # Sailor keeps the dp degree of the last pipeline it read (a quirk reproduced as is)
    sailor_m = math.ceil(plan.global_batch_size / (mbs * len(groups[-1]) * len(groups)))
    sizes: list[tuple[int, int]] = []  # per group: (micro-batch size, micro-batches)
    results: list[SailorPipelineEstimate] = []
    all_reps: list[list[list[_Replica]]] = []
    for members in groups:
        first = plan.pipelines[members[0]]
        if micro_batches == MicroBatches.plan:
            mbs = first.micro_batch_size
            num_micro_batches = max(plan.pipelines[p].num_micro_batches for p in members)
        else:
            num_micro_batches = sailor_m
        sizes.append((mbs, num_micro_batches))
        reps = [[_replica(plan, cluster, tables, p, s) for p in members] for s in range(len(first.stages))]
        all_reps.append(reps)
        results.append(_pipeline_estimate(tables, members, [stage.layers for stage in first.stages], reps, mbs,
                                          num_micro_batches, backward_send))

    sync_within = max(r.sync_s for r in results)
    sync_across = 0.0
    if len(groups) > 1:
        # across pipelines: the longest pipeline's stages (first on a tie), full stage bytes, D = #pipelines
        longest = max(range(len(groups)), key=lambda g: (len(all_reps[g]), -g))
        for s, stage in enumerate(results[longest].stages):
            size = sum(tables.param_bytes[l] for l in range(*stage.layers))
            for r in all_reps[longest][s]:
                sync_across = max(sync_across, sailor_allreduce_time_s(size, len(groups), tables.coeffs(r, 1, r, 1)))
    slowest = max(range(len(results)), key=lambda g: results[g].pipeline_s)
    worst = results[slowest]
    sync = sync_within + sync_across
    return SailorEstimate(iteration_s=worst.pipeline_s + sync, pipeline_s=worst.pipeline_s, slowest_pipeline=slowest,
                          bottleneck_s=worst.bottleneck_s, update_s=worst.update_s, sync_s=sync,
                          sync_within_s=sync_within, sync_across_s=sync_across,
                          num_micro_batches=sizes[slowest][1], micro_batch_size=sizes[slowest][0],
                          pipelines=tuple(results))
