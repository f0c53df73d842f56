"""The ``hetero`` strategy's constructor arguments, checked when ``HeteroStrategy(...)`` is built.

A bad cluster, plan or option raises one ``ConfigError`` in the user's script,
before Lightning launches any rank, not one traceback per rank from inside
``fit``.  Sources that can be read without a device (a cluster name, file or
mapping, a plan file, a workload file) are read here, once, through
``core.files`` (a directory, a named pipe, an unreadable, empty or malformed
file is refused without blocking); ``"auto"`` is probed at setup.  A plan given
with a cluster is checked against it here: a plan made for another cluster is
refused before the model is compared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Literal, Mapping, get_args

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import field_error
from het_strategy.core.plan import Plan
from het_strategy.core.runtime_rules import Runtime, raise_first, runtime_problems
from het_strategy.core.workload import WorkloadSpec, load_workload

__all__ = ["ProbeMode", "PROBE_MODES", "check_cluster_source", "check_plan_source", "check_workload_source",
           "check_options", "planned_compression"]

ProbeMode = Literal["cached", "refresh"]
"""``cluster="auto"``: reuse this host's cached measurements, or measure again (and re-cache)."""
PROBE_MODES: tuple[str, ...] = get_args(ProbeMode)



def check_cluster_source(cluster: Any) -> ClusterSpec | str:
    """``"auto"`` as given; anything else loaded now (a bad one raises ConfigError naming ``cluster``)."""
    if isinstance(cluster, str) and cluster == "auto":
        return cluster
    if isinstance(cluster, ClusterSpec):
        return cluster
    if isinstance(cluster, bool) or not isinstance(cluster, (str, Path, Mapping)):
        raise field_error("cluster", cluster, "be \"auto\", a shipped cluster name, a YAML path, a mapping or a "
                          "ClusterSpec")
    return load_cluster(cluster)


def check_plan_source(plan: Any, cluster: ClusterSpec | str | None = None,
                      workload: WorkloadSpec | None = None, runtime: Runtime = Runtime.hetero) -> Plan | None:
    """None, a Plan, or a plan JSON file read now (missing, unreadable, malformed or unknown keys: ConfigError).

    The plan must be one ``runtime``'s strategy runs (``core.runtime_rules``; ``hetero``: pure data
    parallelism).  With ``cluster`` (a ClusterSpec; ``"auto"`` is checked at setup) it must be one made for it
    (``Plan.check_cluster``); with ``workload`` too (a ``WorkloadSpec``, see ``check_workload_source``), for that
    model.
    """
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        if isinstance(plan, bool) or not isinstance(plan, (str, Path)):
            raise field_error("plan", type(plan).__name__, "be a plan JSON path, a Plan, or None to plan at setup")
        plan = Plan.load(plan)
    raise_first(runtime_problems(plan, runtime))
    if isinstance(cluster, ClusterSpec):
        if workload is None:
            plan.check_cluster(cluster)
        else:
            plan.check_against(cluster, workload)
    return plan


def check_workload_source(workload: Any) -> WorkloadSpec | None:
    """None (estimated or profiled at setup), or the workload a name, file, mapping or WorkloadSpec describes,
    built now (a bad one raises ConfigError naming ``model``); the figures are in bf16, enough to check a plan
    and the source, while setup builds it again in the run's dtype."""
    if workload is None or isinstance(workload, WorkloadSpec):
        return workload
    if isinstance(workload, bool) or not isinstance(workload, (str, Path, Mapping)):
        raise field_error("workload", type(workload).__name__, "be a shipped model name, a YAML path, a mapping, "
                          "a WorkloadSpec, or None to estimate it at setup")
    return load_workload(workload)


def check_options(cluster: ClusterSpec | str, global_batch_size: Any, emulation: Any,
                  profile_input: Callable[[Any], Any] | None, probe: Any, telemetry: Any) -> None:
    """The scalar options, and the ones that only mean something together."""
    if global_batch_size is not None and (isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
                                          or global_batch_size < 1):
        raise field_error("global_batch_size", global_batch_size, "be an integer >= 1 or None")
    for name, value in (("emulation", emulation), ("telemetry", telemetry)):
        if not isinstance(value, bool):
            raise field_error(name, value, "be true or false")
    if probe not in PROBE_MODES:
        raise field_error("probe", probe, f"be one of {', '.join(PROBE_MODES)}")
    if probe == "refresh" and cluster != "auto":
        raise field_error("probe", probe, "go with cluster=\"auto\" (a cluster file is not measured)")
    if profile_input is not None:
        if not callable(profile_input):
            raise field_error("profile_input", profile_input, "be a callable: batch -> the model's forward input")
        if cluster != "auto":
            raise field_error("profile_input", getattr(profile_input, "__name__", "a callable"),
                              "go with cluster=\"auto\": the model's blocks are timed on the probed devices; a "
                              "cluster file's figures and the workload are used as given",
                              "drop profile_input, or pass cluster=\"auto\"")


def planned_compression(compression: Any, plan: Plan | None) -> Any:
    """``compression="planned"``: the plan's choice (``plan.compression``, from ``het-plan
    planner.compression=joint``) as the hierarchical exchange's config; anything else as given."""
    if not (isinstance(compression, str) and compression == "planned"):
        return compression
    if plan is None:
        raise field_error("compression", "planned", "go with plan= (a plan made with `het-plan "
                          "planner.compression=joint`, which carries the inter-node compression)")
    token = plan.compression.get("inter_node", "none")
    if token == "none":
        return "none"
    return {"method": token, "scope": "inter_node"}
