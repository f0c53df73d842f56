"""Fully sharded data parallelism with unequal shards: ``shard_model`` cuts a module into ``FlatUnit`` s (one per
block, plus the root: the parameters outside every block) and drives their gathers, frees and gradient reductions
from forward and backward hooks; ``ShardedModel``'s docstring has the steps.

Forward: 1. the top module gathers the root and starts block 0's gather; 2. block ``i`` waits for its gather,
starts block ``i + 1``'s, runs on views of the gathered vector; 3. block ``i`` frees it (the root stays gathered).
Backward: 4. the first gradient at block ``i``'s outputs waits for (or runs) its gather again and starts block
``i - 1``'s; 5. once the unit's whole gradient has arrived it is reduce-scattered (``reduce_dtype``, summed over the
ranks, divided by the world size) into ``flat_shard.grad`` and the unit is freed.

Invariants:

- every rank gathers, waits and reduces the units in the same order: which collective comes next depends only on
  the program (the module, the unit list, the hooks) and on unit states every rank changes alike, never on a
  rank's data or timing; so each rank must run the same number of forwards and backwards per step (shares by
  speed differ in batch size, not in count);
- prefetch keeps that order: block ``i + 1`` (forward) or ``i - 1`` (backward) is started at the same point of
  every rank's program and only while every rank sees it free; a gather is awaited before its views are read,
  and one the program never reached is awaited and freed when the next forward starts (no stale values);
- a unit is gathered at most once at a time: only free units are started, and freed only once awaited.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import nn
from torch.utils._pytree import tree_leaves

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_debug
from het_strategy.fsdp.flat_unit import ROOT_UNIT, FlatUnit, UnitState, agree_dtypes

__all__ = ["ShardedModel", "shard_model"]


class ShardedModel:
    """A module sharded by ``shard_model``: its units, its hooks' state and the full state dict.  Call it (or the
    module itself: the hooks are on the module) as the module.

    Forward (one call of the top module):

    1. The top module's pre-hook frees whatever a previous forward left gathered, then all-gathers the root
       (synchronously) and, with ``prefetch``, starts block 0's all-gather (asynchronously).
    2. Block ``i``'s pre-hook waits for its gather (or runs it, without prefetch), points the block's parameter
       attributes at views of the gathered vector, and starts block ``i + 1``'s gather: it runs on the process
       group's threads (gloo) or NCCL's stream while block ``i`` computes.
    3. Block ``i``'s post-hook registers a pre-backward hook on its outputs (when they need a gradient) and frees
       the gathered vector; the tensors autograd saved keep pointing at its (now empty) storage.
    4. The root stays gathered through the backward (it is used at both ends of the model).  After a forward
       without gradients (evaluation) the top module's post-hook frees it; else it registers the root's
       pre-backward hook on the outputs (a backward that follows another forward's backward gathers it again)
       and, with ``prefetch``, starts the last block's gather, the first one the backward needs.

    Backward:

    5. The first gradient reaching block ``i``'s outputs fires its pre-backward hook: it waits for (or runs) the
       gather into the same storage, so the saved tensors read the parameters again, and starts block ``i - 1``'s
       gather.  With ``checkpoint_activations`` the block's forward (under non-reentrant ``torch.utils.checkpoint``)
       is recomputed here, from the gathered views.
    6. When the unit's whole gradient has arrived in the gathered vector's ``.grad`` (its post-accumulate-grad
       hook: autograd runs it once, after every view's gradient), the unit is freed and its gradient
       reduce-scattered in ``reduce_dtype`` asynchronously, overlapping the next unit's backward; the previous
       unit's reduce-scatter is awaited first (one in flight: one unit's unreduced gradient in memory), and the
       last one when the backward ends (an autograd callback).  Each lands, divided by the world size, in
       ``flat_shard.grad`` (added to a gradient already there: micro-batches).  The root's comes last.
    7. When the backward ends, whatever is still gathered (a frozen unit, a prefetch it did not reach) is freed.

    The optimizer then steps on the shards; the next forward gathers their new values.  Time blocked on
    communication (waiting for a prefetched gather, a synchronous gather, a reduce-scatter) adds up in
    ``comm_wait_s``."""

    def __init__(self, module: nn.Module, root: FlatUnit | None, blocks: list[FlatUnit], block_modules:
                 list[nn.Module], rank: int, world: int, group: Any, prefetch: bool, state_keys: list[str]) -> None:
        self.module = module
        self.root = root
        self.blocks = blocks
        self.units: list[FlatUnit] = ([root] if root is not None else []) + blocks
        """Every unit: the root first (when the module has parameters outside the blocks), then the blocks in
        forward order."""
        self.rank, self.world, self.group = rank, world, group
        self.prefetch = prefetch
        self.comm_wait_s = 0.0
        """Seconds blocked on communication since construction or ``reset_timing``."""
        self.num_gathers = 0
        """Units gathered (forward and backward) since construction or ``reset_timing``."""
        self.num_prefetched = 0
        """Of those, the gathers started ahead (prefetch) rather than when the unit was needed."""
        self._state_keys = state_keys
        self._block_modules = list(block_modules)
        self._reducing: FlatUnit | None = None
        """The unit whose reduce-scatter is in flight (finished by the next one, or at the backward's end)."""
        self._end_queued = False
        """This backward's end callback is queued."""
        self._depth = 0
        """Calls of the top module in progress: a call inside a call (a LightningModule's ``training_step`` calling
        ``self(x)``) is part of the outer one, whose hooks alone gather and free."""
        self._handles = [module.register_forward_pre_hook(self._forward_start),
                         module.register_forward_hook(self._forward_end, always_call=True)]
        for i, block in enumerate(block_modules):
            self._handles.append(block.register_forward_pre_hook(functools.partial(self._block_start, i)))
            self._handles.append(block.register_forward_hook(functools.partial(self._block_end, i)))
        for unit in self.units:
            if unit.shard.requires_grad:
                self._handles.append(unit.full.register_post_accumulate_grad_hook(
                    functools.partial(self._unit_backward_end, unit)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The shards (what ``module.parameters()`` yields)."""
        return self.module.parameters()

    def reset_timing(self) -> None:
        """Start ``comm_wait_s`` and the gather counts again from 0."""
        self.comm_wait_s = 0.0
        self.num_gathers = self.num_prefetched = 0

    @contextmanager
    def _blocked(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm_wait_s += time.perf_counter() - t0

    def _ready(self, unit: FlatUnit) -> None:
        """``unit`` gathered: its prefetch awaited, or (not started) gathered now."""
        with self._blocked():
            if unit.state == UnitState.GATHERING:
                unit.wait_gather()
            elif unit.state == UnitState.FREE:
                unit.start_gather(async_op=False)
                self.num_gathers += 1

    def _prefetch(self, index: int) -> None:
        if self.prefetch and 0 <= index < len(self.blocks) and self.blocks[index].state == UnitState.FREE:
            self.blocks[index].start_gather(async_op=True)
            self.num_gathers += 1
            self.num_prefetched += 1

    # -- forward -----------------------------------------------------------------------------------------------
    def _forward_start(self, module: nn.Module, args: Any) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._finish_reduce()  # a backward that ended without its callback (an error in it): not lost
        for unit in self.units:  # left by a forward without backward, or a prefetch never reached: stale values
            if unit.state != UnitState.FREE:
                with self._blocked():
                    unit.wait_gather()
                unit.free()
        if self.root is not None:
            self._ready(self.root)
            self.root.use_views()
        self._prefetch(0)

    def _forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1  # also after an error in the forward (the hook is always called)
        if self._depth > 0:
            return
        tensors = _needs_grad(output)
        if not tensors:  # no backward comes to free the root
            if self.root is not None:
                self.root.free()
            return
        # the root stays gathered, but a backward of an earlier forward (forward, forward, backward, backward) may
        # have freed it since: this backward gathers it again
        torch.autograd.graph.register_multi_grad_hook(tensors, self._root_backward_start, mode="any")
        self._prefetch(len(self.blocks) - 1)  # the backward's first block is the last one

    def _block_start(self, index: int, module: nn.Module, args: Any) -> None:
        unit = self.blocks[index]
        self._ready(unit)
        unit.use_views()
        self._prefetch(index + 1)

    def _block_end(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        tensors = _needs_grad(output)
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, functools.partial(self._block_backward_start, index), mode="any")
        self.blocks[index].free()

    # -- backward ----------------------------------------------------------------------------------------------
    def _root_backward_start(self, grad: Any) -> None:
        self._queue_backward_end()
        if self.root is not None:
            self._ready(self.root)

    def _block_backward_start(self, index: int, grad: Any) -> None:
        self._queue_backward_end()
        self._ready(self.blocks[index])
        self._prefetch(index - 1)

    def _unit_backward_end(self, unit: FlatUnit, full: torch.Tensor) -> None:
        self._queue_backward_end()
        self._finish_reduce()  # one reduce-scatter in flight at a time: one unit's unreduced gradient in memory
        unit.start_reduce()
        self._reducing = unit
        unit.free()

    def _queue_backward_end(self) -> None:
        if not self._end_queued:  # runs once this backward has finished
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._end_queued = True

    def _finish_reduce(self) -> None:
        if self._reducing is not None:
            with self._blocked():
                self._reducing.finish_reduce()
            self._reducing = None

    def _backward_end(self) -> None:
        """The last reduce-scatter awaited; what is still gathered (a frozen unit, a prefetch the backward did not
        reach) freed."""
        self._end_queued = False
        self._finish_reduce()
        for unit in self.units:
            if unit.state != UnitState.FREE:
                with self._blocked():
                    unit.wait_gather()
                unit.free()

    # -- the step ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every shard's gradient so that the whole model's gradient norm is at most ``max_norm`` (as
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model); returns that norm (before clipping).  A
        collective: every element of the model lies in exactly one rank's shard, so the norm is one all-reduce of
        the shards' ``norm_type``-th powers (or of their maxima, for the infinity norm)."""
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        device = self.units[0].shard.device
        dtype = self.units[0].master_dtype
        p = float(norm_type)
        local = torch.zeros((), dtype=dtype, device=device)
        for grad in grads:
            if grad.numel():
                part = grad.detach().abs().max() if p == float("inf") else grad.detach().abs().pow(p).sum()
                local = torch.maximum(local, part.to(dtype)) if p == float("inf") else local + part.to(dtype)
        with self._blocked():
            op = torch.distributed.ReduceOp.MAX if p == float("inf") else torch.distributed.ReduceOp.SUM
            torch.distributed.all_reduce(local, op=op, group=self.group)
        total = local if p == float("inf") else local.pow(1.0 / p)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    # -- export ------------------------------------------------------------------------------------------------
    def unshard(self) -> None:
        """Make the module whole again, as it was before ``shard_model`` but with the trained values: every
        unit's parameters gathered, one unit at a time, into CPU memory on every rank as ``nn.Parameter`` s (a
        device that holds only its shards never holds the whole model), the shards and the hooks removed (a
        collective).  The ``ShardedModel`` is not used after it."""
        self._finish_reduce()
        for unit in self.units:
            if unit.state != UnitState.FREE:
                unit.free()
        # every rank gathers every unit, in the same order; each unit's whole vector leaves the device at once
        values = [[tensor.cpu() for tensor in unit.gather_master()] for unit in self.units]
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for unit, unit_values in zip(self.units, values):
            unit.restore(unit_values)
        for block in self._block_modules:
            vars(block).pop("forward", None)  # activation checkpointing's wrapper: the class's forward again

    def full_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The original module's ``state_dict()``: the same names, shapes and dtypes (parameters gathered from
        every rank's shard, buffers as this rank holds them), on the CPU.  A collective over the group; with
        ``rank0_only`` the other ranks return ``{}``."""
        values: dict[str, torch.Tensor] = {}
        for unit in self.units:  # every rank gathers every unit, in the same order
            tensors = unit.gather_master()
            values.update(zip(unit.param_names, tensors))
            values.update((alias, tensors[index]) for alias, index in unit.aliases.items())
        if rank0_only and self.rank != 0:
            return {}
        buffers = dict(self.module.named_buffers(remove_duplicate=False))
        out: dict[str, torch.Tensor] = {}
        for key in self._state_keys:
            value = values.get(key, buffers.get(key))
            if value is not None:
                out[key] = value.detach().cpu().clone()
        return out


def _needs_grad(output: Any) -> list[torch.Tensor]:
    """The tensors in ``output`` (any nesting) that a backward will reach (none when gradients are off)."""
    if not torch.is_grad_enabled():
        return []
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` run under non-reentrant activation checkpointing when gradients are on."""

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def _block_paths(module: nn.Module, units: Sequence[nn.Module | str]) -> list[str]:
    """The dotted path of each block in ``module`` (checked: distinct, not nested, not the top module)."""
    path_of: dict[int, str] = {}
    for path, sub in module.named_modules():
        path_of.setdefault(id(sub), path)
    paths: list[str] = []
    for i, unit in enumerate(units):
        if isinstance(unit, str):
            try:
                module.get_submodule(unit)
            except AttributeError:
                raise field_error(f"shard_model.units[{i}]", unit, "name a submodule of the module") from None
            path = unit
        else:
            path = path_of.get(id(unit))
            if path is None:
                raise field_error(f"shard_model.units[{i}]", type(unit).__name__, "be a submodule of the module")
        if path in ("", ROOT_UNIT):
            raise field_error(f"shard_model.units[{i}]", path, f"be a block below the top module, not named "
                              f"`{ROOT_UNIT}` (the top module's own parameters form the root unit)")
        paths.append(path)
    for i, path in enumerate(paths):
        for other in paths[:i]:
            if path == other or path.startswith(other + ".") or other.startswith(path + "."):
                raise field_error(f"shard_model.units[{i}]", path, f"be distinct from and not nested in `{other}`")
    return paths


def _unit_slots(module: nn.Module, paths: list[str]) -> tuple[list[tuple[nn.Module, str, str]],
                                                                 list[list[tuple[nn.Module, str, str]]]]:
    """Every parameter slot ``(owner, attribute, full name)`` of the root and of each block, in module order."""
    root: list[tuple[nn.Module, str, str]] = []
    blocks: list[list[tuple[nn.Module, str, str]]] = [[] for _ in paths]
    unit_of_param: dict[int, int] = {}
    for path, owner in module.named_modules(remove_duplicate=False):
        unit = next((i for i, p in enumerate(paths) if path == p or path.startswith(p + ".")), -1)
        for attr, param in owner.named_parameters(recurse=False, remove_duplicate=False):
            if param is None:
                continue
            name = f"{path}.{attr}" if path else attr
            if unit_of_param.setdefault(id(param), unit) != unit:
                raise field_error("shard_model.units", name, "not share a parameter between two units",
                                  "put the modules that tie it into one unit, or the root")
            (blocks[unit] if unit >= 0 else root).append((owner, attr, name))
    return root, blocks


def shard_model(module: nn.Module, units: Sequence[nn.Module | str], fractions: Sequence[float], rank: int,
                world: int, group: Any = None, param_dtype: torch.dtype | None = None,
                reduce_dtype: torch.dtype = torch.float32, prefetch: bool = True,
                checkpoint_activations: bool = False, sync_module_states: bool = False) -> ShardedModel:
    """Shard ``module`` in place over the ranks of ``group`` (module docstring) and return its ``ShardedModel``.

    ``units``: the blocks (submodules, or their dotted names), in forward order; the parameters outside them form
    the root unit.  ``fractions``: one per rank of ``group``, summing to 1 (``core.shard_sizes``).  ``rank`` /
    ``world``: this rank's rank in ``group`` and the group's size.  ``param_dtype``: the dtype this rank computes the
    units in (default: the parameters' own; it may differ between ranks: per-device precision); shards are float32
    (float64 for float64 parameters).  ``reduce_dtype``: the gradients' reduction dtype (the widest rank's compute
    dtype where that is wider; ``flat_unit.agree_dtypes``).
    ``checkpoint_activations``: recompute each block's forward in its backward.  ``sync_module_states``: start
    from rank 0's values (one broadcast per unit) rather than from each rank's own, which must then be equal.

    Every rank of ``group`` calls it with the same module structure, units and fractions."""
    if not torch.distributed.is_initialized():
        raise field_error("shard_model.group", group, "belong to an initialized process group",
                          "call torch.distributed.init_process_group first")
    if (rank, world) != (torch.distributed.get_rank(group), torch.distributed.get_world_size(group)):
        raise field_error("shard_model.rank", (rank, world), f"be this rank's rank and the group's size "
                          f"{(torch.distributed.get_rank(group), torch.distributed.get_world_size(group))}")
    if len(fractions) != world:
        raise field_error("shard_model.fractions", list(fractions), f"hold one fraction per rank ({world})")
    state_keys = list(module.state_dict(keep_vars=True).keys())
    paths = _block_paths(module, units)
    root_slots, block_slots = _unit_slots(module, paths)
    block_modules = [module.get_submodule(path) for path in paths]

    def unit(name: str, owner: nn.Module, slots: list[tuple[nn.Module, str, str]]) -> FlatUnit:
        return FlatUnit(name, owner, slots, fractions, rank, world, group, param_dtype, reduce_dtype,
                        sync_module_states)

    blocks = [unit(path, block, slots) for path, block, slots in zip(paths, block_modules, block_slots)]
    root = unit(ROOT_UNIT, module, root_slots) if root_slots else None
    agree_dtypes(([root] if root is not None else []) + blocks, reduce_dtype, group)
    if checkpoint_activations:
        for block in block_modules:
            block.forward = _checkpointed(block.forward)  # type: ignore[method-assign]
    sharded = ShardedModel(module, root, blocks, block_modules, rank, world, group, prefetch, state_keys)
    rank_debug(rank, "hetero_fsdp: %d units, %d of %d elements here", len(sharded.units),
               sum(u.sizes[rank] for u in sharded.units), sum(u.numel for u in sharded.units))
    return sharded
