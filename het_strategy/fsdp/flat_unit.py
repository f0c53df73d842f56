"""One unit of ``hetero_fsdp``: a module's parameters as one flat vector, of which this rank keeps one piece.

A ``FlatUnit`` owns, for one unit (a block, or the root: the parameters outside every block):

- the *layout*: ``param_names`` (full names in the original module, in module order), ``shapes``, ``numel``, and
  the per-rank ``sizes`` / ``offsets`` of the flat vector (``core.shard_sizes``: the planner's rule);
- the *shard*: ``shard``, this rank's piece ``[offsets[rank], offsets[rank] + sizes[rank])`` as an
  ``nn.Parameter`` in the master dtype (float32; float64 for float64 parameters), registered on the unit's module
  as ``flat_shard``: the only parameter of the unit that ``module.parameters()`` yields, what the optimizer steps;
- the *gathered* vector ``full``: the whole flat vector in the compute dtype, an autograd leaf whose storage exists
  only while the unit is gathered (it is resized to 0 bytes when freed, and back when gathered again, so the
  tensors autograd saved in the forward see the values the backward's gather writes).  While gathered, every
  original parameter attribute (``block.fc.weight``) is a plain tensor, a view of ``full`` (``full.split`` then
  ``view``: one ``SplitBackward`` node, so the whole unit's gradient arrives in ``full.grad`` at once).

Its collectives (``start_gather``, ``start_reduce``, ``gather_master``) are called by ``ShardedModel`` in the
same order on every rank; this module decides nothing about when.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from het_strategy.core.errors import field_error
from het_strategy.core.shard_sizes import shard_offsets, shard_sizes
from het_strategy.fsdp.uneven_collectives import all_gather_uneven, reduce_scatter_uneven

__all__ = ["FlatUnit", "FLAT_SHARD", "ROOT_UNIT", "UnitState", "agree_dtypes"]

FLAT_SHARD = "flat_shard"
"""The attribute under which each unit's shard is registered on the unit's module."""
ROOT_UNIT = "root"
"""The ``name`` of the unit holding the parameters outside every block (registered on the top module)."""


class UnitState:
    """Where a unit's gathered vector stands (plain strings, compared by value)."""

    FREE = "free"
    """No storage: the module's parameter attributes must not be read."""
    GATHERING = "gathering"
    """An all-gather into ``full`` is in flight (``pending``); wait before reading."""
    GATHERED = "gathered"
    """``full`` holds the current values in the compute dtype."""


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes a unit may hold or compute in, by their code on the wire (``agree_dtypes``)."""


def _master_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or float64 for float64 parameters (the optimizer's dtype)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class FlatUnit:
    """A unit's parameters flattened, sharded by ``fractions`` over the ranks of ``group`` (module docstring).

    ``slots``: every ``(owner module, attribute, full name)`` of the unit's parameters, in module order; a
    parameter reached under two names (tied weights) is stored once, the later names being aliases.
    Building it replaces the originals on their modules (collective when ``sync_module_states``: the values are
    rank 0's)."""

    def __init__(self, name: str, module: nn.Module, slots: Sequence[tuple[nn.Module, str, str]],
                 fractions: Sequence[float], rank: int, world: int, group: Any = None,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
                 sync_module_states: bool = False) -> None:
        self.name = name
        self.module = module
        """The module the shard is registered on (the block; the top module for the root)."""
        self.rank, self.world, self.group = rank, world, group
        if hasattr(module, FLAT_SHARD):
            raise field_error(f"shard_model.units[{name}]", name, f"have no attribute `{FLAT_SHARD}` of its own")
        originals: list[nn.Parameter] = []
        index_of: dict[int, int] = {}
        self.param_names: list[str] = []
        self.aliases: dict[str, int] = {}
        """Further names of a tied parameter -> its index in ``param_names``."""
        self._slots: list[tuple[nn.Module, str, int]] = []
        for owner, attr, full_name in slots:
            param = owner.get_parameter(attr)
            if id(param) not in index_of:
                index_of[id(param)] = len(originals)
                originals.append(param)
                self.param_names.append(full_name)
            else:
                self.aliases[full_name] = index_of[id(param)]
            self._slots.append((owner, attr, index_of[id(param)]))
        if not originals:
            raise field_error(f"shard_model.units[{name}]", name, "hold at least one parameter")
        dtypes = {p.dtype for p in originals}
        devices = {p.device for p in originals}
        grads = {p.requires_grad for p in originals}
        if len(dtypes) > 1 or len(devices) > 1 or len(grads) > 1:
            raise field_error(f"shard_model.units[{name}]", sorted(str(x) for x in dtypes | devices | grads),
                              "hold parameters of one dtype, one device and one requires_grad (one flat vector)",
                              "make the unit's parameters alike, or cut it into units that are")
        self.dtype = originals[0].dtype
        """The original parameters' dtype (what ``full_state_dict`` returns)."""
        self.master_dtype = _master_dtype(self.dtype)
        self.param_dtype = param_dtype or self.dtype
        """The compute dtype: what this rank's forward and backward of the unit run in."""
        self.gather_dtype = self.param_dtype
        """The all-gather's dtype: the compute dtype where every rank computes in the same (``agree_dtypes``),
        else the master dtype (each rank casts after the gather)."""
        self.reduce_dtype = torch.promote_types(reduce_dtype, self.param_dtype)
        """The gradient reduction's dtype: ``reduce_dtype``, or the widest compute dtype of any rank where that is
        wider (``agree_dtypes``)."""
        self.shapes: list[torch.Size] = [p.shape for p in originals]
        self.numels = [p.numel() for p in originals]
        self.numel = sum(self.numels)
        self.sizes: list[int] = shard_sizes(self.numel, fractions)
        self.offsets: list[int] = shard_offsets(self.sizes)
        device = originals[0].device
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(self.master_dtype) for p in originals])
            if sync_module_states:  # every rank starts from rank 0's values, as DDP's construction does
                torch.distributed.broadcast(flat, src=torch.distributed.get_global_rank(group, 0)
                                            if group is not None else 0, group=group)
            lo = self.offsets[rank]
            piece = flat[lo:lo + self.sizes[rank]].clone()
        del flat
        self.shard = nn.Parameter(piece, requires_grad=originals[0].requires_grad)
        self.full = torch.empty(self.numel, dtype=self.param_dtype, device=device)
        self.full.requires_grad_(self.shard.requires_grad)
        self._bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.FREE
        self.pending: Any = None
        """The in-flight gather's work handle (``GATHERING``)."""
        self._send: torch.Tensor | None = None  # the cast shard an in-flight gather reads: alive until its wait
        self._wire: torch.Tensor | None = None  # what the in-flight gather writes (``full`` itself, or a cast)
        self._reducing: Any = None  # the in-flight reduce-scatter: (this rank's piece, its work handle)
        for owner, attr, _ in self._slots:  # the originals leave the modules; only the shard is a parameter
            delattr(owner, attr)
            setattr(owner, attr, torch.empty(0, dtype=self.param_dtype, device=device))
        module.register_parameter(FLAT_SHARD, self.shard)

    # -- gathering ---------------------------------------------------------------------------------------------
    def start_gather(self, async_op: bool) -> None:
        """All-gather every rank's shard (cast to the compute dtype) into ``full`` (a collective); with
        ``async_op`` the unit is ``GATHERING`` until ``wait_gather``."""
        storage = self.full.untyped_storage()
        if storage.nbytes() != self._bytes:
            storage.resize_(self._bytes)
        self._send = self.shard.detach().to(self.gather_dtype)
        # .data: the write does not bump the version autograd checks on the tensors saved from ``full``'s views
        out = self.full.data if self.gather_dtype == self.param_dtype else None
        result = all_gather_uneven(self._send, self.sizes, self.group, async_op=async_op, out=out)
        self.pending = result[1] if async_op else None
        self._wire = result[0] if async_op else result
        self.state = UnitState.GATHERING
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """Block until the in-flight gather has landed in ``full``."""
        if self.state == UnitState.GATHERING:
            if self.pending is not None:
                self.pending.wait()
            if self._wire.data_ptr() != self.full.data_ptr():  # gathered in another dtype: cast into place
                self.full.data.copy_(self._wire)
            self.pending, self._send, self._wire = None, None, None
            self.state = UnitState.GATHERED

    def use_views(self) -> None:
        """Point every original parameter attribute at its view of ``full`` (call while gathered, in the grad mode
        of the forward about to run: its views carry the autograd edge to ``full``)."""
        views = [piece.view(shape) for piece, shape in zip(self.full.split(self.numels), self.shapes)]
        for owner, attr, index in self._slots:
            setattr(owner, attr, views[index])

    def free(self) -> None:
        """Give back ``full``'s storage (the views stay, pointing at no memory, until the next gather)."""
        if self.state == UnitState.GATHERING:
            self.wait_gather()
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.FREE

    # -- gradients ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def start_reduce(self) -> None:
        """Start reduce-scattering ``full.grad`` (in ``reduce_dtype``, summed over the ranks) into this rank's
        piece, asynchronously (a collective); drops ``full.grad``.  ``finish_reduce`` completes it."""
        grad = self.full.grad
        self.full.grad = None
        self._reducing = reduce_scatter_uneven(grad.reshape(-1).to(self.reduce_dtype), self.sizes, self.rank,
                                               self.group, async_op=True)

    @torch.no_grad()
    def finish_reduce(self) -> None:
        """Wait for ``start_reduce``'s collective and add its piece, divided by the world size, to ``shard.grad``
        (set it on the first micro-batch)."""
        piece, work = self._reducing
        self._reducing = None
        work.wait()
        piece = piece.div_(self.world).to(self.master_dtype)
        if self.shard.grad is None:
            self.shard.grad = piece
        else:
            self.shard.grad.add_(piece)

    def in_flight_tensors(self) -> list[torch.Tensor]:
        """The buffers this unit's in-flight collectives hold until awaited (a gather's cast shard and padded
        pieces, a reduce-scatter's input, padded copy and output): what a memory count adds while they run."""
        held: list[torch.Tensor] = [] if self._send is None else [self._send]
        for handle in (self.pending, None if self._reducing is None else self._reducing[1]):
            held.extend(t for t in getattr(handle, "keep", ()) if isinstance(t, torch.Tensor))
        return held

    # -- whole values ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_master(self) -> list[torch.Tensor]:
        """Every parameter of the unit whole, from every rank's master shard, in ``param_names`` order, shaped and
        in the original dtype (a collective)."""
        flat = all_gather_uneven(self.shard.detach(), self.sizes, self.group)
        return [piece.view(shape).to(self.dtype) for piece, shape in zip(flat.split(self.numels), self.shapes)]


    def restore(self, values: Sequence[torch.Tensor]) -> None:
        """Put the unit's original parameters back on their modules as ``nn.Parameter`` s holding ``values``
        (``gather_master``'s, in ``param_names`` order; a tied one under all its names) and remove the shard."""
        params = [nn.Parameter(value, requires_grad=self.shard.requires_grad) for value in values]
        for owner, attr, index in self._slots:
            delattr(owner, attr)
            owner.register_parameter(attr, params[index])
        delattr(self.module, FLAT_SHARD)
        self.full.untyped_storage().resize_(0)
        self.state = UnitState.FREE


