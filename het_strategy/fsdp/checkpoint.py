"""Sharded checkpoints of a ``hetero_fsdp`` model and its optimizer, through ``torch.distributed.checkpoint`` (DCP).

What the checkpoint holds (one DCP key each):

- ``model.<unit>``: the unit's flat parameter as one global 1-D tensor of ``unit.numel`` elements. Every rank
  writes the chunk it holds, at offset ``unit.offsets[rank]`` and of length ``unit.sizes[rank]`` (a rank with 0
  elements writes nothing); the chunks tile the tensor.
- ``optim.<unit>.<state>``: each optimizer state tensor with the shard's shape (Adam's ``exp_avg`` and
  ``exp_avg_sq``, SGD's ``momentum_buffer``) as a global 1-D tensor in the same chunks; a 0-dim tensor (Adam's
  ``step``) or a Python value, the same on every rank, once.
- ``optim.param_groups`` (the hyperparameters, each group's parameters named by unit) and ``extra`` (the
  caller's plain dict: the plan, the loop's counters): once.

Loading asks DCP, per unit, for the chunk the *current* layout gives this rank; DCP's resharding reads the
overlapping pieces of whichever saved chunks cover it. So a checkpoint written by 3 ranks with sizes 4:2:1 loads
into 2 ranks with 1:1, or 3 ranks with 0:1:2: any world size and any sizes, as long as the units (names and
element counts) are the same. DTensor cannot describe arbitrary uneven chunks and ShardedTensor is deprecated,
so two small planners (``_FlatSavePlanner``, ``_FlatLoadPlanner``) give DCP the chunks of plain local tensors.

A save that stops half way loads nothing: rank 0 removes the directory's ``.metadata`` before anything is
written (no rank writes data before the coordinator has made the global plan) and DCP writes the new one last
(a temporary file renamed), after every rank's data; ``load_sharded`` refuses a directory without it.
"""

from __future__ import annotations

import dataclasses
import io
import os
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_debug

__all__ = ["save_sharded", "load_sharded", "export_full"]

_METADATA = ".metadata"
"""The file DCP's FileSystemWriter writes last (renamed from a temporary); its presence marks a finished save."""

_MODEL, _OPTIM, _GROUPS, _EXTRA = "model.", "optim.", "optim.param_groups", "extra"


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """Where this rank's local 1-D tensor sits in a global flat tensor."""

    numel: int
    """The global tensor's element count (the unit's ``numel``)."""
    offset: int
    """Start of this rank's piece."""
    size: int
    """Length of this rank's piece (0: the rank holds none of it)."""

    def metadata(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size([self.offset]), sizes=torch.Size([self.size]))


class _FlatSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that the keys in ``chunks`` are written as one chunk of a global 1-D
    tensor each (a shard write item with the chunk's offset), not as whole tensors."""

    def __init__(self, chunks: dict[str, _Chunk]) -> None:
        # the state dict is flat already; a nested `extra` must stay one pickled object, not keys of its own
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks

    def create_local_plan(self) -> SavePlan:
        others = {k: v for k, v in self.state_dict.items() if k not in self.chunks}
        items = list(create_default_local_save_plan(others, self.is_coordinator).items)
        for fqn, chunk in self.chunks.items():
            if chunk.size == 0:
                continue
            tensor = self.state_dict[fqn]
            items.append(WriteItem(
                index=MetadataIndex(fqn, torch.Size([chunk.offset])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk.metadata(),
                                            properties=TensorProperties.create_from_tensor(tensor),
                                            size=torch.Size([chunk.numel]))))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]  # the local piece itself: the write item says where it goes
        return super().lookup_object(index)


class _FlatLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that the keys in ``chunks`` are read as this rank's chunk of a global
    1-D tensor (whichever saved chunks overlap it), and pickled values land in ``loaded``."""

    def __init__(self, chunks: dict[str, _Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.chunks = chunks
        self.loaded: dict[str, Any] = {}

    def create_local_plan(self) -> LoadPlan:
        others = {k: v for k, v in self.state_dict.items() if k not in self.chunks}
        items: list[ReadItem] = list(create_default_local_load_plan(others, self.metadata, True).items)
        for fqn, chunk in self.chunks.items():
            if chunk.size > 0:
                stored = self.metadata.state_dict_metadata[fqn]
                items += create_read_items_for_chunk_list(fqn, stored, [chunk.metadata()])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.chunks:
            return self.state_dict[index.fqn]  # read items' dest offsets are relative to this local piece
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _rank(sharded_model: Any) -> int:
    group = getattr(sharded_model, "group", None)
    return dist.get_rank(group) if dist.is_initialized() else 0


def _local_chunks(sharded_model: Any) -> dict[str, _Chunk]:
    """Each unit's place in its flat parameter on this rank, checked against the shard it holds."""
    rank = _rank(sharded_model)
    chunks = {}
    for unit in sharded_model.units:
        size, offset = int(unit.sizes[rank]), int(unit.offsets[rank])
        if unit.shard.dim() != 1 or unit.shard.numel() != size:
            raise field_error(f"units[{unit.name}].shard", tuple(unit.shard.shape),
                              f"be 1-D with sizes[{rank}] = {size} elements (rank {rank}'s piece)")
        chunks[unit.name] = _Chunk(numel=int(unit.numel), offset=offset, size=size)
    return chunks


