"""``het-train``: the main job — a character-level GPT on the standard library's source, on a mixed cluster.

Usage (every field of ``configs/train.yaml`` can be overridden Hydra-style; docs/guide/het-train.md has more)::

    het-train                                  # 4 emulated CPU devices of speeds 1, 1, 0.5, 0.25
    het-train strategy=ddp                     # plain Lightning DDP on the same cluster, for comparison
    het-train cluster=auto devices=2           # probe the real devices (cached) instead of a cluster file
    het-train experiment=smoke                 # a preset (configs/experiment/): a few seconds on 2 ranks
    het-train --cfg                            # print the composed config and stop
    het-train -m train.seed=0,1                # a sweep: two runs, summaries in het_train_runs/multirun/{0,1}

Steps of one run:

1. compose the config against its typed schema (``train_config.py``) and check it in the launching process
   (``train_job.TrainJob``; bad input: one line ``het-train: error: ...`` and exit code 2, before any worker
   starts);
2. build the corpus (stdlib source, split by file), the model and the strategy (``build_strategy``);
3. ``Trainer.fit`` on ``devices`` processes (Lightning re-runs this command for ranks 1..n-1), then a full
   validation pass;
4. rank 0 prints the plan, per-rank throughput, the losses and the speed-up over an equal split, and writes
   ``output.dir/output.summary``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from het_strategy.cli._common import compose_config, run_cli
from het_strategy.cli.multirun import MULTIRUN_FLAGS, run_sweep
from het_strategy.cli.train_config import register_train_schema
from het_strategy.cli.train_job import PLANNED, TrainJob
from het_strategy.core.errors import ConfigError
from het_strategy.core.log import rank_zero_info
from het_strategy.core.shipped import shipped_names

__all__ = ["PROG", "CONFIG_NAME", "compose_train_config", "build_strategy", "log_planned_compression",
           "run_train", "main"]

PROG = "het-train"
CONFIG_NAME = "train"

_USAGE = f"""usage: {PROG} [-m] [--cfg] [key=value ...]

Train a character-level GPT on the Python standard library's source on a heterogeneous cluster.

overrides (Hydra syntax; see configs/train.yaml for every field):
  cluster=<name|file.yaml|auto>  shipped: {{clusters}}
  model=<name|file.yaml>         model.num_layers=N model.hidden_size=N model.num_heads=N model.seq_len=N
  strategy=hetero|ddp|hetero_deepspeed|hetero_diloco|hetero_fsdp   devices=N   accelerator=cpu|cuda
  strategy.inner_steps=50 strategy.outer_codec=q4   (hetero_diloco: pin H and the codec; default planned)
  strategy.prefetch=false strategy.activation_checkpointing=true   (hetero_fsdp: shards by memory, shares by speed)
  planner.mode=auto|dp|pipeline|hybrid|fsdp   (hetero_deepspeed: pipelines of the GPT's blocks; hetero: auto|dp;
                                               hetero_fsdp: auto|fsdp)
  train.global_batch_size=N  train.max_steps=N  train.lr=X  train.precision=32-true|bf16-mixed|per_device  train.seed=N
  train.val_every_n_steps=N  train.val_batches=N  train.accumulate_grad_batches=N
  data.max_bytes=N  data.val_fraction=X  data.seed=N
  logger=wandb|csv|none          wandb.mode=offline|online|disabled   logger.csv.name=NAME
  experiment=<name>              a preset: {{experiments}}
  output.dir=DIR  output.summary=summary.json  checkpoint.every_n_steps=N  resume=<ckpt>
  straggler.enabled=true  straggler.threshold=X  straggler.consecutive=N  straggler.min_share=X
  compression=none|adaptive|q4|powersgd|topk|fp16|bf16   compression.method=q8  compression.error_budget=X
  compression=hierarchical|planned   the inter-node hop only: adaptive, or planned with the placement (joint plan)
  model=moe_gpt_tiny  moe.placement=planned|uniform  moe.capacity_factor=X  moe.drop_tokens=true|false

options:
  -m, --multirun  run every combination of comma-separated values (train.seed=0,1), one after the other,
              each into output.dir/multirun/<i>
  --cfg       print the composed config and exit
  -h, --help  show this help and exit
