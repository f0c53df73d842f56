"""het-train strategy=hetero_fsdp: bad options stop in one line before any worker; the planner mode goes with the
strategy that runs it; a short run on unequal memories trains with shards by memory and shares by speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from het_strategy.cli.train_cli import build_strategy, compose_train_config, main
from het_strategy.cli.train_job import TrainJob

MEMORY_CLUSTER = """\
name: local_cpu2_mem_4_1
description: 2 emulated CPU ranks of speeds 1 and 0.5 and memories 4 and 1 GiB (the smoke preset's devices).
inter_node_bandwidth_gbs: 1
nodes:
  - name: local
    intra_bandwidth_gbs: 1
    devices:
      - {name: rank0, type: CPU, tflops: {fp32: 0.008}, efficiency: 1.0, emulated_speed: 1.0, memory_gb: 4}
      - {name: rank1, type: CPU, tflops: {fp32: 0.008}, efficiency: 1.0, emulated_speed: 0.5, memory_gb: 1}
"""


@pytest.mark.parametrize("overrides, message", [
    (["strategy.units=3"], "`strategy.units` is 3; it must be a non-empty list of the model's block names"),
    (["strategy.units=[blocks.9]"], "`strategy.units[0]` is 'blocks.9'; it must name a submodule with parameters of "
                                    "het-train's char GPT (its blocks: blocks.0, blocks.1, blocks.2, blocks.3)"),
    (["strategy.units=[blocks.0,blocks.0.attn]"], "`strategy.units[1]` is 'blocks.0.attn'; it must be distinct "
                                                  "from and not nested in `blocks.0`"),
    (["strategy.prefetch=maybe"], "`strategy.prefetch` is 'maybe'; it must be true or false"),
    (["strategy.activation_checkpointing=2"], "`strategy.activation_checkpointing` is 2; it must be true or false"),
    (["+strategy.find_unused_parameters=true"], "`strategy.find_unused_parameters` is True; it must not be there"),
    (["compression=q4"], "`compression.method` is 'q4'; it must be none with strategy=hetero_fsdp (its gradients "
                         "are reduce-scattered by its own uneven collectives"),
    (["compression=planned"], "`compression` is 'planned'; it must go with strategy=hetero, not "
                              "strategy=hetero_fsdp (its gradients are reduce-scattered"),
    (["train.precision=per_device"], "`train.precision` is 'per_device'; it must go with strategy=hetero or "
                                     "hetero_deepspeed, not hetero_fsdp"),
    (["planner.mode=pipeline"], "`planner.mode` is 'pipeline'; it must be auto or fsdp with strategy=hetero_fsdp"),
    (["train.max_tp=2"], "`train.max_tp` is 2; it must be 1 with strategy=hetero_fsdp"),
    (["cluster=auto", "devices=2"], "`cluster` is 'auto'; it must be a cluster file with strategy=hetero_fsdp"),
    (["checkpoint.async_save=true"], "`checkpoint.async_save` is True; it must be false with strategy=hetero_fsdp"),
    (["resume=/nonexistent.ckpt"], "`resume` is '/nonexistent.ckpt'; it must be a checkpoint directory with "
                                   "strategy=hetero_fsdp"),
    (["model=moe_gpt_tiny"], "`strategy` is 'hetero_fsdp'; it must be hetero or ddp for a model with experts"),
    (["straggler.enabled=true"], "`straggler.enabled` is True; it must go with strategy=hetero"),
    (["elastic.enabled=true", "checkpoint.every_n_steps=2"], "`elastic.enabled` is True; it must go with "
                                                            "strategy=hetero or hetero_deepspeed, not hetero_fsdp"),
])
def test_bad_options_are_one_line_naming_the_field(overrides: list[str], message: str, no_training: None,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["strategy=hetero_fsdp", "cluster=local_cpu2", *overrides])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("het-train: error:") and "\n" not in err, err
    assert message in err, err


@pytest.mark.parametrize("strategy", ["hetero", "ddp", "hetero_deepspeed"])
def test_planner_mode_fsdp_goes_with_strategy_hetero_fsdp_alone(strategy: str, no_training: None,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main([f"strategy={strategy}", "cluster=local_cpu2", "planner.mode=fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"het-train: error: `planner.mode` is 'fsdp'; it must go with strategy=hetero_fsdp, not "
                   f"{strategy} (only hetero_fsdp runs fully sharded plans) (use strategy=hetero_fsdp)"), err


@pytest.mark.parametrize("mode", ["auto", "fsdp"])
def test_the_options_reach_the_strategy(mode: str) -> None:
    """planner.mode auto or fsdp, the node's keys passed to HeteroFSDPStrategy as given (nothing launched)."""
    cfg, _ = compose_train_config(["strategy=hetero_fsdp", "cluster=local_cpu2", f"planner.mode={mode}",
                                   "strategy.units=[blocks.0,blocks.2]", "strategy.prefetch=false",
                                   "strategy.activation_checkpointing=true", "train.global_batch_size=12"])
    job = TrainJob(cfg)
    strategy, callbacks = build_strategy(job)
    extension = strategy.run.extension
    assert type(strategy).__name__ == "HeteroFSDPStrategy" and callbacks == []
    assert (extension.units, extension.prefetch, extension.activation_checkpointing) == (["blocks.0", "blocks.2"],
                                                                                        False, True)
    assert strategy.run.batches.global_batch_size == 12


@pytest.mark.multiprocess
@pytest.mark.slow
def test_het_train_hetero_fsdp_shards_by_memory_and_splits_by_speed(tmp_path: Path) -> None:
    """`het-train experiment=smoke strategy=hetero_fsdp` on memories 4 : 1 and speeds 1 : 0.5, 2 steps: the plan is
    mode fsdp, rank 0 keeps ~4/5 of every unit (each rank's elements as ``shard_sizes`` cuts the two units), the
    faster rank takes more samples, the loss falls below its initial ln(256), and the checkpoint is a
    torch.distributed.checkpoint directory."""
    import torch

    from het_strategy.core.shard_sizes import shard_sizes
    from het_strategy.demo.char_gpt import CharGPT

    cluster = tmp_path / "mem_4_1.yaml"
    cluster.write_text(MEMORY_CLUSTER)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "het_strategy.cli.train_cli", "experiment=smoke", "strategy=hetero_fsdp",
           f"cluster={cluster}", "train.max_steps=2", "train.val_every_n_steps=2", "logger=none",
           "checkpoint.every_n_steps=2", f"output.dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["strategy"] == "hetero_fsdp" and summary["plan_mode"] == "fsdp"
    shares = summary["shares"]
    assert sum(shares) == 8 and shares[0] > shares[1] > 0  # speeds 1 : 0.5
    fractions = [summary["shards"][d] for d in ("rank0", "rank1")]
    assert sum(fractions) == pytest.approx(1, abs=1e-9) and fractions[0] == pytest.approx(0.8, abs=0.01)
    with torch.device("meta"):
        model = CharGPT(num_layers=1, hidden_size=32, num_heads=4, seq_len=32)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - block
    assert summary["fsdp_units"] == ["root", "blocks.0"]
    assert summary["shard_elements"] == [a + b for a, b in zip(shard_sizes(root, fractions),
                                                               shard_sizes(block, fractions))]
    assert summary["predicted_step_s"] > 0 and summary["predicted_even_fsdp_step_s"] > 0
    assert summary["final_train_loss"] < 5.545 and summary["final_val_loss"] < 5.545  # ln(256) at initialisation
    assert summary["val_samples"] > 0  # the full validation after fit ran, on the whole module
    assert (tmp_path / "checkpoints" / "step_2.ckpt" / ".metadata").is_file()
    assert f"hetero_fsdp: shares per rank {shares}; shards rank0 0.800, rank1 0.200 of each of 2 units" in proc.stdout
