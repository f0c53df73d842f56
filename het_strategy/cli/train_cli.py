"""``het-train``: the main job — a character-level GPT on the standard library's source, on a mixed cluster.

Usage (every field of ``configs/train.yaml`` can be overridden Hydra-style)::

    het-train                                  # 4 emulated CPU devices of speeds 1, 1, 0.5, 0.25
    het-train strategy=ddp                     # plain Lightning DDP on the same cluster, for comparison
    het-train cluster=local_cpu2 train.max_steps=30 model.num_layers=2 model.hidden_size=64
    het-train cluster=auto devices=2           # probe the real devices (cached) instead of a cluster file
    het-train --cfg                            # print the composed config and stop
    het-train -m train.seed=0,1                # a sweep: two runs, summaries in het_train_runs/multirun/{0,1}

Steps of one run:

1. compose and check the config in the launching process (bad input: one line
   ``het-train: error: ...`` and exit code 2, before any worker starts);
2. build the corpus (stdlib source, split by file), the model and the strategy —
   ``hetero`` (planned uneven shares) or ``ddp`` (even split; on an emulated
   cluster the same emulation callback pads its compute);
3. ``Trainer.fit`` on ``devices`` processes (Lightning re-runs this command for
   ranks 1..n-1), then a full validation pass;
4. rank 0 prints the plan, per-rank throughput, the losses and the speed-up
   over an equal split, and writes ``output.dir/output.summary``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from het_strategy.cli._common import cfg_to_dict, cluster_from_cfg, compose_config, run_cli
from het_strategy.cli.multirun import MULTIRUN_FLAGS, run_sweep
from het_strategy.core.errors import check_keys, field_error, require_int, require_number
from het_strategy.core.shipped import shipped_names

__all__ = ["PROG", "CONFIG_NAME", "compose_train_config", "run_train", "main"]

PROG = "het-train"
CONFIG_NAME = "train"
_TOP_KEYS = {"cluster", "model", "strategy", "accelerator", "devices", "train", "data", "logger", "wandb",
             "output", "checkpoint", "resume", "straggler", "compression", "planner", "moe"}
_STRAGGLER_KEYS = {"enabled", "every_n_steps", "threshold", "consecutive", "warmup", "min_share", "evict_ratio",
                   "stop_ratio"}
_TRAIN_KEYS = {"global_batch_size", "max_steps", "lr", "weight_decay", "precision", "accumulate_grad_batches",
               "val_every_n_steps", "val_batches", "seed"}
_STRATEGIES = ("hetero", "ddp", "hetero_deepspeed")
_LOGGERS = ("wandb", "csv", "none")

_USAGE = f"""usage: {PROG} [-m] [--cfg] [key=value ...]

Train a character-level GPT on the Python standard library's source on a heterogeneous cluster.