"""


def compose_train_config(overrides: Sequence[str] = (), choices: dict[str, Any] | None = None
                         ) -> tuple[DictConfig, bool]:
    """The composed ``train`` config, and whether ``cluster=auto`` (probe at run time) was asked for;
    ``choices`` (when given) receives each group's chosen option."""
    overrides = list(overrides)
    auto = "cluster=auto" in overrides
    if auto:
        overrides.remove("cluster=auto")
    register_train_schema()  # the structured schema train.yaml's defaults list starts with
    cfg = compose_config(CONFIG_NAME, overrides, choices=choices)
    if auto and choices is not None:
        choices["cluster"] = "auto"
    return cfg, auto


def run_train(job: TrainJob) -> dict[str, Any] | None:
    """Train; returns the run summary on rank 0 (None on other ranks)."""
    import lightning.pytorch as pl
    import torch

    import het_strategy  # noqa: F401  (registers the strategy)
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy.demo.moe_gpt import build_char_model

    started = time.perf_counter()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.devices))
    pl.seed_everything(job.train.seed, workers=True, verbose=False)
    corpus = stdlib_corpus(max_bytes=job.data.max_bytes, val_fraction=job.data.val_fraction,
                           seed=job.data.seed)
    seq = job.model_cfg.seq_len
    train_set, val_set = CharDataset(corpus.train, seq), CharDataset(corpus.val, seq)
    train_loader, val_loader = _loaders(job, train_set, val_set)
    model = build_char_model(job.model_cfg, job.moe.routing(), lr=job.train.lr, weight_decay=job.train.weight_decay)
    strategy, emulation = build_strategy(job)
    callbacks = _callbacks(job, emulation)
    trainer = pl.Trainer(
        accelerator=job.accelerator, devices=job.devices, num_nodes=job.num_nodes, strategy=strategy,
        precision=None if job.dtype == "per_device" else job.train.precision, max_steps=job.train.max_steps,
        accumulate_grad_batches=job.train.accumulate_grad_batches,
        val_check_interval=job.train.val_every_n_steps, check_val_every_n_epoch=None,
        limit_val_batches=job.train.val_batches, num_sanity_val_steps=0,
        logger=_loggers(job), callbacks=callbacks, enable_checkpointing=job.checkpoint.every_n_steps is not None,
        enable_model_summary=False, default_root_dir=str(job.out_dir), log_every_n_steps=1, plugins=_plugins(job))
    log_planned_compression(job, trainer.global_rank)
    trainer.fit(model, train_loader, val_loader, ckpt_path=_resume_from(job))
    train_loss = trainer.callback_metrics.get("train_loss")
    trainer.limit_val_batches = 1.0  # the final validation sees every held-out sequence once
    full_val = trainer.validate(model, val_loader, verbose=False)
    val_loss = float(full_val[0]["val_loss"]) if full_val else None
    val_samples = (len(val_set) // job.global_batch_size * job.global_batch_size
                   if job.strategy == "hetero_deepspeed" else len(val_set))  # whole global batches only
    if trainer.global_rank != 0:
        return None
    summary = _summary(job, trainer, callbacks, {
        "final_train_loss": float(train_loss) if train_loss is not None else None,
        "final_val_loss": val_loss, "val_samples": val_samples,
        "train_samples": len(train_set), "wall_s": time.perf_counter() - started})
    _print_report(summary)
    _write_summary(job, trainer, summary)
    return summary


