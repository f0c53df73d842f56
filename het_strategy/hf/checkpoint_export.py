"""A trained plan, or a per-layer checkpoint of one, written as a Hugging Face ``save_pretrained`` directory.

``save_pretrained_from_runner(runner, config, dir)`` (every rank calls it; a collective) gathers the model layer by
layer to the writing rank (global rank 0): the ranks of replica 0's stage holding a layer send it (each tp rank
its shards, tp rank 0 the replicated tensors), the writer joins the shards (column-parallel along dim 0,
row-parallel along dim 1, each fused projection alone) and writes that layer's file before the next layer is
sent, so it never holds more than one layer of another rank.  Every replica holds the same values after a step,
so replica 0's are every replica's.  ``save_hf_checkpoint(trainer, dir)`` is the same after ``Trainer.fit`` on
``hetero_deepspeed``; ``save_units(units, config, dir)`` writes the units one process holds.

``write_layer_values(config, layers, dir)`` writes per-layer values keyed as the runtime's per-layer checkpoint
keeps them (``ds_runtime.layer_export`` reads them from a checkpoint) by the names of the model's pipeline units
(``hf_names()``), without a training run.  A tied matrix is written once, under the embedding's
name, as ``save_pretrained`` writes it.  Both write through ``checkpoint_files.DirectoryWriter`` (one file per
layer, renamed into place when complete).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_zero_info
from het_strategy.hf.checkpoint_files import DirectoryWriter

__all__ = ["WRITER_RANK", "save_units", "save_pretrained_from_runner", "save_hf_checkpoint", "write_layer_values",
           "hf_config_of"]

WRITER_RANK = 0
"""The global rank that writes the directory."""


def hf_config_of(config: Any) -> Any:
    """A ``PretrainedConfig`` from itself, a ``config.json`` path or a directory holding one."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    path = Path(config)
    if not (path.is_file() or (path / "config.json").is_file()):
        raise field_error("config", str(config), "be a PretrainedConfig, a config.json or a directory holding one")
    if path.is_file():
        return AutoConfig.for_model(**json.loads(path.read_text()))
    return AutoConfig.from_pretrained(str(path))


def _replica0_group(layout: Any, layer: int) -> tuple[int, ...]:
    """The ranks (tp order) of replica 0's stage holding ``layer``."""
    parts = layout.parts[0]
    stage = next(s for s in range(len(parts) - 1) if parts[s] <= layer < parts[s + 1])
    return layout.stage_groups[0][stage]


def _local_tensors(unit: Any, tp_rank: int, seen: set[int]) -> dict[str, tuple[torch.Tensor, Any]]:
    """``{hf name: (tensor on the CPU, (dim, fused) of a tp shard or None)}`` this rank sends of ``unit``: its
    shards, and (tp rank 0) its replicated tensors; a tensor already sent under another name (tied) is left out."""
    from het_strategy.tensor_parallel.layers import SOURCE

    plan = unit.tensor_parallel_plan() if callable(getattr(unit, "tensor_parallel_plan", None)) else None
    specs = plan.shard_specs() if plan is not None else {}
    names = unit.hf_names()
    out = {}
    for key, t in unit.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        shard = hasattr(t, SOURCE) and key in specs
        if shard or tp_rank == 0:
            spec = (specs[key].dim, specs[key].fused) if shard else None
            out[names[key]] = (t.detach().to("cpu").clone(), spec)
    return out