def _unit_of_param(sharded_model: Any, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(parameter) -> unit name for every parameter the optimizer steps; each must be a unit's shard."""
    names = {id(unit.shard): unit.name for unit in sharded_model.units}
    for g, group in enumerate(optimizer.param_groups):
        for p, param in enumerate(group["params"]):
            if id(param) not in names:
                raise field_error(f"optimizer.param_groups[{g}].params[{p}]", tuple(param.shape),
                                  "be one of the sharded model's unit shards",
                                  "build the optimizer on the model's parameters after shard_model")
    return names


def _optimizer_state(sharded_model: Any, optimizer: torch.optim.Optimizer,
                     chunks: dict[str, _Chunk]) -> tuple[dict[str, Any], dict[str, _Chunk]]:
    """The optimizer's state as checkpoint keys, and the chunks of those that are sharded like the shard."""
    names = _unit_of_param(sharded_model, optimizer)
    state: dict[str, Any] = {}
    sharded: dict[str, _Chunk] = {}
    for unit in sharded_model.units:
        for key, value in optimizer.state.get(unit.shard, {}).items():
            fqn = f"{_OPTIM}{unit.name}.{key}"
            if "." in str(key):
                raise field_error(f"optimizer.state[{unit.name}]", key, "be a state name without '.'")
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.shape != unit.shard.shape:
                    raise field_error(f"optimizer.state[{unit.name}].{key}", tuple(value.shape),
                                      f"have the shard's shape {tuple(unit.shard.shape)} or be a scalar")
                sharded[fqn] = chunks[unit.name]
                value = value.detach()
            state[fqn] = value
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[id(p)] for p in group["params"]]})
    state[_GROUPS] = groups
    return state, sharded


_ASYNC_GROUPS: dict[tuple[Any, tuple[int, ...]], dist.ProcessGroup] = {}
"""(default group, ranks) -> the gloo group of those ranks for async saves: their collectives run in DCP's
background thread beside the training's on the model's group, and two threads must never share one group (the
ranks could pair up different collectives).  Keyed by the default group object itself (held here), so a process
group initialised again after ``destroy_process_group`` gets groups of its own."""


def _async_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    world = dist.group.WORLD
    key = (world, tuple(dist.get_process_group_ranks(group or world)))
    if key not in _ASYNC_GROUPS:
        # new_group is collective over the default group: every rank reaches it in its first async save
        _ASYNC_GROUPS[key] = dist.new_group(ranks=list(key[1]), backend="gloo")
    return _ASYNC_GROUPS[key]


def save_sharded(sharded_model: Any, optimizer: torch.optim.Optimizer | None, path: str | os.PathLike,
                 async_save: bool = False, extra: dict[str, Any] | None = None) -> Future | None:
    """Write the units' shards, the optimizer's state and ``extra`` to the directory ``path``; collective over
    the model's group (``sharded_model.group``, else the default group): every rank calls it.

    ``sharded_model``: has ``units`` (each with ``name``, ``numel``, ``sizes``, ``offsets`` and this rank's 1-D
    ``shard``). ``optimizer``: steps exactly the units' shards (or None: parameters only). ``extra``: a plain
    dict (str, numbers, lists, dicts, tensors), returned by ``load_sharded``.

    ``async_save=True``: the state is copied to CPU memory before this returns, the files are written in a
    background thread (its collectives on a gloo group of their own) and the DCP future is returned; training
    may go on at once, but wait for the future (``.result()``) before the next save or a load of ``path``.
    """
    path = Path(path)
    rank = _rank(sharded_model)
    local = _local_chunks(sharded_model)
    chunks = {f"{_MODEL}{name}": chunk for name, chunk in local.items()}
    state: dict[str, Any] = {f"{_MODEL}{unit.name}": unit.shard.detach() for unit in sharded_model.units}
    if optimizer is not None:
        optim_state, optim_chunks = _optimizer_state(sharded_model, optimizer, local)
        state.update(optim_state)
        chunks.update(optim_chunks)
    state[_EXTRA] = dict(extra or {})
    if rank == 0:
        # before any data is written: a save that stops half way must not pair new data with an old .metadata
        (path / _METADATA).unlink(missing_ok=True)
    group = getattr(sharded_model, "group", None)
    writer = dcp.FileSystemWriter(path)
    planner = _FlatSavePlanner(chunks)
    rank_debug(rank, "fsdp checkpoint: saving %d units to %s (async=%s)", len(sharded_model.units), path, async_save)
    if async_save:
        return dcp.async_save(state, storage_writer=writer, planner=planner, process_group=_async_group(group))
    dcp.save(state, storage_writer=writer, planner=planner, process_group=group)
    return None


