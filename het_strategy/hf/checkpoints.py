"""Start a plan from a Hugging Face ``save_pretrained`` directory: each rank reads only its own layers.

1. ``empty_causal_lm(dir)`` builds the directory's causal LM on the meta device (no weights in memory; its
   rotary tables, buffers that no file holds, computed on the CPU).
2. ``load_units(units, dir)`` materializes the given pipeline units (``hf.pipeline_units``) on the CPU and loads
   each tensor by its Hugging Face name (``unit.hf_names()``).  A tensor-parallel shard (a parameter carrying
   ``tensor_parallel.layers.SOURCE``) reads only its own slice of the stored tensor (``get_slice``): dim 0
   chunks for a column-parallel linear, dim 1 for a row-parallel one.  A tied head (``tie_word_embeddings``)
   reads the embedding matrix: one tensor, shared by both units, is read once from the first of its names
   stored, and a head on a stage of its own reads the embedding's name (``tied_aliases``).
3. ``load_rank_units(module, dir, (start, stop))`` does this for the layers the plan gives a rank (the
   ``hetero_deepspeed`` strategy calls it in ``setup`` when given ``pretrained=dir``) and releases the rest
   (``release_unheld``: a meta tensor becomes an empty one, so Lightning can move the module to its device).
   On a tensor-parallel stage (``split=True``) the tensors its tp plan cuts stay unread (empty): the returned
   ``ShardLoad`` is the runtime's ``load_layers`` hook, which gives them their stored shape on the meta device
   before the split (``prepare``) and reads each rank's shards after it (``load``).

The directory's config must match the model's in every field that shapes the weights (``check_config``); a
tensor of another shape, or one the directory lacks, is refused naming it.  Tensors are read by the model's own
names: a directory in the layout transformers converts on load (``save_pretrained`` of Mixtral or Qwen-MoE keeps
one tensor per expert) is refused in one line saying so; the writers here keep the model's names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from het_strategy.core.errors import field_error
from het_strategy.hf.checkpoint_files import PretrainedDirectory, check_config

__all__ = ["empty_causal_lm", "load_units", "load_rank_units", "tied_aliases", "release_unheld", "held_bytes",
           "split_tensors", "ShardLoad"]


def empty_causal_lm(directory: str | Path, field: str = "pretrained") -> Any:
    """The causal LM of ``directory``'s ``config.json``, its parameters on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    PretrainedDirectory(directory, field)  # refuse a directory without a config or weights before building
    config = AutoConfig.from_pretrained(str(directory))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _compute_buffers(model, config)
    return model


def _compute_buffers(model: nn.Module, config: Any) -> None:
    """Rebuild on the CPU each submodule holding a non-persistent meta buffer (the rotary tables: computed from the
    config, in no file), keeping its other state."""
    for name, sub in list(model.named_modules()):
        keep = set(sub.state_dict(keep_vars=True))
        meta = [n for n, b in sub.named_buffers(recurse=False) if b.is_meta and n not in keep]
        if not meta:
            continue
        try:
            with torch.device("cpu"):
                fresh = type(sub)(config=config)
        except TypeError:
            raise field_error(f"{name}.{meta[0]}", "on the meta device", "be computable from the config (a "
                              "module built as type(module)(config=config))") from None
        for n in meta:
            setattr(sub, n, dict(fresh.named_buffers(recurse=False))[n])