def _loaders(job: TrainJob, train_set: Any, val_set: Any) -> tuple[Any, Any]:
    """The training and validation loaders: per-rank batches, or the whole global batch on every rank
    (``hetero_deepspeed`` cuts its micro-batches from it)."""
    from torch.utils.data import DataLoader

    if job.strategy == "hetero_deepspeed":
        return (DataLoader(train_set, batch_size=job.global_batch_size, shuffle=True, drop_last=True),
                DataLoader(val_set, batch_size=job.global_batch_size, drop_last=True))
    per_rank = max(1, job.global_batch_size // (job.devices * job.num_nodes))
    return DataLoader(train_set, batch_size=per_rank, shuffle=True), DataLoader(val_set, batch_size=per_rank)


def _callbacks(job: TrainJob, emulation: list[Any]) -> list[Any]:
    """The job's callbacks: throughput first, then the emulation's, straggler mitigation, the compression monitor,
    the preemption checkpoint and the periodic checkpoints, as the job asks."""
    from het_strategy.callbacks.throughput import ThroughputMonitor

    out = job.out_dir
    callbacks: list[Any] = [ThroughputMonitor(warmup_steps=min(3, max(0, job.train.max_steps - 2)),
                                              summary_path=None, verbose=False), *emulation]
    if job.straggler.enabled:
        from het_strategy.callbacks.straggler import StragglerMitigation

        callbacks.append(StragglerMitigation(**job.straggler.mitigation_args()))
    if job.compression is not None and job.compression.method != "none":
        from het_strategy.callbacks.compression import CompressionMonitor

        callbacks.append(CompressionMonitor())
    if job.checkpoint.on_sigterm:
        from het_strategy.callbacks.preemption import PreemptionCheckpoint

        # elastic: torchrun's agents stop a group whose membership changes by SIGTERM; the step in the name lets
        # the new group go on from the step the old one reached (elastic.latest_checkpoint), and 143 makes every
        # agent restart rather than take the job as finished
        name, code = ("step_{step}.ckpt", 143) if job.elastic.enabled else ("preempted.ckpt", 0)
        callbacks.append(PreemptionCheckpoint(out / "checkpoints", name, job.checkpoint.sigterm_grace_s, code))
    every = job.checkpoint.every_n_steps
    if every is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        # "step_20.ckpt", not Lightning's "step=20.ckpt": Hydra's override grammar refuses "=" in a value,
        # so `resume=<path>` works as printed
        callbacks.append(ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="step_{step}",
                                         auto_insert_metric_name=False, every_n_train_steps=every, save_top_k=-1))
    return callbacks


def _summary(job: TrainJob, trainer: Any, callbacks: list[Any], figures: dict[str, Any]) -> dict[str, Any]:
    """The run summary (rank 0): throughput, the job, ``figures`` (losses, samples, wall time), the straggler's
    decisions, the predicted speed-up, the experts and the compression."""
    from dataclasses import asdict

    from het_strategy.callbacks.straggler import StragglerMitigation
    from het_strategy.callbacks.throughput import ThroughputMonitor

    throughput = next(c for c in callbacks if isinstance(c, ThroughputMonitor))
    summary = dict(throughput.summary or {})
    summary.update({"strategy": job.strategy,
                    "cluster": "auto" if job.auto_cluster else job.cluster.name,  # type: ignore[union-attr]
                    "model": OmegaConf.to_container(job.cfg.model), "max_steps": job.train.max_steps, **figures})
    straggler = next((c for c in callbacks if isinstance(c, StragglerMitigation)), None)
    if straggler is not None:
        summary["straggler_decisions"] = [asdict(d) for d in straggler.decisions]
    summary.update(_predicted_speedup(trainer.strategy, job))
    experts = getattr(_run_of(trainer.strategy), "experts", None)
    if experts is not None:
        summary.update(experts.summary())
    summary.update(_compression_summary(trainer.strategy, job))
    return summary


def _run_of(strategy: Any) -> Any:
    """The strategy's run (``trainer.strategy.run``) for the package's strategies; None for Lightning's own
    (``strategy=ddp``)."""
    return getattr(strategy, "run", None)


def _write_summary(job: TrainJob, trainer: Any, summary: dict[str, Any]) -> None:
    """``output.summary`` as JSON in the output folder, and into the wandb run's files (no-op without one)."""
    if not job.output.summary:
        return
    import json

    from het_strategy.core.atomic_file import write_atomic
    from het_strategy.report.wandb_view import save_file

    path = job.out_dir / job.output.summary
    write_atomic(path, json.dumps(summary, indent=2, default=str))
    save_file(trainer.loggers, path)


def _resume_from(job: TrainJob) -> str | None:
    """``resume``; with ``elastic.enabled`` and no ``resume``, the newest checkpoint in output.dir/checkpoints (a
    restart goes on from it; the first start finds none)."""
    if job.resume is not None or not job.elastic.enabled:
        return job.resume
    from het_strategy.strategy.elastic import latest_checkpoint

    found = latest_checkpoint(job.out_dir / "checkpoints")
    return None if found is None else str(found)


