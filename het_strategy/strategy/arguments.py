"""The ``hetero`` strategy's constructor arguments, checked when ``HeteroStrategy(...)`` is built.

A bad cluster, plan or option raises one ``ConfigError`` in the user's script,
before Lightning launches any rank — not three tracebacks from inside ``fit``.
Sources that can be read without a device (a cluster name, file or mapping, a
plan file) are read here, once; ``"auto"`` is probed at setup.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.errors import field_error
from het_strategy.core.plan import Plan

__all__ = ["PROBE_MODES", "check_cluster_source", "check_plan_source", "check_options", "planned_compression"]

PROBE_MODES = ("cached", "refresh")
"""``cluster="auto"``: reuse this host's cached measurements, or measure again (and re-cache)."""


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


def check_plan_source(plan: Any) -> Plan | None:
    """None, a Plan, or a plan JSON file read now (missing, malformed or unknown keys: ConfigError)."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, bool) or not isinstance(plan, (str, Path)):
        raise field_error("plan", type(plan).__name__, "be a plan JSON path, a Plan, or None to plan at setup")
    return Plan.load(plan)


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
    if token in ("fp16", "bf16"):
        return {"method": token, "scope": "inter_node"}
    return {"method": "quantize", "bits": int(token[1:]), "scope": "inter_node"}