def _materialize(units: Sequence[nn.Module], skip: frozenset[int] = frozenset()) -> None:
    """Every meta parameter and buffer of ``units`` (but those whose id is in ``skip``) becomes an uninitialized CPU
    tensor; one shared by several modules (a tied matrix) stays one tensor, and a tensor-parallel shard keeps its
    link to its whole parameter."""
    from het_strategy.tensor_parallel.layers import SOURCE

    made: dict[int, torch.Tensor] = {}
    for unit in units:
        for module in unit.modules():
            for name, q in list(module.named_parameters(recurse=False)):
                if q.is_meta and id(q) not in skip:
                    if id(q) not in made:
                        made[id(q)] = nn.Parameter(torch.empty_like(q, device="cpu"), requires_grad=q.requires_grad)
                        if hasattr(q, SOURCE):
                            setattr(made[id(q)], SOURCE, getattr(q, SOURCE))
                    setattr(module, name, made[id(q)])
            for name, b in list(module.named_buffers(recurse=False)):
                if b.is_meta:
                    made.setdefault(id(b), torch.empty_like(b, device="cpu"))
                    setattr(module, name, made[id(b)])


def _shard_ranges(unit: nn.Module, key: str, stored: tuple[int, ...], local: tuple[int, ...], tp_rank: int
                  ) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(dim, ranges)`` of tp rank ``tp_rank``'s shard ``key`` (shape ``local``) of a stored tensor ``stored``:
    each fused projection cut into equal parts, as ``tensor_parallel.layers.shard_of`` cuts it."""
    plan = unit.tensor_parallel_plan() if callable(getattr(unit, "tensor_parallel_plan", None)) else None
    spec = plan.shard_specs().get(key) if plan is not None else None
    if spec is None:
        raise field_error(f"{type(unit).__name__}.{key}", local, "be a tensor-parallel shard of a linear the "
                          "unit's tensor_parallel_plan() splits")
    n = stored[spec.dim] // spec.fused
    per = local[spec.dim] // spec.fused
    return spec.dim, tuple((f * n + tp_rank * per, f * n + (tp_rank + 1) * per) for f in range(spec.fused))


@torch.no_grad()
def load_units(units: Sequence[nn.Module], directory: str | Path | PretrainedDirectory, *, tp_rank: int = 0,
               aliases: dict[str, str] | None = None, skip: frozenset[int] = frozenset(), only_meta: bool = False
               ) -> dict[str, str]:
    """Materialize ``units`` on the CPU and load each tensor of their ``state_dict()`` from ``directory`` by its
    Hugging Face name; returns ``{hf name: unit key}`` of what was read.  ``tp_rank``: the tensor-parallel rank of
    units already split (their shards read only their slice).  ``aliases``: a name -> the stored name read in its
    place when the directory lacks it (a tied head -> the embedding, ``tied_aliases``).  ``skip``: ids of tensors
    left on the meta device, unread; ``only_meta``: read only the tensors still on the meta device."""
    from het_strategy.tensor_parallel.layers import SOURCE

    files = directory if isinstance(directory, PretrainedDirectory) else PretrainedDirectory(directory)
    pending = ({(i, k) for i, u in enumerate(units) for k, t in u.state_dict(keep_vars=True).items() if t.is_meta}
               if only_meta else None)
    _materialize(units, skip)
    names: dict[int, list[tuple[nn.Module, str, str]]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for i, unit in enumerate(units):
        hf = unit.hf_names()
        for key, t in unit.state_dict(keep_vars=True).items():
            if id(t) in skip or (pending is not None and (i, key) not in pending):
                continue
            names.setdefault(id(t), []).append((unit, key, hf[key]))
            tensors[id(t)] = t
    read: dict[str, str] = {}
    for ident, where in names.items():
        stored = [w for w in where if w[2] in files.files]
        stored += [(u, k, (aliases or {})[n]) for u, k, n in where if (aliases or {}).get(n) in files.files]
        if not stored:
            raise _missing(files, where[0][2])
        unit, key, name = stored[0]
        t, shape = tensors[ident], files.shape(name)
        if hasattr(t, SOURCE) and tuple(t.shape) != shape:
            dim, ranges = _shard_ranges(unit, key, shape, tuple(t.shape), tp_rank)
            value = files.read(name, dim, ranges)
        else:
            value = files.read(name)
        if tuple(value.shape) != tuple(t.shape):
            raise field_error(f"{files.path}:{name}", tuple(value.shape), f"have the model's shape "
                              f"{tuple(t.shape)}", "build the model from this directory's config")
        t.copy_(value)
        read[name] = key
    files.close()
    return read


def _missing(files: PretrainedDirectory, name: str) -> Exception:
    """The refusal of a directory without tensor ``name``: where transformers converts the checkpoint's layout on
    load (MoE experts kept one tensor per expert), it says so."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    model_type = files.config.get("model_type")
    if model_type and get_checkpoint_conversion_mapping(model_type):
        return field_error(files.field, str(files.path), f"hold tensor `{name}` under the model's own name (it "
                           f"keeps transformers' checkpoint layout of {model_type}, which from_pretrained converts "
                           "on load)", "write it once with hf.checkpoint_export.save_units, which keeps the "
                           "model's names")
    return field_error(files.field, str(files.path), f"hold tensor `{name}` (its weights have {len(files.files)} "
                       "tensors, none of that name)")