def agree_dtypes(units: Sequence[FlatUnit], reduce_dtype: torch.dtype, group: Any = None) -> None:
    """Give every unit a gather and a reduction dtype that every rank of ``group`` shares (a collective).

    Ranks may compute in different dtypes (per-device precision: bf16 on one, fp32 on another), but a collective
    moves one dtype: each unit is gathered in the common compute dtype where all ranks agree, else in the master
    dtype, and reduced in the widest of ``reduce_dtype`` and every rank's compute dtype.  Master dtypes must
    agree (every rank's optimizer steps the same numbers)."""
    if not units:
        return
    for unit in units:
        for dtype in (unit.param_dtype, unit.master_dtype):
            if dtype not in _DTYPES:
                raise field_error(f"shard_model.units[{unit.name}].dtype", str(dtype),
                                  f"be one of {', '.join(str(d) for d in _DTYPES)}")
    mine = torch.tensor([_DTYPES.index(d) for u in units for d in (u.param_dtype, u.master_dtype)],
                        dtype=torch.int64, device=units[0].shard.device)
    world = units[0].world
    every = all_gather_uneven(mine, [mine.numel()] * world, group).view(world, len(units), 2)
    for i, unit in enumerate(units):
        params = {_DTYPES[int(c)] for c in every[:, i, 0]}
        masters = {_DTYPES[int(c)] for c in every[:, i, 1]}
        if len(masters) > 1:
            raise field_error(f"shard_model.units[{unit.name}].dtype", sorted(str(d) for d in masters),
                              "be the same master dtype on every rank (float64 parameters on all or none)")
        unit.gather_dtype = unit.param_dtype if len(params) == 1 else unit.master_dtype
        widest = reduce_dtype
        for dtype in params:
            widest = torch.promote_types(widest, dtype)
        unit.reduce_dtype = widest
