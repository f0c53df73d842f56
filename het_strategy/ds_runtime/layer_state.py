"""A pipeline checkpoint in a form any plan can load: each layer's fp32 parameters and optimizer state, one file each.

DeepSpeed's checkpoint of a plan is cut the way that plan runs: optimizer
state per stage (and per replica, per data-parallel shard), in flat buffers
whose layout follows the stage's layers.  Beside it ``write_layer_states``
writes ``<checkpoint>/layers/``: ``layer_XXX.pt`` per layer (each parameter's
fp32 value and per-parameter optimizer state, whole) and ``manifest.json``
(``read_manifest``).  ``read_layer_states`` loads them into a ``PlanRunner`` of
another plan (other stage boundaries, replicas, world size or ZeRO stage 0 / 1);
``reshard_problem`` says why a plan can do neither (tensor-parallel stages,
fp16 on DeepSpeed's own fp16 optimizers, ZeRO 2 and 3).

Invariants:

- every replica holds the same values after a step (the gradients are reduced
  before it), so one holder's copy is every holder's: the lowest rank holding
  a layer writes it;
- a value is read and set three ways, each the same on every holder: through
  DeepSpeed's accessors where its optimizer keeps flat fp32 partitions (a
  collective over the stage's data-parallel group, which every holder calls in
  the same order), through ``HolderSetSharding`` where a per-replica plan
  shards it, and from the torch optimizer's ``state`` otherwise;
- files are read as data (``checkpoint_files.load_as_data``) and written under
  a temporary name, then renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from het_strategy.core.errors import field_error
from het_strategy.core.runtime_rules import holds_own_masters
from het_strategy.ds_runtime.checkpoint_files import load_as_data

if TYPE_CHECKING:
    from het_strategy.ds_runtime.engine import PlanRunner

__all__ = ["LAYERS_DIR", "LAYER_STATE_FORMAT", "write_layer_states", "read_layer_states", "read_manifest",
           "reshard_problem"]

LAYERS_DIR = "layers"
"""The subdirectory of a checkpoint that holds the per-layer files."""
LAYER_STATE_FORMAT = 1
"""The version of the per-layer files' layout (``manifest.json``'s ``format``)."""


def _layer_params(runner: PlanRunner) -> dict[int, list[tuple[str, torch.nn.Parameter]]]:
    """This rank's parameters by global layer, as (name in the layer, parameter), in module order."""
    from het_strategy.ds_runtime.holder_reduction import layer_parameters

    return layer_parameters(runner.engine.module)


def _mixed(runner: PlanRunner) -> bool:
    """The optimizer keeps fp32 partitions behind DeepSpeed's accessors (``_hp_mapping`` on the parameters)."""
    return any(getattr(q, "_hp_mapping", None) is not None for q in runner.engine.module.parameters())


def _inner_optimizer(runner: PlanRunner) -> Any:
    opt = runner.engine.optimizer
    return getattr(opt, "optimizer", opt) if _mixed(runner) else opt


def _state_keys(runner: PlanRunner) -> list[str]:
    """The per-parameter tensor entries of the optimizer's state (``exp_avg``, ``momentum_buffer``, ...)."""
    for entry in _inner_optimizer(runner).state.values():
        return sorted(k for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0)
    return []


def _step_of(runner: PlanRunner) -> Any:
    for entry in _inner_optimizer(runner).state.values():
        if "step" in entry:
            step = entry["step"]
            return float(step) if torch.is_tensor(step) else step
    return None


def reshard_problem(runner: PlanRunner) -> str | None:
    """Why this runner's plan cannot write or read per-layer state (the field and rule), or None."""
    plan = runner.plan
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            if stage.tp > 1:
                return f"plan.pipelines[{p}].stages[{s}].tp is {stage.tp}; it must be 1 (a shard's state is not a " \
                       "whole parameter's)"
    if plan.dtype == "fp16" and not holds_own_masters(plan):
        return "plan.dtype is 'fp16'; it must be fp32 or bf16, or run per replica at ZeRO 1 (DeepSpeed's " \
               "FP16_Optimizer keeps no per-parameter mapping)"
    if plan.zero_stage > 1:
        return f"plan.zero_stage is {plan.zero_stage}; it must be 0 or 1"
    return None