overrides (Hydra syntax; see configs/train.yaml for every field):
  cluster=<name|file.yaml|auto>  shipped: {{clusters}}
  model=<name|file.yaml>         model.num_layers=N model.hidden_size=N model.num_heads=N model.seq_len=N
  strategy=hetero|ddp|hetero_deepspeed   devices=N   accelerator=cpu|cuda
  planner.mode=auto|dp|pipeline|hybrid   (hetero_deepspeed: pipelines of the GPT's blocks; hetero: auto|dp)
  train.global_batch_size=N  train.max_steps=N  train.lr=X  train.precision=32-true|bf16-mixed  train.seed=N
  train.val_every_n_steps=N  train.val_batches=N  train.accumulate_grad_batches=N
  data.max_bytes=N  data.val_fraction=X  data.seed=N
  logger=wandb|csv|none          wandb.mode=offline|online|disabled
  output.dir=DIR  output.summary=summary.json  checkpoint.every_n_steps=N  resume=<ckpt>
  straggler.enabled=true  straggler.threshold=X  straggler.consecutive=N  straggler.min_share=X
  compression=none|adaptive|quantize4|powersgd|topk|fp16|bf16   compression.bits=N  compression.error_budget=X
  model=moe_gpt_tiny  moe.placement=planned|uniform  moe.capacity_factor=X  moe.drop_tokens=true|false

options:
  -m, --multirun  run every combination of comma-separated values (train.seed=0,1), one after the other,
              each into output.dir/multirun/<i>
  --cfg       print the composed config and exit
  -h, --help  show this help and exit
"""


def compose_train_config(overrides: Sequence[str] = ()) -> tuple[DictConfig, bool]:
    """The composed ``train`` config, and whether ``cluster=auto`` (probe at run time) was asked for."""
    overrides = list(overrides)
    auto = "cluster=auto" in overrides
    if auto:
        overrides.remove("cluster=auto")
    return compose_config(CONFIG_NAME, overrides), auto


class TrainJob:
    """A checked ``het-train`` config: everything needed to build the run, no process group yet."""

    def __init__(self, cfg: DictConfig, auto_cluster: bool = False) -> None:
        from het_strategy.planning.run_plan import precision_dtype
        from het_strategy.core.workload import transformer_config, transformer_workload

        top = set(cfg.keys())
        check_keys({k: None for k in top}, _TOP_KEYS, "config")
        self.train = cfg_to_dict(cfg.train, "train")
        check_keys(self.train, _TRAIN_KEYS, "train")
        self.strategy = str(cfg.strategy)
        if self.strategy not in _STRATEGIES:
            raise field_error("strategy", cfg.strategy, f"be one of {', '.join(_STRATEGIES)}")
        self.logger = str(cfg.logger)
        if self.logger not in _LOGGERS:
            raise field_error("logger", cfg.logger, f"be one of {', '.join(_LOGGERS)}")
        if self.logger == "wandb" and importlib.util.find_spec("wandb") is None:
            raise field_error("logger", "wandb", "name an installed logger (wandb is an optional dependency)",
                              "pip install 'het_strategy[wandb]', or logger=csv")
        self.accelerator = str(cfg.accelerator)
        if self.accelerator not in ("cpu", "cuda"):
            raise field_error("accelerator", cfg.accelerator, "be cpu or cuda")
        self.auto_cluster = auto_cluster
        self.cluster = None if auto_cluster else cluster_from_cfg(cfg)
        devices = cfg.devices
        if devices is None:
            if self.cluster is None:
                raise field_error("devices", None, "be given with cluster=auto (how many processes to probe)")
            devices = self.cluster.num_devices
        if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
            raise field_error("devices", devices, "be an integer >= 1 (processes on this node)")
        if self.cluster is not None and self.cluster.num_devices != devices:
            raise field_error("devices", devices,
                              f"equal the device count of cluster `{self.cluster.name}` "
                              f"({self.cluster.num_devices}): rank r plays the cluster's r-th device",
                              f"pass devices={self.cluster.num_devices} or a cluster of {devices} devices")
        self.devices = devices
        self.dtype = precision_dtype(self.train.get("precision", "32-true"))
        self.model_cfg = transformer_config(cfg_to_dict(cfg.model, "model"))
        self.workload = transformer_workload(self.model_cfg, self.dtype)
        gb = self.train.get("global_batch_size")
        if not isinstance(gb, int) or isinstance(gb, bool) or gb < devices:
            raise field_error("train.global_batch_size", gb, f"be an integer >= devices ({devices}): every rank "
                              "needs a sample")
        if self.strategy == "ddp" and gb % devices:
            raise field_error("train.global_batch_size", gb, f"be divisible by devices ({devices}) for plain ddp, "
                              "which splits the batch evenly")
        self.global_batch_size = gb
        for key in ("max_steps", "val_every_n_steps", "val_batches", "accumulate_grad_batches"):
            require_int(self.train.get(key), f"train.{key}", minimum=1)
        self.data = cfg_to_dict(cfg.data, "data")
        check_keys(self.data, {"max_bytes", "val_fraction", "seed"}, "data")
        self.wandb = cfg_to_dict(cfg.wandb, "wandb")
        check_keys(self.wandb, {"project", "mode"}, "wandb")
        self.output = cfg_to_dict(cfg.output, "output")
        check_keys(self.output, {"dir", "summary"}, "output")
        self.checkpoint = cfg_to_dict(cfg.checkpoint, "checkpoint")
        check_keys(self.checkpoint, {"every_n_steps"}, "checkpoint")
        every = self.checkpoint.get("every_n_steps")
        if every is not None:
            require_int(every, "checkpoint.every_n_steps", minimum=1)
        self.straggler = cfg_to_dict(cfg.straggler, "straggler")
        check_keys(self.straggler, _STRAGGLER_KEYS, "straggler")
        if not isinstance(self.straggler.get("enabled"), bool):
            raise field_error("straggler.enabled", self.straggler.get("enabled"), "be true or false")
        if self.straggler["enabled"]:
            if self.strategy != "hetero":
                raise field_error("straggler.enabled", True, "go with strategy=hetero (it rebalances the hetero "
                                  "strategy's shares)")
            from het_strategy.callbacks.straggler import StragglerMitigation

            StragglerMitigation(**self._straggler_args())  # bad settings fail here, before any worker starts
        from het_strategy.compression import compression_config

        self.compression = compression_config(cfg_to_dict(cfg.compression, "compression"))
        if self.compression is not None and self.compression.method != "none" and self.strategy != "hetero":
            why = ("Lightning's DDP registers comm hooks on CUDA only" if self.strategy == "ddp" else
                   "DeepSpeed reduces the gradients itself")
            raise field_error("compression.method", self.compression.method,
                              f"be none with strategy={self.strategy} ({why})",
                              "use strategy=hetero, which registers them on every device")
        self.planner = cfg_to_dict(cfg.get("planner") or {"mode": "auto"}, "planner")
        check_keys(self.planner, {"mode"}, "planner")
        from het_strategy.planning import MODES

        mode = self.planner.get("mode", "auto")
        if mode not in MODES:
            raise field_error("planner.mode", mode, f"be one of {', '.join(MODES)}")
        if self.strategy == "hetero" and mode not in ("auto", "dp"):
            raise field_error("planner.mode", mode, "be auto or dp with strategy=hetero (it plans data "
                              "parallelism)", "use strategy=hetero_deepspeed for pipeline or hybrid plans")
        self.resume = None if cfg.resume is None else str(cfg.resume)
        if self.resume is not None and not Path(self.resume).is_file():
            raise field_error("resume", self.resume, "be an existing checkpoint file")
        if self.strategy == "hetero_deepspeed":
            self._check_deepspeed_job(cfg)
        self.moe = self._check_moe(cfg)
        self.cfg = cfg

    def _check_moe(self, cfg: DictConfig) -> dict[str, Any]:
        """The ``moe`` section: where experts live and how they route (models with experts only)."""
        moe = cfg_to_dict(cfg.get("moe") or {"placement": "planned"}, "moe")
        check_keys(moe, {"placement", "capacity_factor", "drop_tokens", "aux_loss_coef"}, "moe")
        placement = moe.get("placement", "planned")
        if placement not in ("planned", "uniform"):
            raise field_error("moe.placement", placement, "be planned or uniform")
        for key in ("capacity_factor", "aux_loss_coef"):
            if key in moe:
                require_number(moe[key], f"moe.{key}", allow_zero=key == "aux_loss_coef")
        if not isinstance(moe.get("drop_tokens", True), bool):
            raise field_error("moe.drop_tokens", moe.get("drop_tokens"), "be true or false")
        experts = self.model_cfg.num_experts
        if experts:
            if self.strategy == "hetero_deepspeed":
                raise field_error("strategy", "hetero_deepspeed", "be hetero or ddp for a model with experts "
                                  f"(model.num_experts={experts}): HeteroMoE runs under DDP in this version")
            if self.resume is not None:
                raise field_error("resume", self.resume, "be null for a model with experts (each rank's optimizer "
                                  "state covers only its own experts; resuming is not supported yet)")
            if experts < self.devices:
                raise field_error("model.num_experts", experts, f"be >= devices ({self.devices}) so every rank "
                                  "holds an expert")
            if self.strategy == "hetero" and placement == "uniform" and experts % self.devices:
                raise field_error("moe.placement", "uniform", f"go with model.num_experts ({experts}) divisible "
                                  f"by devices ({self.devices})", "use moe.placement=planned")
        return moe

    def _check_deepspeed_job(self, cfg: DictConfig) -> None:
        """What ``strategy=hetero_deepspeed`` runs in het-train (refused here, before any worker starts)."""
        if importlib.util.find_spec("deepspeed") is None:
            raise field_error("strategy", "hetero_deepspeed", "have DeepSpeed installed",
                              "pip install 'het_strategy[deepspeed]'")
        if self.cluster is None:
            raise field_error("cluster", "auto", "be a cluster file with strategy=hetero_deepspeed (it plans "
                              "from the cluster's figures)")
        if self.train.get("precision") != "32-true":
            raise field_error("train.precision", self.train.get("precision"),
                              "be 32-true with strategy=hetero_deepspeed in this version")
        if self.train.get("accumulate_grad_batches") != 1:
            raise field_error("train.accumulate_grad_batches", self.train.get("accumulate_grad_batches"),
                              "be 1 with strategy=hetero_deepspeed (the plan's micro-batches are the accumulation)")
        if self.checkpoint.get("every_n_steps") is not None or self.resume is not None:
            raise field_error("checkpoint.every_n_steps" if self.resume is None else "resume",
                              self.checkpoint.get("every_n_steps") if self.resume is None else self.resume,
                              "be null with strategy=hetero_deepspeed in het-train (its checkpoints resume at "
                              "epoch boundaries only; use the Python API's trainer.save_checkpoint)")

    def _straggler_args(self) -> dict[str, Any]:
        return {k: v for k, v in self.straggler.items() if k != "enabled"}

    @property
    def out_dir(self) -> Path:
        return Path(str(self.output.get("dir") or "."))


def run_train(job: TrainJob) -> dict[str, Any] | None:
    """Train; returns the run summary on rank 0 (None on other ranks)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    import het_strategy  # noqa: F401  (registers the strategy)
    from het_strategy.callbacks.throughput import ThroughputMonitor
    from het_strategy.demo.stdlib_text import CharDataset, stdlib_corpus
    from het_strategy import HeteroStrategy
    from het_strategy.callbacks.emulation import EmulatedDeviceCallback
    from het_strategy.emulation.speeds import cluster_is_emulated
    from het_strategy.demo.moe_gpt import build_char_model

    started = time.perf_counter()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.devices))
    pl.seed_everything(int(job.train["seed"]), workers=True, verbose=False)
    corpus = stdlib_corpus(max_bytes=int(job.data["max_bytes"]), val_fraction=float(job.data["val_fraction"]),
                           seed=int(job.data["seed"]))
    seq = job.model_cfg.seq_len
    train_set, val_set = CharDataset(corpus.train, seq), CharDataset(corpus.val, seq)
    if job.strategy == "hetero_deepspeed":  # every rank loads the whole global batch and cuts its micro-batches
        train_loader = DataLoader(train_set, batch_size=job.global_batch_size, shuffle=True, drop_last=True)
        val_loader = DataLoader(val_set, batch_size=job.global_batch_size, drop_last=True)
    else:
        per_rank = max(1, job.global_batch_size // job.devices)
        train_loader = DataLoader(train_set, batch_size=per_rank, shuffle=True)
        val_loader = DataLoader(val_set, batch_size=per_rank)
    routing = {k: v for k, v in job.moe.items() if k != "placement"}
    model = build_char_model(job.model_cfg, routing, lr=float(job.train["lr"]),
                             weight_decay=float(job.train["weight_decay"]))

    out = job.out_dir
    summary_path = out / str(job.output["summary"]) if job.output.get("summary") else None
    throughput = ThroughputMonitor(warmup_steps=min(3, max(0, job.train["max_steps"] - 2)),
                                   summary_path=None, verbose=False)
    callbacks: list[Any] = [throughput]
    cluster_source: Any = "auto" if job.auto_cluster else job.cluster
    if job.strategy == "hetero":
        # with cluster=auto the strategy profiles the model itself (per block, on every device type)
        strategy: Any = HeteroStrategy(cluster=cluster_source, workload=None if job.auto_cluster else job.workload,
                                       global_batch_size=job.global_batch_size,
                                       profile_input=model_input if job.auto_cluster else None,
                                       compression=job.compression,
                                       moe_placement=job.moe.get("placement", "planned"))
    elif job.strategy == "hetero_deepspeed":
        from het_strategy import HeteroDeepSpeedStrategy

        # rank 0 plans (planner.runtime=deepspeed) and broadcasts; emulated stages are padded per micro-batch
        strategy = HeteroDeepSpeedStrategy(cluster=job.cluster, workload=job.workload,
                                           global_batch_size=job.global_batch_size,
                                           planner_mode=job.planner.get("mode", "auto"))
    else:
        strategy = "ddp"
        if job.cluster is not None and cluster_is_emulated(job.cluster):
            callbacks.append(EmulatedDeviceCallback(cluster=job.cluster, workload=job.workload, dtype=job.dtype))
    straggler = None
    if job.straggler["enabled"]:
        from het_strategy.callbacks.straggler import StragglerMitigation

        straggler = StragglerMitigation(**job._straggler_args())
        callbacks.append(straggler)
    if job.compression is not None and job.compression.method != "none":
        from het_strategy.callbacks.compression import CompressionMonitor

        callbacks.append(CompressionMonitor())
    every = job.checkpoint.get("every_n_steps")
    if every is not None:
        from lightning.pytorch.callbacks import ModelCheckpoint

        # "step_20.ckpt", not Lightning's "step=20.ckpt": Hydra's override grammar refuses "=" in a value,
        # so `resume=<path>` works as printed
        callbacks.append(ModelCheckpoint(dirpath=str(out / "checkpoints"), filename="step_{step}",
                                         auto_insert_metric_name=False, every_n_train_steps=every, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator=job.accelerator, devices=job.devices, strategy=strategy,
        precision=job.train["precision"], max_steps=int(job.train["max_steps"]),
        accumulate_grad_batches=int(job.train["accumulate_grad_batches"]),
        val_check_interval=int(job.train["val_every_n_steps"]), check_val_every_n_epoch=None,
        limit_val_batches=int(job.train["val_batches"]), num_sanity_val_steps=0,
        logger=_loggers(job), callbacks=callbacks, enable_checkpointing=every is not None,
        enable_model_summary=False, default_root_dir=str(out), log_every_n_steps=1)
    trainer.fit(model, train_loader, val_loader, ckpt_path=job.resume)
    train_loss = trainer.callback_metrics.get("train_loss")
    trainer.limit_val_batches = 1.0  # the final validation sees every held-out sequence once
    full_val = trainer.validate(model, val_loader, verbose=False)
    if trainer.global_rank != 0:
        return None
    summary = dict(throughput.summary or {})
    summary.update({
        "strategy": job.strategy, "cluster": "auto" if job.auto_cluster else job.cluster.name,  # type: ignore[union-attr]
        "model": OmegaConf.to_container(job.cfg.model), "max_steps": int(job.train["max_steps"]),
        "final_train_loss": float(train_loss) if train_loss is not None else None,
        "final_val_loss": float(full_val[0]["val_loss"]) if full_val else None,
        "val_samples": (len(val_set) // job.global_batch_size * job.global_batch_size
                        if job.strategy == "hetero_deepspeed" else len(val_set)),  # whole global batches only
        "train_samples": len(train_set), "wall_s": time.perf_counter() - started,
    })
    if straggler is not None:
        from dataclasses import asdict

        summary["straggler_decisions"] = [asdict(d) for d in straggler.decisions]
    summary.update(_predicted_speedup(trainer.strategy, job))
    experts = getattr(trainer.strategy, "experts", None)
    if experts is not None:
        summary.update(experts.summary())
    summary.update(_compression_summary(trainer.strategy, job))
    _print_report(summary)
    if summary_path is not None:
        import json

        from het_strategy.core.atomic_file import write_atomic

        write_atomic(summary_path, json.dumps(summary, indent=2, default=str))
    return summary


def _compression_summary(strategy: Any, job: TrainJob) -> dict[str, Any]:
    """The compression config, the wire saving on rank 0 and the last per-layer decisions."""
    state = getattr(strategy, "compression_state", None)
    out: dict[str, Any] = {"compression": job.compression.to_dict() if job.compression else None}
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
    if job.logger == "none":
        return False
    from lightning.pytorch.loggers import CSVLogger

    loggers: list[Any] = [CSVLogger(save_dir=str(job.out_dir), name="csv")]
    if job.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(WandbLogger(project=str(job.wandb["project"]), save_dir=str(job.out_dir),
                                   mode=str(job.wandb["mode"]),
                                   config=OmegaConf.to_container(job.cfg, resolve=True)))
    return loggers


def _predicted_speedup(strategy: Any, job: TrainJob) -> dict[str, Any]:
    """The cost model's step time for the plan and for an even split of the same batch."""
    plan, cluster = getattr(strategy, "plan", None), getattr(strategy, "cluster", None)
    if plan is None or cluster is None:
        return {}
    if job.strategy == "hetero_deepspeed":
        from het_strategy.core.cost_model import CostModel, TrainSettings

        cm = CostModel(cluster, strategy.workload, TrainSettings(global_batch_size=job.global_batch_size,
                                                                 dtype="fp32"))
        stages = [[f"{s.devices[0]}[{s.layers[0]},{s.layers[1]})" for s in p.stages] for p in plan.pipelines]
        return {"plan_stages": stages, "plan_samples": [p.samples for p in plan.pipelines],
                "predicted_step_s": cm.score(plan).step_time_s, "plan_summary": strategy.plan_summary}
    from het_strategy.core.cost_model import CostModel, TrainSettings
    from het_strategy.planning.dp_split import equal_split_plan

    cm = CostModel(cluster, strategy.workload, TrainSettings(global_batch_size=job.global_batch_size,
                                                             dtype=job.dtype, micro_batch_sizes=(1,)),
                   strategy.profile)
    planned = cm.score(plan).step_time_s
    equal = cm.score(equal_split_plan(cm)).step_time_s
    return {"shares": strategy.current_shares(), "predicted_step_s": planned, "predicted_equal_step_s": equal,
            "predicted_speedup_vs_equal": equal / planned}


def _print_report(summary: dict[str, Any]) -> None:
    from het_strategy.callbacks.throughput import format_summary

    print(format_summary(summary))
    if "plan_stages" in summary:
        print("plan: " + " | ".join(" -> ".join(st) + f" x{n}" for st, n in zip(summary["plan_stages"],
                                                                              summary["plan_samples"]))
              + f"; predicted {summary['predicted_step_s']:.3f} s/step (cost model); {summary['plan_summary']}")
    if "shares" in summary:
        print(f"shares per rank: {summary['shares']}; predicted speed-up over an equal split "
              f"{summary['predicted_speedup_vs_equal']:.2f}x (cost model)")
    print(f"final train loss {summary['final_train_loss']:.4f}   validation loss {summary['final_val_loss']:.4f} "
          f"(all {summary['val_samples']} held-out sequences)   wall {summary['wall_s']:.1f} s", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(_USAGE.format(clusters=", ".join(shipped_names("cluster") + ["auto"])))
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
        cfg, auto = compose_train_config(args)
        if show_cfg:
            print(OmegaConf.to_yaml(cfg))
            return 0
        run_train(TrainJob(cfg, auto))
        return 0

    return run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
