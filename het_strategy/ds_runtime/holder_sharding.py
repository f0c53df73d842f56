"""ZeRO-1 for a per-replica plan: the optimizer state sharded over the ranks that hold the same parameters
(or kept whole by each of them, for mixed per-device precision at ZeRO 0).

DeepSpeed's ZeRO shards over one data-parallel group per rank.  A per-replica
plan (asymmetric stage boundaries, tensor parallelism: ``replica_engine``) has
no such group: a rank's layers are held by different sets of ranks
(``ReplicaLayout.holder_sets``: layers 0-1 by ranks (0, 1, 3), layers 2-5 by
(0, 2, 3)).  ``HolderSetSharding`` shards within each of them instead, as
ZeRO-1 does within its group (a reduce-scatter into each holder's chunk, the
user's optimizer stepping on the chunks, an all-gather); its docstring has the
steps, the 16-bit master weights, fp16's loss scale and the unsharded form.

Invariants:

- every holder of a set cuts the same runs and reduces them in ``holder_sets``
  order, so no two ranks wait on each other in opposite orders;
- every element of the model is in exactly one chunk in the world, so the
  global norm is one all-reduce of the chunks' squared norms;
- fp16's overflow decision is one all-reduce over the world: every rank skips
  the same steps and keeps the same loss scale;
- the optimizer updates each element from that element's own state (SGD, Adam,
  AdamW; a per-tensor norm, as LAMB's, would be taken over a chunk).

``full_state`` / ``set_full_state`` and ``full_values`` / ``set_full_values`` gather and scatter the state
and the master weights per parameter, for the per-layer checkpoint files (``layer_state``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import torch

from het_strategy.core.errors import field_error
from het_strategy.ds_runtime.clipping import clip_gradients
from het_strategy.ds_runtime.holder_reduction import GradientPart, gradient_of, scaled_flat

__all__ = ["HolderSetSharding"]


_MASTERS = "het_master"
"""The optimizer ``state_dict`` key of the fp32 master chunks (16-bit parameters)."""
_LOSS_SCALE = "het_loss_scale"
"""The optimizer ``state_dict`` key of the fp16 loss scaler's state."""
_SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class _Run:
    """Consecutive parts of one holder set and one param group, and this rank's chunk of them."""

    def __init__(self, parts: list[GradientPart], group: Any, holders: int, shard: bool = True) -> None:
        import deepspeed.comm as dist

        self.parts, self.group, self.holders, self.shard = parts, group, holders, shard
        self.sizes = [part.view(part.param.detach()).numel() for part in parts]
        self.total = sum(self.sizes)
        self.per = -(-self.total // holders) if shard else self.total
        """Elements per chunk (sharded: the last holders' chunks are padded or empty; else the whole run)."""
        index = dist.get_rank(group=group) if shard else 0  # the chunk this rank owns: its rank in the set's group
        self.counted = shard or dist.get_rank(group=group) == 0
        """This rank's chunk enters the global norm (unsharded: the set's first holder counts the run)."""
        self.lo = min(index * self.per, self.total)
        self.hi = min(self.lo + self.per, self.total)
        self.param_dtype = parts[0].param.dtype
        dtype = torch.promote_types(self.param_dtype, torch.float32)
        self.chunk = torch.zeros(self.hi - self.lo, dtype=dtype, device=parts[0].param.device)
        """This rank's slice, the tensor the optimizer steps on: the master weights."""

    def _slices(self) -> Any:
        """(part, start, stop within the part, start within the chunk) of every part overlapping the chunk."""
        offset = 0
        for part, size in zip(self.parts, self.sizes):
            a, b = max(self.lo, offset), min(self.hi, offset + size)
            if a < b:
                yield part, a - offset, b - offset, a - self.lo
            offset += size

    def read(self, tensor_of: Any) -> torch.Tensor:
        """This chunk's slice of the tensors ``tensor_of(param)`` (the parameters, their gradients, ...)."""
        out = torch.empty_like(self.chunk)
        for part, a, b, at in self._slices():
            out[at:at + b - a] = part.view(tensor_of(part.param)).reshape(-1)[a:b]
        return out

    def reduce(self) -> torch.Tensor:
        """This chunk's slice of the run's gradients summed over the holders (a collective: a reduce-scatter, or
        unsharded an all-reduce)."""
        import deepspeed.comm as dist

        flat = scaled_flat([part.view(gradient_of(part.param, None)) for part in self.parts], self.parts)
        flat = flat.to(self.chunk.dtype)
        if not self.shard:  # every holder keeps the whole run (``flat`` is a new tensor: torch.cat's)
            dist.all_reduce(flat, group=self.group)
            return flat
        flat = torch.nn.functional.pad(flat, (0, self.per * self.holders - self.total))
        out = torch.empty(self.per, dtype=flat.dtype, device=flat.device)
        dist.reduce_scatter_tensor(out, flat, group=self.group)
        return out[:self.hi - self.lo]

    def gather(self, chunk: torch.Tensor) -> torch.Tensor:
        """Every holder's ``chunk`` of this run, concatenated: the run's whole flat vector (a collective)."""
        import deepspeed.comm as dist

        if not self.shard:
            return chunk
        padded = torch.zeros(self.per, dtype=chunk.dtype, device=chunk.device)
        padded[:chunk.numel()] = chunk
        pieces = [torch.empty_like(padded) for _ in range(self.holders)]
        dist.all_gather(pieces, padded, group=self.group)
        return torch.cat(pieces)[:self.total]

    def write(self, flat: torch.Tensor, tensor_of: Any) -> None:
        """Copy the run's flat vector ``flat`` into the tensors ``tensor_of(param)``, part by part."""
        offset = 0
        for part, size in zip(self.parts, self.sizes):
            view = part.view(tensor_of(part.param))
            view.copy_(flat[offset:offset + size].view(view.shape).to(view.dtype))
            offset += size


class HolderSetSharding:
    """Reduce into, and shard ``optimizer``'s state over, the holder sets of this rank's parameters; called as the
    plan's gradient reduction.  ``shard=False``: every holder keeps the state whole.

    As ZeRO-1 within its group (DeepSpeed's ``stage_1_and_2``: a flat partition
    per rank, a reduce-scatter into it, the client optimizer stepping on it, then
    an all-gather):

    1. This rank's parts (``holder_reduction.holder_parts``: units of shards and
       whole parameters, per holder set, in the same order on every holder) are
       cut into *runs*: consecutive parts of one optimizer param group.  Every
       holder of a set cuts the same runs, since each parameter sits in the same
       param group on every rank (``configure_optimizers`` is the same code).
    2. A run of ``N`` elements over a set of ``k`` ranks is split into ``k``
       chunks of ``ceil(N / k)``; the holder of group rank ``i`` owns chunk ``i``.
       The user's optimizer is rewritten in place to hold this rank's chunks
       instead of its parameters (its param groups keep their hyperparameters, so
       learning-rate schedulers go on working), so its state (Adam's moments,
       SGD's momentum) exists for ``1 / k`` of the elements.
    3. The gradient reduction (the schedule's ``ReduceGrads``, in place of
       ``HolderSetReducer``): per run, in ``holder_sets`` order (no two ranks wait
       on each other in opposite orders), one reduce-scatter of the gradients
       (replicated parts of a tp stage scaled by ``1 / tp``, as the reducer does)
       into the owner's chunk, divided by the replica count.  Every element of the
       model is then in exactly one chunk in the world, so clipping takes the
       global norm as one all-reduce of the chunks' squared norms.
    4. After the step (a post-hook) every run all-gathers its chunks and writes
       the updated values into each holder's parameters.  The chunks are the
       master weights: before a step (a pre-hook) a chunk element is taken from
       its parameter only where the parameter no longer holds the chunk's value
       rounded to the parameter's dtype, i.e. where something else set it (the
       first step, a checkpoint load, a user's edit).

    **bf16 and fp16** (DeepSpeed's bf16 / fp16 off, the layers cast by the
    engine builder): the chunks are fp32, so each holder keeps ``1 / k`` of the
    fp32 master weights, as DeepSpeed's ZeRO-1 keeps its fp32 partition
    (``single_partition_of_fp32_groups``); the gradients accumulate in the
    parameters' 16-bit ``.grad`` over the micro-batches (DeepSpeed's default
    ``grad_accum_dtype``: the model's dtype) and are reduced in fp32.  The
    chunks ride along in the optimizer's ``state_dict`` (``het_master``), so a
    DeepSpeed checkpoint restores them exactly.

    **fp16's loss scale** is DeepSpeed's ``DynamicLossScaler`` (``scaler``): the
    engine multiplies the last stage's loss by ``loss_scale``, the reduction
    divides the chunks' gradients by it, and one all-reduce (max) over the world
    of "a chunk holds an inf or a nan" is every rank's overflow decision (an
    overflow on one rank reaches only its own holder sets through the
    reduce-scatter; the other sets' holders must skip too).  On an overflow every
    chunk's gradient is dropped, so the optimizer leaves chunks and state as they
    are, and ``optimizer.overflow`` tells DeepSpeed's engine, which counts a
    skipped step and holds the learning-rate scheduler, as with its own fp16
    optimizers; the scale is updated either way.  The scaler's state rides in the
    ``state_dict`` too (``het_loss_scale``).

    **Unsharded** (``shard=False``, a ``per_device`` plan at ZeRO 0: bf16 on some
    ranks and fp16 on others, which DeepSpeed's one precision config cannot run):
    each holder keeps its runs whole (one chunk per run, the fp32 masters and the
    optimizer state of all of it, as DeepSpeed's ``BF16_Optimizer`` does at
    ZeRO 0), the reduction is one all-reduce per run, nothing is gathered after
    the step, and the global norm counts each run on the set's first holder.
    Since chunks, reductions and the scale are fp32, holders computing in
    different dtypes reduce together; each writes the masters back rounded to its
    own parameters' dtype.

    A step moves what the reducer's all-reduce moves (a reduce-scatter and an
    all-gather), the same as DeepSpeed's ZeRO-1, and the cost model's sync.  The
    optimizer must update each element from that element's own state, as SGD,
    Adam and AdamW do (DeepSpeed's ZeRO asks the same: a per-tensor norm, as
    LAMB's, would be taken over a chunk).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, buckets: Sequence[tuple[tuple[int, ...], list[GradientPart]]],
                 groups: dict[tuple[int, ...], Any], num_replicas: int, gradient_clipping: float,
                 scaler: Any = None, shard: bool = True) -> None:
        self.optimizer = optimizer
        self.num_replicas = num_replicas
        self.scaler = scaler
        """fp16's dynamic loss scaler (DeepSpeed's ``DynamicLossScaler``), or None."""
        self.gradient_clipping = float(gradient_clipping)
        """The largest global norm the reduction clips to (0: off)."""
        self.last_norm: float | None = None
        """The global gradient norm of the last step (before clipping), when clipping is on."""
        self.last_reduce_s = 0.0
        """Wall seconds of the last step's reduction (waiting for the other holders included)."""
        group_of = {id(q): g for g, group in enumerate(optimizer.param_groups) for q in group["params"]}
        self.runs: list[_Run] = []
        chunks: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
        for hs, parts in buckets:
            for part in parts:
                if id(part.param) not in group_of:
                    raise field_error("configure_optimizers", "an optimizer without some of this rank's parameters",
                                      "build the optimizer over self.parameters()")
            for g, run_parts in itertools.groupby(parts, key=lambda part: group_of[id(part.param)]):
                run = _Run(list(run_parts), groups[hs], len(hs), shard)
                self.runs.append(run)
                chunks[g].append(run.chunk)
        for group, held in zip(optimizer.param_groups, chunks):
            group["params"] = held
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.register_step_post_hook(self._after_step)
        self.mixed = any(run.chunk.dtype != run.param_dtype for run in self.runs)
        """The parameters are in a lower precision than the chunks (bf16): the chunks are checkpointed too."""
        if self.mixed:
            optimizer.register_state_dict_post_hook(self._save_masters)
            optimizer.register_load_state_dict_pre_hook(self._load_masters)

    @property
    def loss_scale(self) -> float | None:
        """What the last stage multiplies its loss by (fp16), or None."""
        return None if self.scaler is None else float(self.scaler.cur_scale)

    @property
    def chunks(self) -> list[torch.Tensor]:
        """The tensors the optimizer steps on, one per run."""
        return [run.chunk for run in self.runs]

    @torch.no_grad()
    def __call__(self, module: torch.nn.Module, optimizer: Any = None) -> None:
        """Reduce this step's gradients into the chunks, then clip them by the global norm (class docstring)."""
        t0 = time.perf_counter()
        scale = self.loss_scale or 1.0
        for run in self.runs:
            run.chunk.grad = run.reduce().div_(self.num_replicas * scale)
        if self.scaler is not None and self._overflowed():
            for run in self.runs:
                run.chunk.grad = None  # the optimizer skips a parameter without a gradient: nothing moves
        elif self.gradient_clipping > 0:
            grads = [run.chunk.grad for run in self.runs]
            self.last_norm = clip_gradients(grads, [run.counted for run in self.runs], self.gradient_clipping, None)
        self.last_reduce_s = time.perf_counter() - t0

    def _overflowed(self) -> bool:
        """Whether any rank's chunks hold an inf or a nan (one all-reduce over the world); updates the scale and
        ``optimizer.overflow`` (class docstring)."""
        import deepspeed.comm as dist

        bad = any(not bool(torch.isfinite(run.chunk.grad).all()) for run in self.runs)
        flag = torch.tensor([1.0 if bad else 0.0], device=self.runs[0].chunk.device if self.runs else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        overflow = bool(flag.item() > 0)
        self.scaler.update_scale(overflow)
        self.optimizer.overflow = overflow  # type: ignore[attr-defined]  # DeepSpeed's engine reads it
        return overflow

    @torch.no_grad()
    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for run in self.runs:
            current = run.read(lambda q: q.detach())
            changed = current != run.chunk.to(run.param_dtype).to(run.chunk.dtype)
            run.chunk[changed] = current[changed]

    def scaler_state(self) -> dict[str, float] | None:
        """The fp16 loss scaler's state (the same on every rank: one overflow decision), or None."""
        return None if self.scaler is None else {k: float(getattr(self.scaler, k)) for k in _SCALER_FIELDS}

    def load_scaler_state(self, state: dict[str, float] | None) -> None:
        """Restore ``scaler_state()``'s figures (nothing without a scaler or a state)."""
        if self.scaler is not None and state is not None:
            for key in _SCALER_FIELDS:
                setattr(self.scaler, key, type(getattr(self.scaler, key))(state[key]))

    def _save_masters(self, optimizer: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state_dict[_MASTERS] = [run.chunk.detach().clone() for run in self.runs]
        if self.scaler is not None:
            state_dict[_LOSS_SCALE] = self.scaler_state()
        return state_dict

    @torch.no_grad()
    def _load_masters(self, optimizer: Any, state_dict: dict[str, Any]) -> None:
        self.load_scaler_state(state_dict.pop(_LOSS_SCALE, None))
        masters = state_dict.pop(_MASTERS, None)
        if masters is None:
            return  # from parameters alone: the first step takes the chunks from them
        if [tuple(m.shape) for m in masters] != [tuple(run.chunk.shape) for run in self.runs]:
            raise field_error("checkpoint.optimizer." + _MASTERS, [tuple(m.shape) for m in masters],
                              f"be this rank's chunks {[tuple(run.chunk.shape) for run in self.runs]} (a checkpoint "
                              "of the same plan)", "load per-layer files (layer_state) into another plan")
        for run, master in zip(self.runs, masters):
            run.chunk.copy_(master.to(run.chunk.dtype))

    @torch.no_grad()
    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for run in self.runs:
            run.write(run.gather(run.chunk), lambda q: q.data)
            run.chunk.grad = None

    @torch.no_grad()
    def full_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Every per-element state tensor of the optimizer (``exp_avg``, ``momentum_buffer``, ...), whole, per
        parameter of this rank (by ``id``); a collective over every holder set, in order."""
        keys = sorted({k for chunk in self.chunks for k, v in self.optimizer.state.get(chunk, {}).items()
                       if torch.is_tensor(v) and v.dim() > 0})
        out: dict[int, dict[str, torch.Tensor]] = {}
        for run in self.runs:
            for key in keys:
                state = self.optimizer.state.get(run.chunk, {}).get(key)
                flat = run.gather(state if state is not None else torch.zeros_like(run.chunk))
                run.write(flat, lambda q, key=key: out.setdefault(id(q), {}).setdefault(
                    key, torch.zeros_like(q, dtype=run.chunk.dtype)))
        return out

    @torch.no_grad()
    def full_values(self) -> dict[int, torch.Tensor]:
        """The master weights, whole, per parameter of this rank (by ``id``); a collective, as ``full_state``."""
        out: dict[int, torch.Tensor] = {}
        for run in self.runs:
            run.write(run.gather(run.chunk),
                      lambda q, run=run: out.setdefault(id(q), torch.zeros_like(q, dtype=run.chunk.dtype)))
        return out

    @torch.no_grad()
    def set_full_values(self, values: dict[int, torch.Tensor]) -> None:
        """Give each chunk its slice of the whole master weights ``values`` (by parameter ``id``)."""
        for run in self.runs:
            run.chunk.copy_(run.read(lambda q: values[id(q)].to(run.chunk.dtype)))

    @torch.no_grad()
    def set_full_state(self, states: dict[int, dict[str, torch.Tensor]], step: Any) -> None:
        """Give each chunk its slice of the whole per-parameter ``states`` (by parameter ``id``) and ``step``."""
        for run in self.runs:
            keys = sorted({k for part in run.parts for k in states.get(id(part.param), {})})
            state = self.optimizer.state[run.chunk]
            for key in keys:
                state[key] = run.read(lambda q, key=key: states[id(q)][key].to(run.chunk.dtype))
            if step is not None and keys:
                state["step"] = torch.tensor(float(step))