def write_layer_states(runner: PlanRunner, path: str | Path, client_keys: list[str]) -> bool:
    """Write ``path/layers/``; a collective over the ranks holding each layer.  False (nothing written) when the
    plan cannot (``reshard_problem``).

    - ``layer_XXX.pt`` for every layer ``XXX`` of the model, written by the
      lowest rank holding it (``ReplicaLayout.layer_holders``): for each of the
      layer's parameters (by its name in the layer) the fp32 value and the
      optimizer's per-parameter state (Adam's ``exp_avg`` / ``exp_avg_sq``, SGD's
      ``momentum_buffer``, ``step``), whole;
    - ``manifest.json`` (rank 0): the format, the layer count, the dtype, the
      optimizer's class, DeepSpeed's step counters, the client state's keys and
      the fp16 loss scaler's state where the holder sets keep one.

    Each value is read with DeepSpeed's own accessors where a mixed-precision or
    ZeRO optimizer keeps it in flat fp32 partitions
    (``deepspeed.utils.safe_get_full_fp32_param`` /
    ``safe_get_full_optimizer_state``: collectives over the stage's data-parallel
    group, which every holder of the stage calls in the same order), gathered
    from the holder sets where a per-replica plan shards it there
    (``holder_sharding.HolderSetSharding.full_state``, and ``full_values``: the
    fp32 masters of bf16 parameters), and from the torch optimizer's ``state``
    otherwise (fp32 at ZeRO 0).
    """
    import deepspeed.comm as ds_dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    if reshard_problem(runner) is not None:
        return False
    out = Path(path) / LAYERS_DIR
    out.mkdir(parents=True, exist_ok=True)
    mixed, keys = _mixed(runner), _state_keys(runner)
    inner = _inner_optimizer(runner)
    # ZeRO-1 within holder sets: each parameter's state gathered whole (a collective over every holder set)
    gathered = runner.sharding.full_state() if runner.sharding is not None else None
    masters = runner.sharding.full_values() if runner.sharding is not None and runner.sharding.mixed else None
    for layer, params in sorted(_layer_params(runner).items()):
        writer = runner.layout.layer_holders(layer)[0] == runner.rank
        if not (writer or mixed):  # DeepSpeed's accessors are collectives every holder calls; the others are not
            continue
        entries = {}
        for name, q in params:
            if mixed:
                value = safe_get_full_fp32_param(q)
                state = {k: safe_get_full_optimizer_state(q, k) for k in keys}
            else:
                value = masters[id(q)] if masters is not None else q.detach()
                held = gathered.get(id(q), {}) if gathered is not None else inner.state.get(q, {})
                state = {k: v for k, v in held.items() if torch.is_tensor(v) and v.dim() > 0}
            entries[name] = {"value": value.detach().to("cpu", torch.float32 if value.dtype != torch.float64
                                                        else torch.float64).clone(),
                             "state": {k: v.detach().cpu().clone() for k, v in state.items() if v is not None}}
        if writer:
            _save(out / f"layer_{layer:03d}.pt", entries)
    if runner.rank == 0:
        manifest = {"format": LAYER_STATE_FORMAT, "num_layers": runner.layout.num_layers,
                    "dtype": str(runner.plan.dtype), "optimizer": type(inner).__name__, "step": _step_of(runner),
                    "global_steps": int(runner.engine.global_steps),
                    "global_samples": int(getattr(runner.engine, "global_samples", 0)),
                    "client_keys": sorted(client_keys),
                    "loss_scale": runner.sharding.scaler_state() if runner.sharding is not None else None}
        part = out / ".manifest.json.part"
        part.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(part, out / "manifest.json")
    ds_dist.barrier()
    return True


def _save(path: Path, entries: dict[str, Any]) -> None:
    part = path.with_name(f".{path.name}.part")
    torch.save(entries, part)
    os.replace(part, path)


def read_manifest(path: str | Path, field: str = "ckpt_path") -> dict[str, Any] | None:
    """The checkpoint's ``layers/manifest.json``, or None when it has none."""
    file = Path(path) / LAYERS_DIR / "manifest.json"
    if not file.is_file():
        return None
    manifest = json.loads(file.read_text())
    if manifest.get("format") != LAYER_STATE_FORMAT:
        raise field_error(field, str(path), f"hold per-layer state of format {LAYER_STATE_FORMAT} (it has "
                          f"{manifest.get('format')!r})")
    return manifest


