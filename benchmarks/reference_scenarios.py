"""The three reference scenarios of the planner issue, planned and compared under one cost model.

For AMP and Metis, the plans those papers report are rebuilt on our cluster
configs and scored by *our* cost model next to our plan, so the comparison is
like for like.  For Sailor, the cost model takes Sailor's measured per-layer
profiles (vendored in het_strategy/reference/data/sailor) in place of datasheet figures;
Sailor's own figures (0.170 / 0.523 it/s) come from Sailor's simulator, a
different model, and are printed only as the anchor.

Each scenario is also planned jointly with the inter-node compression (the
joint search step ``planning.joint.search_joint``, in the same mode and
settings as ours, which is its compression-blind plan): placement searched once per inter-node method (none,
q8, q4), the fastest kept, printed beside ours with the devices it brings back
into use.  Predicted by the cost model; for pipeline and hybrid plans it is a
what-if (only the hetero strategy's data-parallel runs apply the choice, as
``compression="planned"``).
Last line: ``RESULT amp_ratio=... metis_ratio=... sailor_32_96_its=... sailor_128_384_its=... joint_speedup_max=...``
(ratios: their plan's predicted step time / ours; joint_speedup_max: the largest blind / joint step time).
"""

from __future__ import annotations

import time

from plan_uneven_dp import brought_back_text, joint_speedup

from het_strategy.core.cluster import ClusterSpec, load_cluster
from het_strategy.core.cost_model import CostModel
from het_strategy.core.train_settings import TrainSettings
from het_strategy.core.plan import Pipeline, Plan, Stage
from het_strategy.planning import search_plan
from het_strategy.planning.joint import JointResult, search_joint
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec, load_workload
from het_strategy.reference.amp_plans import amp_measured_plans
from het_strategy.reference.sailor_profiles import load_sailor_profile


def _manual(cluster: ClusterSpec, workload: WorkloadSpec, batch: int, pipelines: list[Pipeline]) -> Plan:
    return Plan(cluster=cluster.name, cluster_devices=tuple(d.name for d in cluster.devices),
                model=workload.fingerprint(), global_batch_size=batch, pipelines=tuple(pipelines),
                dtype="fp16", mode="manual")


def run_joint(cluster: ClusterSpec, workload: WorkloadSpec, settings: TrainSettings,
              profile: MeasuredProfile | None = None) -> JointResult:
    """Ours planned jointly with the inter-node compression in ``plan``'s default mode, like ours: a what-if,
    since ``plan`` searches the joint choice over data-parallel plans only (the ones the hetero strategy runs)."""
    return search_joint(cluster, workload, settings, mode="auto", profile=profile)