def _plugins(job: TrainJob) -> list[Any]:
    """``train.precision=per_device``: the ``PerDevicePrecision`` plugin; ``checkpoint.async_save``: Lightning's
    ``AsyncCheckpointIO`` (the tensors copied on the training thread, written by a background one)."""
    plugins: list[Any] = []
    if job.dtype == "per_device":
        from het_strategy.strategy.lightning_classes import PerDevicePrecision

        plugins.append(PerDevicePrecision())
    if job.checkpoint.async_save:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO

        plugins.append(AsyncCheckpointIO())
    return plugins


def build_strategy(job: TrainJob) -> tuple[Any, list[Any]]:
    """The Lightning strategy of ``job`` (an instance, or ``"ddp"``) and the callbacks it needs (the emulation
    padding of plain DDP); nothing is launched."""
    from het_strategy import HeteroStrategy
    from het_strategy.callbacks.emulation import EmulatedDeviceCallback
    from het_strategy.emulation.speeds import cluster_is_emulated

    if job.strategy == "hetero":
        cluster_source: Any = "auto" if job.auto_cluster else job.cluster
        # compression=planned: the joint plan made in TrainJob, its inter-node choice run by the hierarchical
        # hook; otherwise rank 0 plans at setup (with cluster=auto the strategy profiles the model itself, per
        # block, on every device type)
        strategy = HeteroStrategy(cluster=cluster_source, workload=None if job.auto_cluster else job.workload,
                                  global_batch_size=job.global_batch_size, plan=job.plan,
                                  profile_input=model_input if job.auto_cluster else None,
                                  compression=PLANNED if job.plan is not None else job.compression,
                                  moe_placement=job.moe.placement, **job.failure.strategy_args())
        return strategy, []
    if job.strategy == "hetero_diloco":
        from dataclasses import fields

        from het_strategy import HeteroDiLoCoStrategy

        # rank 0 plans the split, H and the codec (planning/low_communication.py) unless the options pin them
        options = {f.name: getattr(job.diloco, f.name) for f in fields(job.diloco)
                   if f.init and f.name != "outer_optimizer"}
        return HeteroDiLoCoStrategy(cluster=job.cluster, workload=job.workload,
                                    global_batch_size=job.global_batch_size, **options,
                                    **job.failure.strategy_args()), []
    if job.strategy == "hetero_fsdp":
        from het_strategy import HeteroFSDPStrategy

        # rank 0 plans at setup (shares by speed, plan.shards by memory) and shards the model before Lightning
        # builds the optimizer; emulated speeds are padded as in hetero
        assert job.fsdp is not None
        return HeteroFSDPStrategy(cluster=job.cluster, workload=job.workload, global_batch_size=job.global_batch_size,
                                  **job.fsdp.strategy_args(), **job.failure.strategy_args()), []
    if job.strategy == "hetero_deepspeed":
        from het_strategy import HeteroDeepSpeedStrategy

        # rank 0 plans (planner.runtime=deepspeed) and broadcasts; emulated stages are padded per micro-batch
        return HeteroDeepSpeedStrategy(cluster=job.cluster, workload=job.workload,
                                       global_batch_size=job.global_batch_size, planner_mode=job.planner.mode,
                                       **({} if job.train.max_tp is None else {"max_tp": job.train.max_tp}),
                                       **job.failure.strategy_args()), []
    if job.cluster is not None and cluster_is_emulated(job.cluster):
        return "ddp", [EmulatedDeviceCallback(cluster=job.cluster, workload=job.workload, dtype=job.dtype)]
    return "ddp", []


def log_planned_compression(job: TrainJob, rank: int) -> None:
    """``compression=planned``: one line on the inter-node method the joint plan chose (rank 0 only)."""
    if job.planned_note is not None:
        rank_zero_info(rank, "%s", job.planned_note)


def _compression_summary(strategy: Any, job: TrainJob) -> dict[str, Any]:
    """The compression config, the wire saving on rank 0 and the last per-layer decisions."""
    state = getattr(_run_of(strategy), "compression_state", None)
    out: dict[str, Any] = {"compression": job.compression.to_dict() if job.compression else None}
    if job.plan is not None:  # compression=planned: what the joint plan chose for the inter-node hop
        out["compression_planned"] = dict(job.plan.compression)
    if state is not None:
        last = max((d["step"] for d in state.decisions), default=None)
        out.update({"compression_wire_ratio": state.wire_ratio, "compression_bytes_sent": state.bytes_sent,
                    "compression_choices": dict(state.choices),
                    "compression_decisions": [d for d in state.decisions if d["step"] == last]})
    return out


