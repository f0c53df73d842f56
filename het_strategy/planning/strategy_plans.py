"""The plans the strategies run: what they need from the planning core at run time, with no process group in sight.

* ``estimate_workload`` — a one-layer workload of any model (parameters
  counted, FLOPs by the standard 2 x parameters x tokens forward estimate),
  used when the user names no workload;
* ``data_parallel_settings`` — the planner settings of a run's data-parallel plan;
* ``data_parallel_plan`` — the uneven data-parallel plan of a run: searched
  (``planning.plan`` in mode dp), or a given plan checked against the cluster,
  the model and the global batch;
* ``fsdp_plan`` — the fully sharded plan of a ``hetero_fsdp`` run (shares by
  speed, shards by memory): searched (``planning.plan`` in mode fsdp), or a
  given plan checked, its memory too (the refusal names the rank, the need and
  the memory);
* ``check_given_plan`` — a plan given to a run (any runtime's), checked against the
  cluster, the model, the runtime, the precision and the global batch;
* ``shares_in_rank_order`` — the plan's shares, rank r playing device r.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.dtypes import Dtype
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime, raise_first, runtime_problems
from het_strategy.planning import PlanRequest, plan
from het_strategy.core.workload import LayerCost, MeasuredProfile, MoESpec, WorkloadSpec

__all__ = ["estimate_workload", "data_parallel_settings", "data_parallel_plan", "fsdp_plan",
           "check_given_plan", "shares_in_rank_order"]


def estimate_workload(name: str, num_params: int, tokens_per_sample: int, dtype: Dtype | str,
                      moe: Sequence[tuple[int, int, int]] = ()) -> WorkloadSpec:
    """A workload from the model's size: forward FLOPs ~ 2 x parameters x tokens per sample.

    Enough for a data-parallel split, where only the ratio of device speeds and
    the gradient volume matter; activation memory is not known (0), so pass a
    workload to plan memory-bound runs.  ``moe``: one ``(num_experts, top_k,
    params_per_expert)`` per MoE layer (its experts left out of ``num_params``),
    each a layer of its own whose experts cost 2 x their parameters per routed token.
    """
    if num_params < 1:
        raise field_error("model", name, "have trainable parameters")
    tokens = max(1, tokens_per_sample)
    layers = [LayerCost(name="model", flops_per_sample=2.0 * num_params * tokens, params=num_params,
                        activation_bytes_per_sample=0, output_bytes_per_sample=0)]
    for i, (experts, top_k, per_expert) in enumerate(moe):
        spec = MoESpec(num_experts=experts, top_k=top_k, params_per_expert=per_expert,
                       flops_per_token_per_expert=2.0 * per_expert)
        layers.append(LayerCost(name=f"moe{i}", flops_per_sample=0.0, params=0, activation_bytes_per_sample=0,
                                output_bytes_per_sample=0, moe=spec))
    return WorkloadSpec(name=name, layers=tuple(layers), seq_len=tokens, dtype=dtype)


def data_parallel_settings(global_batch_size: int, dtype: Dtype | str, idle_devices: bool = False) -> TrainSettings:
    """The settings a run's data-parallel plan is searched with.  ``idle_devices=False`` (the hetero strategy's):
    a rank with no share would still run a filler sample and the sync every step, so every device takes part."""
    return TrainSettings(global_batch_size=global_batch_size, dtype=dtype, idle_devices=idle_devices,
                         micro_batch_sizes=tuple(sorted({1, 2, 4, 8, 16, 32, global_batch_size})))


def data_parallel_plan(cluster: ClusterSpec, workload: WorkloadSpec, global_batch_size: int, dtype: Dtype | str,
                       given: Plan | str | Path | None = None, profile: MeasuredProfile | None = None) -> Plan:
    """The run's pure data-parallel plan: ``given`` checked, or the planner's optimum.

    ``profile`` (measured per-layer times of this model per device type) replaces
    datasheet throughput where it covers a device type.
    """
    if given is None:
        return plan(cluster, workload, data_parallel_settings(global_batch_size, dtype), PlanRequest(mode="dp"),
                    profile).plan
    return check_given_plan(given, cluster, workload, global_batch_size, dtype, Runtime.hetero)


def fsdp_plan(cluster: ClusterSpec, workload: WorkloadSpec, global_batch_size: int, dtype: Dtype | str,
              given: Plan | str | Path | None = None, profile: MeasuredProfile | None = None, *,
              even_shards: bool = False, equal_shares: bool = False, whole_shares: bool = False,
              activation_checkpointing: bool = False) -> Plan:
    """The run's fully sharded plan (``hetero_fsdp``): ``given`` checked (the runtime's rules, and that every rank's
    shard, gathered units and activations fit its memory), or the planner's optimum (mode fsdp).

    ``profile`` (measured per-layer times of this model per device type) replaces datasheet throughput where it
    covers a device type.  The comparisons: ``even_shards`` every rank ``1 / W`` of every parameter (even FSDP;
    refused, naming the rank, where the smallest device cannot hold its even shard), ``equal_shares`` the batch
    split evenly (both: Lightning's ``FSDPStrategy``'s layout).  ``whole_shares``: every rank runs its share in
    one micro-batch (the Lightning strategy's forward), so a plan that fits only in micro-steps is refused;
    ``activation_checkpointing``: each unit's forward recomputed in its backward (fewer saved activations).
    """
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.fsdp_cost import FsdpCost

    settings = data_parallel_settings(global_batch_size, dtype)
    if whole_shares:
        settings = dataclasses.replace(settings, micro_batch_sizes=(global_batch_size,))
    if activation_checkpointing:
        settings = dataclasses.replace(settings, activation_checkpointing=True)
    if given is None and (even_shards or equal_shares):
        from het_strategy.planning.fsdp import plan_fsdp

        cm = CostModel(cluster, workload, dataclasses.replace(settings, equal_shares=equal_shares), profile)
        made = plan_fsdp(cm, even_shards=even_shards).plan
        made.predicted = cm.score(made).to_dict()
        return made
    if given is None:
        return plan(cluster, workload, settings, PlanRequest(mode="fsdp", runtime="hetero_fsdp"), profile).plan
    checked = check_given_plan(given, cluster, workload, global_batch_size, dtype, Runtime.hetero_fsdp)
    FsdpCost(CostModel(cluster, workload, settings, profile)).check_fits(checked)
    return checked


def check_given_plan(given: Plan | str | Path, cluster: ClusterSpec, workload: WorkloadSpec, global_batch_size: int,
                     dtype: Dtype | str, runtime: Runtime) -> Plan:
    """A plan given to a run, checked: made for this cluster (devices in rank order) and model, one ``runtime``
    runs, in the run's precision and global batch."""
    checked = given if isinstance(given, Plan) else Plan.load(given)
    checked.check_against(cluster, workload)
    if list(checked.cluster_devices) != [d.name for d in cluster.devices]:
        raise field_error("plan.cluster_devices", list(checked.cluster_devices),
                          f"equal the devices of cluster `{cluster.name}` in rank order "
                          f"({[d.name for d in cluster.devices]})", "the plan was made for another cluster")
    raise_first(runtime_problems(checked, runtime))
    if (checked.dtype == Dtype.per_device) != (dtype == Dtype.per_device):
        raise field_error("plan.dtype", str(checked.dtype), f"{'be' if dtype == Dtype.per_device else 'not be'} "
                          "per_device, as the run's precision is "
                          f"{'per_device' if dtype == Dtype.per_device else dtype} (a per_device plan names the "
                          "dtype each rank computes in)", "re-plan in the run's precision")
    if checked.global_batch_size != global_batch_size:
        raise field_error("plan.global_batch_size", checked.global_batch_size,
                          f"equal the run's global batch {global_batch_size} (DataLoader batch_size x world "
                          "size, or the strategy's global_batch_size)",
                          "re-plan for this batch or set global_batch_size to the plan's")
    return checked


def shares_in_rank_order(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """Samples of a full global batch per rank, rank r playing ``cluster.devices[r]``."""
    shares = plan.rank_shares()
    out = [int(shares.get(d.name, 0)) for d in cluster.devices]
    if sum(out) != plan.global_batch_size:
        raise ConfigError(f"plan shares {out} sum to {sum(out)}, not the plan's global batch "
                          f"{plan.global_batch_size}")
    return out