def read_layer_states(runner: PlanRunner, path: str | Path, manifest: dict[str, Any], field: str = "ckpt_path"
                      ) -> None:
    """Load ``path/layers/`` into this rank's engine; every rank calls it.

    Each rank copies its layers' values into its parameters (and the fp32 master
    copies) and sets its optimizer's state per parameter the same three ways
    ``write_layer_states`` reads them.  Not covered, each refused in one line
    naming the field: tensor-parallel stages (a shard's state is not a whole
    parameter's), another dtype, another layer count, fp16 on DeepSpeed's own fp16
    optimizers (``FP16_Optimizer`` keeps no per-parameter mapping; fp16 per replica
    at ZeRO 1 and ``per_device`` plans keep their masters in the holder sets, and
    the one loss scale goes in the manifest), ZeRO 2 and 3.
    """
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    problem = reshard_problem(runner)
    if problem is not None:
        raise field_error(field, str(path), f"load into a plan whose layers are whole on each rank: {problem}")
    if manifest["num_layers"] != runner.layout.num_layers:
        raise field_error("plan.model.num_layers", runner.layout.num_layers, f"equal the checkpoint's "
                          f"{manifest['num_layers']} layers")
    if manifest["dtype"] != str(runner.plan.dtype):
        raise field_error("plan.dtype", str(runner.plan.dtype), f"be the checkpoint's {manifest['dtype']} (its "
                          "optimizer state is kept as that dtype's optimizer keeps it)")
    mixed, inner = _mixed(runner), _inner_optimizer(runner)
    if manifest["optimizer"] != type(inner).__name__:
        raise field_error("optimizer", type(inner).__name__, f"be the checkpoint's {manifest['optimizer']}")
    files = {}
    for layer in sorted(_layer_params(runner)):
        file = Path(path) / LAYERS_DIR / f"layer_{layer:03d}.pt"
        if not file.is_file():
            raise field_error(field, str(path), f"hold {LAYERS_DIR}/{file.name} (layer {layer})")
        files[layer] = load_as_data(file)
    if mixed:
        keys = sorted({k for saved in files.values() for entry in saved.values() for k in entry["state"]})
        _link_optimizer_state(runner, keys, manifest.get("step"))
    sharded: dict[int, dict[str, torch.Tensor]] = {}
    values: dict[int, torch.Tensor] = {}
    for layer, params in sorted(_layer_params(runner).items()):
        saved = files[layer]
        for name, q in params:
            if name not in saved:
                raise field_error(field, str(path), f"hold parameter `{name}` of layer {layer} (its file has "
                                  f"{sorted(saved)})")
            entry = saved[name]
            value = entry["value"]
            if tuple(value.shape) != tuple(q.shape):
                raise field_error(field, str(path), f"hold layer {layer}'s `{name}` in shape {tuple(q.shape)} "
                                  f"(it has {tuple(value.shape)})")
            with torch.no_grad():
                q.data.copy_(value.to(q.dtype))
            if mixed:
                safe_set_full_fp32_param(q, value.to(torch.float32))
                for key, tensor in entry["state"].items():
                    safe_set_full_optimizer_state(q, tensor.to(torch.float32), key)
            elif runner.sharding is not None:
                values[id(q)] = value
                sharded[id(q)] = entry["state"]  # set_full_state casts each slice to its chunk's dtype
            elif entry["state"]:
                state = inner.state[q]
                for key, tensor in entry["state"].items():
                    state[key] = tensor.to(q.dtype).clone()
                if manifest.get("step") is not None:
                    state["step"] = torch.tensor(float(manifest["step"]))
    if runner.sharding is not None:
        runner.sharding.set_full_values(values)  # the fp32 masters (bf16 parameters), not their rounding
        runner.sharding.set_full_state(sharded, manifest.get("step"))
        runner.sharding.load_scaler_state(manifest.get("loss_scale"))  # fp16: one scale for the whole run
    runner.engine.global_steps = int(manifest["global_steps"])
    runner.engine.global_samples = int(manifest["global_samples"])


def _link_optimizer_state(runner: PlanRunner, keys: list[str], step: Any) -> None:
    """Give a mixed-precision optimizer that has not stepped yet its per-partition state (``keys`` as zeros, the
    saved ``step``) and link its parameters to it, as its first step would (``_lazy_init_hp_params_optimizer_state``
    of ``BF16_Optimizer`` and ZeRO 1/2): DeepSpeed's accessors then reach each parameter's slice."""
    opt = runner.engine.optimizer
    inner = opt.optimizer
    for group in inner.param_groups:
        for flat in group["params"]:
            state = inner.state[flat]
            for key in keys:
                if key not in state:
                    state[key] = torch.zeros_like(flat)
            if step is not None:
                state["step"] = torch.tensor(float(step))
    link = getattr(opt, "_lazy_init_hp_params_optimizer_state", None)
    if link is None:
        raise field_error("optimizer", type(opt).__name__, "be DeepSpeed's BF16_Optimizer or ZeRO 1 optimizer to "
                          "load per-layer state into")
    link()