def load_sharded(sharded_model: Any, optimizer: torch.optim.Optimizer | None,
                 path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``save_sharded`` checkpoint into the current layout (any world size, any sizes: the same units)
    and return its ``extra``; collective over the model's group.

    Each unit's shard is overwritten in place with its piece of the saved flat parameter; the optimizer's
    state is replaced by the saved one, resharded the same way (``optimizer.load_state_dict``: the saved
    hyperparameters, states cast to the shard's dtype and device), so the next step is the one the saving run
    would have taken (``optimizer=None``: the parameters only). Raises ConfigError for a directory without a
    finished checkpoint, or units that differ from the checkpoint's (names, element counts).
    """
    path = Path(path)
    if not (path / _METADATA).is_file():
        raise field_error("checkpoint.path", str(path), f"hold a finished sharded checkpoint (its {_METADATA})",
                          "the save did not finish, or this is not a save_sharded directory")
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    rank = _rank(sharded_model)
    local = _local_chunks(sharded_model)
    saved = sorted(k[len(_MODEL):] for k in stored if k.startswith(_MODEL))
    shown = ", ".join(f"{n}={tuple(stored[_MODEL + n].size)}" for n in saved)
    for unit in sharded_model.units:
        md = stored.get(f"{_MODEL}{unit.name}")
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != (int(unit.numel),):
            raise field_error(f"units[{unit.name}].numel", int(unit.numel),
                              f"match a unit of the checkpoint in {path} (saved: {shown})")
    missing = sorted(set(saved) - {unit.name for unit in sharded_model.units})
    if missing:
        raise field_error("units", [unit.name for unit in sharded_model.units],
                          f"hold every unit of the checkpoint in {path}; it lacks {', '.join(missing)}")
    chunks = {f"{_MODEL}{name}": chunk for name, chunk in local.items()}
    state: dict[str, Any] = {f"{_MODEL}{unit.name}": unit.shard.detach() for unit in sharded_model.units}
    state[_EXTRA] = None
    optim_keys: dict[str, dict[str, str]] = {}  # unit -> state name -> key
    if optimizer is not None:
        if _GROUPS not in stored:
            raise field_error("optimizer", type(optimizer).__name__, f"be None: the checkpoint in {path} holds "
                              "no optimizer state (saved with optimizer=None)")
        state[_GROUPS] = None
        for unit in sharded_model.units:
            prefix = f"{_OPTIM}{unit.name}."
            for key, md in stored.items():
                name = key[len(prefix):]
                if not key.startswith(prefix) or "." in name:
                    continue
                optim_keys.setdefault(unit.name, {})[name] = key
                if not isinstance(md, TensorStorageMetadata):
                    state[key] = None  # a pickled value
                elif len(md.size) == 0:
                    state[key] = torch.empty((), dtype=md.properties.dtype)
                else:
                    state[key] = torch.empty_like(unit.shard, dtype=md.properties.dtype).detach()
                    chunks[key] = local[unit.name]
    planner = _FlatLoadPlanner(chunks)
    rank_debug(rank, "fsdp checkpoint: loading %d units from %s", len(sharded_model.units), path)
    dcp.load(state, storage_reader=reader, planner=planner, process_group=getattr(sharded_model, "group", None))
    state.update(planner.loaded)
    if optimizer is not None:
        _load_optimizer(sharded_model, optimizer, state, optim_keys)
    return state[_EXTRA]


def _load_optimizer(sharded_model: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    optim_keys: dict[str, dict[str, str]]) -> None:
    """Hand the loaded state to ``optimizer.load_state_dict`` in its own form: parameters by index, each group's
    hyperparameters from the saved group that holds its units."""
    names = _unit_of_param(sharded_model, optimizer)
    saved_group_of = {name: g for g, group in enumerate(state[_GROUPS]) for name in group["params"]}
    own_state: dict[int, dict[str, Any]] = {}
    own_groups = []
    index = 0
    for g, group in enumerate(optimizer.param_groups):
        units = [names[id(p)] for p in group["params"]]
        homes = {saved_group_of.get(u) for u in units}
        if len(homes) != 1 or None in homes:
            raise field_error(f"optimizer.param_groups[{g}]", units,
                              "hold the units of one saved parameter group (saved: " +
                              "; ".join(str(sg["params"]) for sg in state[_GROUPS]) + ")")
        saved = state[_GROUPS][homes.pop()]
        own_groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(index, index + len(units)))})
        for u in units:
            if u in optim_keys:
                own_state[index] = {name: state[key] for name, key in optim_keys[u].items()}
            index += 1
    optimizer.load_state_dict({"state": own_state, "param_groups": own_groups})


def export_full(sharded_model: Any, path: str | os.PathLike) -> None:
    """Write the original module's whole ``state_dict`` (``sharded_model.full_state_dict``: its names, shapes and
    dtypes) to the file ``path`` with ``torch.save``, from rank 0; collective (every rank gathers every unit).
    The file appears whole or not at all (written beside it, then renamed): ``module.load_state_dict(
    torch.load(path))`` in one process, no ``het_strategy`` needed."""
    state = sharded_model.full_state_dict(rank0_only=True)
    if _rank(sharded_model) == 0:
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        torch.save(state, partial)
        os.replace(partial, path)