def tied_aliases(model: Any) -> dict[str, str]:
    """``{the output embedding's weight: the input embedding's}`` by name when the model ties them
    (``tie_word_embeddings``), else empty: a head on a stage of its own reads the embedding matrix."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return {}
    where = {id(m): name for name, m in model.named_modules()}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is None or inp is None or id(out) not in where or id(inp) not in where:
        return {}
    return {f"{where[id(out)]}.weight": f"{where[id(inp)]}.weight"}


def release_unheld(model: nn.Module) -> int:
    """Replace every meta parameter and buffer of ``model`` (the layers another rank holds) by an empty CPU tensor of
    its dtype, so moving the module to a device moves nothing of them; returns how many were replaced."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, q in list(module.named_parameters(recurse=False)):
            if q.is_meta:
                made.setdefault(id(q), nn.Parameter(torch.empty(0, dtype=q.dtype), requires_grad=q.requires_grad))
                setattr(module, name, made[id(q)])
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                made.setdefault(id(b), torch.empty(0, dtype=b.dtype))
                setattr(module, name, made[id(b)])
    return len(made)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter of ``model`` that holds memory (not meta, not released), by its name."""
    return {n: q.numel() * q.element_size() for n, q in model.named_parameters()
            if not q.is_meta and q.numel() > 0}


def load_rank_units(module: Any, directory: str | Path, layers: tuple[int, int], field: str = "pretrained", *,
                    split: bool = False) -> "ShardLoad":
    """Load pipeline units ``[start, stop)`` (``layers``: this rank's, from the plan) of the Hugging Face model
    ``module`` holds (or ``module`` itself) from ``directory``, and release the others.

    ``split``: the units run on a tensor-parallel stage; the tensors their tp plans cut (``split_tensors``) are
    released unread, for the returned ``ShardLoad`` to read as shards once the runtime has split the units.
    """
    from transformers import PreTrainedModel

    from het_strategy.hf.lightning_adapter import hf_model_of
    from het_strategy.hf.pipeline_units import hf_pipeline_units

    model = module if isinstance(module, PreTrainedModel) else hf_model_of(module)
    if model is None:
        raise field_error(field, str(directory), f"be given only for a LightningModule holding a Hugging Face "
                          f"causal LM ({type(module).__name__} holds none)")
    files = PretrainedDirectory(directory, field)
    check_config(files, model.config.to_dict())
    units = hf_pipeline_units(model)
    start, stop = layers
    if not 0 <= start < stop <= len(units):
        raise field_error("plan.model.num_layers", stop, f"index the model's {len(units)} pipeline units")
    aliases = tied_aliases(model)
    skip = frozenset(id(t) for t in split_tensors(units[start:stop]).values()) if split else frozenset()
    load_units(units[start:stop], files, aliases=aliases, skip=skip)
    release_unheld(model)
    return ShardLoad(files, aliases)


def _tp_specs(unit: nn.Module) -> dict[str, Any]:
    plan = unit.tensor_parallel_plan() if callable(getattr(unit, "tensor_parallel_plan", None)) else None
    return plan.shard_specs() if plan is not None else {}


def split_tensors(units: Sequence[nn.Module]) -> dict[tuple[int, str], torch.Tensor]:
    """``{(unit index, key): tensor}`` of the tensors the units' tp plans cut, but those another key of the units
    uses whole (a tied embedding beside a split head: read whole, the head's shard cut from it)."""
    cut: dict[tuple[int, str], torch.Tensor] = {}
    whole: set[int] = set()
    for i, unit in enumerate(units):
        specs = _tp_specs(unit)
        for key, t in unit.state_dict(keep_vars=True).items():
            if key in specs:
                cut[(i, key)] = t
            else:
                whole.add(id(t))
    return {k: t for k, t in cut.items() if id(t) not in whole}


class ShardLoad:
    """Reads a tensor-parallel stage's shards from a ``save_pretrained`` directory: the runtime's ``load_layers``
    hook (``ds_runtime.replica_engine.build_replica_engine``), called on this rank's pipeline module.

    ``prepare(module)`` before the split: each tensor its units' tp plans cut, left empty by ``load_rank_units``,
    becomes a meta tensor of its stored shape (the file header's), so the split cuts meta shards.
    ``load(module, tp_rank)`` after it: each meta shard is materialized and filled with its slice of the stored
    tensor (``get_slice``), and keeps the empty tensor the optimizer was built over as its whole parameter (a
    linear the model still holds beside its split, as a head's ``lm_head``, gets that empty tensor back too).
    ``bytes_read``: the bytes this rank has read from the directory, its unsplit tensors included.
    """

    def __init__(self, files: PretrainedDirectory, aliases: dict[str, str]) -> None:
        self.files = files
        self.aliases = aliases
        self._empty: dict[int, tuple[nn.Module, str, nn.Parameter]] = {}

    @property
    def bytes_read(self) -> int:
        """Bytes read from the directory's files so far (by this rank)."""
        return self.files.bytes_read

    @staticmethod
    def _units(module: nn.Module) -> list[nn.Module]:
        return [child for name, child in module.named_children() if name.isdigit() and hasattr(child, "hf_names")]

    def prepare(self, module: nn.Module) -> None:
        """Give the empty tensors the tp plans of ``module``'s units cut their stored shapes, on the meta device."""
        units = self._units(module)
        for (i, key), t in split_tensors(units).items():
            if t.numel() > 0 or not isinstance(t, nn.Parameter):
                continue  # read whole already (a stage at tp 1 never splits)
            name = units[i].hf_names()[key]
            name = name if name in self.files.files else self.aliases.get(name, name)
            meta = nn.Parameter(torch.empty(self.files.shape(name), dtype=t.dtype, device="meta"),
                                requires_grad=t.requires_grad)
            owner, _, attr = key.rpartition(".")
            holder = units[i].get_submodule(owner) if owner else units[i]
            setattr(holder, attr, meta)
            self._empty[id(meta)] = (holder, attr, t)

    def load(self, module: nn.Module, tp_rank: int) -> None:
        """Materialize and read the meta shards of ``module``'s units (split for tp rank ``tp_rank``)."""
        from het_strategy.tensor_parallel.layers import SOURCE

        units = self._units(module)
        for q in module.parameters():
            whole = getattr(q, SOURCE, None)
            if whole is not None and id(whole) in self._empty:
                setattr(q, SOURCE, self._empty[id(whole)][2])  # the optimizer's parameter, not the meta stand-in
        for holder, attr, empty in self._empty.values():  # a module the model still holds (a head's lm_head)
            setattr(holder, attr, empty)
        self._empty.clear()
        load_units(units, self.files, tp_rank=tp_rank, aliases=self.aliases, only_meta=True)