def model_input(batch: Any) -> Any:
    """What CharGPT's forward takes from a (tokens, targets) batch."""
    return batch[0]


def _loggers(job: TrainJob) -> Any:
    """The logger group's entries, built with ``hydra.utils.instantiate`` (False: no logger)."""
    if not job.loggers:
        return False
    from hydra.utils import instantiate

    loggers: list[Any] = []
    for name, node in job.loggers.items():
        extra: dict[str, Any] = {}
        if str(node["_target_"]) == "lightning.pytorch.loggers.WandbLogger":
            os.environ.setdefault("WANDB_SILENT", "true")
            extra["config"] = OmegaConf.to_container(job.cfg, resolve=True)
        try:
            # instantiate's own first parameter is `config`: WandbLogger's `config=` goes through a partial
            loggers.append(instantiate(node, _partial_=True)(**extra))
        except Exception as exc:  # Hydra wraps the logger's own TypeError/ValueError
            raise ConfigError(f"`logger.{name}` cannot be built: {str(exc).strip().splitlines()[-1]}",
                              field=f"logger.{name}") from None
    return loggers


def _predicted_speedup(strategy: Any, job: TrainJob) -> dict[str, Any]:
    """The cost model's step time for the plan and for an even split of the same batch."""
    plan, cluster = getattr(strategy, "plan", None), getattr(strategy, "cluster", None)
    if plan is None or cluster is None:
        return {}
    if job.strategy == "hetero_diloco":  # priced by outer rounds (planning/low_communication.py)
        outer = strategy.run.extension.outer
        last = outer.records[-1] if outer is not None and outer.records else None
        return {"diloco_shares": strategy.run.current_shares(), "predicted_step_s": plan.predicted.get("step_time_s"),
                "outer_sync": plan.outer_sync.to_dict(), "outer_rounds": 0 if outer is None else outer.rounds,
                "outer_bytes_per_round": None if last is None else last.bytes_sent * len(plan.outer_sync.groups)}
    if job.strategy == "hetero_fsdp":
        return _fsdp_summary(strategy, job)
    if job.strategy == "hetero_deepspeed":
        from het_strategy.core.cost_model import CostModel
        from het_strategy.core.train_settings import TrainSettings

        cm = CostModel(cluster, job.workload, TrainSettings(global_batch_size=job.global_batch_size, dtype=job.dtype))
        stages = [[f"{s.devices[0]}[{s.layers[0]},{s.layers[1]})" for s in p.stages] for p in plan.pipelines]
        return {"plan_stages": stages, "plan_samples": [p.samples for p in plan.pipelines],
                "predicted_step_s": cm.score(plan).step_time_s, "plan_summary": strategy.run.plan_summary}
    from het_strategy.core.cost_model import CostModel
    from het_strategy.core.train_settings import TrainSettings
    from het_strategy.planning.dp_split import equal_split_plan

    cm = CostModel(cluster, strategy.run.workload, TrainSettings(global_batch_size=job.global_batch_size,
                                                             dtype=job.dtype, micro_batch_sizes=(1,)),
                   strategy.run.profile)
    planned = cm.score(plan).step_time_s
    equal = cm.score(equal_split_plan(cm)).step_time_s
    return {"shares": strategy.run.current_shares(), "predicted_step_s": planned, "predicted_equal_step_s": equal,
            "predicted_speedup_vs_equal": equal / planned}


def _fsdp_summary(strategy: Any, job: TrainJob) -> dict[str, Any]:
    """``strategy=hetero_fsdp``: the plan's shares and shards, each rank's elements of the units (from rank 0's
    ``ShardedModel``: every unit knows every rank's piece), rank 0's time blocked on communication, and the cost
    model's step time against even FSDP (even shards, even shares: Lightning's ``FSDPStrategy``'s layout), which
    the planner may refuse where the smallest device cannot hold its even shard."""
    from het_strategy.core.errors import ConfigError
    from het_strategy.planning.strategy_plans import fsdp_plan

    plan, run = strategy.plan, strategy.run
    sharded = run.extension.layout  # the last fit's (the module is whole again after it)
    world = len(plan.pipelines)
    out: dict[str, Any] = {
        "plan_mode": str(plan.mode), "shares": run.current_shares(), "shards": dict(plan.shards),
        "fsdp_units": [u.name for u in sharded.units],
        "shard_elements": [sum(u.sizes[r] for u in sharded.units) for r in range(world)],
        "comm_wait_s_rank0": sharded.comm_wait_s, "predicted_step_s": plan.predicted.get("step_time_s"),
        "predicted_memory_gb": plan.predicted.get("memory_gb"),
        "memory_capacity_gb": plan.predicted.get("memory_capacity_gb")}
    try:
        even = fsdp_plan(strategy.cluster, run.workload, job.global_batch_size, job.dtype, profile=run.profile,
                         even_shards=True, equal_shares=True)
    except ConfigError as exc:
        out.update({"predicted_even_fsdp_step_s": None, "even_fsdp_refused": str(exc)})
    else:
        step = even.predicted["step_time_s"]
        out.update({"predicted_even_fsdp_step_s": step,
                    "predicted_speedup_vs_even_fsdp": step / out["predicted_step_s"]})
    return out