def metis_plan(cluster: ClusterSpec, workload: WorkloadSpec, batch: int) -> Plan:
    """Metis's estimate: 2 stages x (dp 4 x tp 2), T4 stage first, split [0, 4, 10], 8 micro-batches."""
    t4 = [d.name for d in cluster.devices if d.type == "T4"]
    a100 = [d.name for d in cluster.devices if d.type != "T4"]
    first = [tuple(t4[0:2]), tuple(t4[2:4]), tuple(a100[0:2]), tuple(a100[2:4])]
    second = [tuple(a100[i:i + 2]) for i in range(4, 12, 2)]
    per_pipe = batch // 4
    pipes = [Pipeline((Stage(first[p], (0, 4)), Stage(second[p], (4, 10))), per_pipe // 8, per_pipe)
             for p in range(4)]
    return _manual(cluster, workload, batch, pipes)


def run_amp() -> dict:
    cluster, workload = load_cluster("amp_v100_t4"), load_workload("gpt2_amp", dtype="fp16")
    settings = TrainSettings(32, dtype="fp16", max_tp=1)
    cm = CostModel(cluster, workload, settings)
    ours = search_plan(cluster, workload, settings)
    # AMP's own runs, rebuilt with its logged stage boundaries and DeepSpeed's rank order
    amp = {p.label: p.plan for p in amp_measured_plans(cluster, workload)}
    measured_best = cm.score(amp[(1, 1, 2, 8)])
    predicted_best = cm.score(amp[(1, 1, 4, 4)])
    return {"ours": ours, "joint": run_joint(cluster, workload, settings), "ours_s": ours.predicted["step_time_s"], "amp_measured_best_s": measured_best.step_time_s,
            "amp_predicted_best_s": predicted_best.step_time_s}


def run_metis() -> dict:
    cluster, workload = load_cluster("metis_t4_a100"), load_workload("metis_gpt", dtype="fp16")
    settings = TrainSettings(128, dtype="fp16", max_tp=8)
    cm = CostModel(cluster, workload, settings)
    ours = search_plan(cluster, workload, settings)
    theirs = cm.score(metis_plan(cluster, workload, 128))
    return {"ours": ours, "joint": run_joint(cluster, workload, settings), "ours_s": ours.predicted["step_time_s"], "metis_s": theirs.step_time_s,
            "metis_fits": theirs.fits}


def run_sailor(cluster_name: str) -> dict:
    cluster = load_cluster(cluster_name)
    workload = load_workload("opt350", dtype="fp16")
    settings = TrainSettings(1024, dtype="fp16", max_tp=4, max_stages=8)
    profile = load_sailor_profile("OPT-350", workload)
    ours = search_plan(cluster, workload, settings, profile=profile)
    return {"ours": ours, "ours_its": 1 / ours.predicted["step_time_s"],
            "joint": run_joint(cluster, workload, settings, profile)}


def _shape(p: Plan, cluster: ClusterSpec) -> str:
    groups: dict[str, int] = {}
    for pipe in p.pipelines:
        key = " -> ".join(f"{cluster.device(st.devices[0]).type}x{st.tp}{list(st.layers)}" for st in pipe.stages)
        key += f" mbs {pipe.micro_batch_size} x {pipe.num_micro_batches}"
        groups[key] = groups.get(key, 0) + 1
    return "; ".join(f"{n} x [{k}]" for k, n in groups.items())


def _joint_lines(joint: JointResult, cluster: ClusterSpec) -> str:
    """Ours (the compression-blind plan) and the joint plan, step time and samples/s each."""
    blind, best = joint.blind, joint.plan
    assert blind is not None
    token = best.compression.get("inter_node", "none")
    return (f"  compression-blind (ours)      {blind.predicted['step_time_s']:.3f} s/iter  "
            f"{blind.predicted['samples_per_s']:.1f} samples/s  (predicted)\n"
            f"  joint: {token + ' between nodes':<22} {best.predicted['step_time_s']:.3f} s/iter  "
            f"{best.predicted['samples_per_s']:.1f} samples/s  {joint_speedup(joint):.2f}x; brought back into use: "
            f"{brought_back_text(joint, cluster)}")


def main() -> None:
    t0 = time.perf_counter()
    amp = run_amp()
    print(f"AMP (3x4 V100 + 4 T4, GPT-2 1024h/24L, batch 32), our cost model:")
    print(f"  ours                          {amp['ours_s']:.3f} s/iter  {_shape(amp['ours'], load_cluster('amp_v100_t4'))}")
    print(f"  AMP measured-best (1,1,2,8)   {amp['amp_measured_best_s']:.3f} s/iter  (AMP measured 1.28 s/iter on real GPUs)")
    print(f"  AMP predicted-best (1,1,4,4)  {amp['amp_predicted_best_s']:.3f} s/iter")
    print(_joint_lines(amp["joint"], load_cluster("amp_v100_t4")))
    metis = run_metis()
    print(f"Metis (4 T4 + 12 A100-80GB, GPT 10L/4096h, batch 128), our cost model:")
    print(f"  ours                          {metis['ours_s']:.3f} s/iter  {_shape(metis['ours'], load_cluster('metis_t4_a100'))}")
    print(f"  Metis estimate [0,4,10]       {metis['metis_s']:.3f} s/iter  fits={metis['metis_fits']}")
    print(_joint_lines(metis["joint"], load_cluster("metis_t4_a100")))
    sailor = {name: run_sailor(name) for name in ("sailor_a100_v100_32_96", "sailor_a100_v100_128_384")}
    for name, label, anchor in (("sailor_a100_v100_32_96", "32:96", 0.170),
                                ("sailor_a100_v100_128_384", "128:384", 0.523)):
        res = sailor[name]
        print(f"Sailor A100:V100 = {label} (OPT-350, batch 1024, Sailor's measured profiles):")
        print(f"  ours (our cost model)         {res['ours_its']:.3f} it/s  {_shape(res['ours'], load_cluster(name))}")
        print(f"  Sailor's plan (its simulator) {anchor:.3f} it/s  (different cost model; anchor only)")
        print(_joint_lines(res["joint"], load_cluster(name)))
    joints = [amp["joint"], metis["joint"], *(res["joint"] for res in sailor.values())]
    print(f"total {time.perf_counter() - t0:.1f} s")
    print(f"RESULT amp_ratio={amp['amp_measured_best_s'] / amp['ours_s']:.3f} "
          f"metis_ratio={metis['metis_s'] / metis['ours_s']:.3f} "
          f"sailor_32_96_its={sailor['sailor_a100_v100_32_96']['ours_its']:.3f} "
          f"sailor_128_384_its={sailor['sailor_a100_v100_128_384']['ours_its']:.3f} "
          f"joint_speedup_max={max(joint_speedup(j) for j in joints):.3f}")


if __name__ == "__main__":
    main()