def _whole(parts: list[torch.Tensor], spec: tuple[int, int]) -> torch.Tensor:
    """The whole tensor from its tp shards in tp order (``spec``: the split dim and fused projections)."""
    dim, fused = spec
    if fused == 1:
        return torch.cat(parts, dim)
    views = [p.unflatten(dim, (fused, p.shape[dim] // fused)) for p in parts]
    return torch.cat(views, dim + 1).flatten(dim, dim + 1)


def _join(payloads: list[dict[str, tuple[torch.Tensor, Any]]]) -> dict[str, torch.Tensor]:
    """One layer's tensors from the payloads of its tp ranks (tp order)."""
    out = {}
    for name, (t, spec) in payloads[0].items():
        out[name] = t if spec is None else _whole([p[name][0] for p in payloads], spec)
    return out


def save_units(units: list[Any], config: Any, directory: str | Path) -> Path:
    """Write the pipeline units of a whole model held by this process (none split for tp) as a ``save_pretrained``
    directory, one file per unit."""
    writer = DirectoryWriter(directory, len(units))
    seen: set[int] = set()
    try:
        for i, unit in enumerate(units):
            mine = _local_tensors(unit, 0, seen)
            split = [name for name, (_, spec) in mine.items() if spec is not None]
            if split:
                raise field_error(f"units[{i}]", split[0], "be whole (a tp shard is saved with "
                                  "save_pretrained_from_runner, which gathers the other ranks' shards)")
            writer.add_layer(_join([mine]))
        return writer.finish(config)
    except BaseException:
        writer.abort()
        raise


def save_pretrained_from_runner(runner: Any, config: Any, directory: str | Path) -> Path:
    """Write the model ``runner`` (a ``PlanRunner``) trains as a ``save_pretrained`` directory; every rank calls
    it.  ``config``: the model's ``PretrainedConfig`` (its ``config.json``)."""
    import torch.distributed as dist

    if runner.plan.zero_stage == 3:
        raise field_error("plan.zero_stage", 3, "be 0, 1 or 2 to save a Hugging Face directory (ZeRO 3 "
                          "partitions each parameter)")
    layout, rank = runner.layout, runner.rank
    units = {int(n): m for n, m in runner.engine.module.named_children() if n.isdigit()}
    writer = DirectoryWriter(directory, layout.num_layers) if rank == WRITER_RANK else None
    seen: set[int] = set()
    try:
        for layer in range(layout.num_layers):
            group = _replica0_group(layout, layer)
            mine = _local_tensors(units[layer], group.index(rank), seen) if rank in group else None
            if writer is not None:
                payloads = []
                for src in group:
                    if src == rank:
                        payloads.append(mine)
                    else:
                        got: list[Any] = [None]
                        dist.recv_object_list(got, src=src)
                        payloads.append(got[0])
                writer.add_layer(_join(payloads))
            elif mine is not None:
                dist.send_object_list([mine], dst=WRITER_RANK)
        if writer is not None:
            writer.finish(config)
            rank_zero_info(rank, "saved %s: %d tensors, %.1f MB, one safetensors file per pipeline unit", directory,
                           len(writer.weight_map), writer.total_size / 1e6)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    dist.barrier()  # the directory is complete before any rank goes on (and may read it)
    return Path(directory)


def save_hf_checkpoint(trainer: Any, directory: str | Path) -> Path:
    """After ``trainer.fit`` on ``hetero_deepspeed``: write the Hugging Face model the LightningModule holds, as
    trained, to ``directory`` (``save_pretrained`` form); every rank calls it."""
    from het_strategy.hf.lightning_adapter import hf_model_of

    runner = getattr(getattr(trainer.strategy, "run", None), "runner", None)
    if runner is None:
        raise field_error("trainer.strategy", type(trainer.strategy).__name__, "be hetero_deepspeed after fit "
                          "(its PlanRunner holds the trained layers)")
    model = hf_model_of(trainer.lightning_module)
    if model is None:
        raise field_error("trainer.lightning_module", type(trainer.lightning_module).__name__,
                          "hold a Hugging Face causal LM")
    return save_pretrained_from_runner(runner, model.config, directory)


def write_layer_values(config: Any, layers: Iterable[Mapping[str, torch.Tensor]], directory: str | Path,
                       dtype: torch.dtype | None = None, field: str = "checkpoint", num_layers: int | None = None
                       ) -> Path:
    """Write per-layer values (``layers``: one mapping per pipeline unit, in order, keyed by the names in the unit
    as the runtime's per-layer checkpoint keeps them) as a ``save_pretrained`` directory for the model of
    ``config`` (a ``PretrainedConfig``, a ``config.json`` or a directory holding one); ``dtype``: cast the values
    (default: as given); ``num_layers``: the layers the source holds, checked before anything is written."""
    from transformers import AutoModelForCausalLM

    from het_strategy.hf.pipeline_units import hf_pipeline_units

    config = hf_config_of(config)
    with torch.device("meta"):
        units = hf_pipeline_units(AutoModelForCausalLM.from_config(config))
    if num_layers is not None and num_layers != len(units):
        raise field_error("config", config.model_type, f"give the {field}'s {num_layers} layers (its model has "
                          f"{len(units)} pipeline units)")
    writer = DirectoryWriter(directory, len(units))
    try:
        count = 0
        for layer, values in enumerate(layers):
            if layer >= len(units):
                raise field_error("config", config.model_type, f"give the checkpoint's layers (its model has "
                                  f"{len(units)} pipeline units, the checkpoint more)")
            unit = units[layer]
            names, shapes = unit.hf_names(), {k: tuple(t.shape) for k, t in unit.state_dict().items()}
            tensors = {}
            for key, value in values.items():
                if key not in names or tuple(value.shape) != shapes[key]:
                    raise field_error(f"{field} layer {layer}.{key}", tuple(value.shape), "be a tensor of the "
                                      f"config's model (its layer {layer} has {shapes})")
                tensors[names[key]] = value.to(dtype) if dtype is not None else value
            writer.add_layer(tensors)
            count += 1
        if count != len(units):
            raise field_error("config", config.model_type, f"give the checkpoint's {count} layers (its model has "
                              f"{len(units)} pipeline units)")
        return writer.finish(config)
    except BaseException:
        writer.abort()
        raise