def _print_report(summary: dict[str, Any]) -> None:
    from het_strategy.callbacks.throughput import format_summary

    print(format_summary(summary))
    if "plan_stages" in summary:
        print("plan: " + " | ".join(" -> ".join(st) + f" x{n}" for st, n in zip(summary["plan_stages"],
                                                                              summary["plan_samples"]))
              + f"; predicted {summary['predicted_step_s']:.3f} s/step (cost model); {summary['plan_summary']}")
    if "outer_sync" in summary:
        sync = summary["outer_sync"]
        print(f"hetero_diloco: groups {sync['groups']}, shares per rank {summary['diloco_shares']}, an outer step "
              f"every {sync['inner_steps']} inner steps in {sync['codec']}: {summary['outer_rounds']} outer steps "
              f"({summary['outer_bytes_per_round']} bytes per round over the groups' link)")
    if summary.get("plan_mode") == "fsdp":
        shards = ", ".join(f"{d} {f:.3f}" for d, f in summary["shards"].items())
        even = (f"even FSDP {summary['predicted_even_fsdp_step_s']:.3f} s/step "
                f"({summary['predicted_speedup_vs_even_fsdp']:.2f}x slower)"
                if summary["predicted_even_fsdp_step_s"] is not None else "even FSDP refused by the planner")
        print(f"hetero_fsdp: shares per rank {summary['shares']}; shards {shards} of each of "
              f"{len(summary['fsdp_units'])} units ({summary['shard_elements']} elements per rank); predicted "
              f"{summary['predicted_step_s']:.3f} s/step, {even} (cost model)")
    elif "shares" in summary:
        print(f"shares per rank: {summary['shares']}; predicted speed-up over an equal split "
              f"{summary['predicted_speedup_vs_equal']:.2f}x (cost model)")
    val_loss, val_samples = summary["final_val_loss"], summary["val_samples"]
    val = ("none" if val_loss is None else f"{val_loss:.4f}") + (
        " (the last validation inside fit)" if val_samples is None else f" (all {val_samples} held-out sequences)")
    print(f"final train loss {summary['final_train_loss']:.4f}   validation loss {val}   "
          f"wall {summary['wall_s']:.1f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(_USAGE.format(clusters=", ".join(shipped_names("cluster") + ["auto"]),
                            experiments=", ".join(shipped_names("experiment"))))
        return 0
    show_cfg = "--cfg" in args
    multirun = any(a in MULTIRUN_FLAGS for a in args)
    args = [a for a in args if a != "--cfg" and a not in MULTIRUN_FLAGS]
    for a in args:
        if a.startswith("-"):
            print(f"{PROG}: error: unknown option {a} (overrides are key=value; see --help)", file=sys.stderr)
            return 2

    def check(combo: list[str]) -> Path:
        cfg, auto = compose_train_config(combo)
        return TrainJob(cfg, auto).out_dir

    if multirun:
        return run_cli(PROG, lambda: run_sweep(args, check, PROG))

    def body() -> int:
        choices: dict[str, Any] = {}
        cfg, auto = compose_train_config(args, choices)
        if show_cfg:
            order = ("cluster", "model", "strategy", "logger", "compression", "experiment")
            picked = " ".join(f"{group}={choices[group]}" for group in order if choices.get(group) is not None)
            print(f"# groups: {picked}\n{OmegaConf.to_yaml(cfg)}")
            return 0
        run_train(TrainJob(cfg, auto))
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
