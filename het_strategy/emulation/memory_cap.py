"""Emulated device memory: what one rank holds, counted tensor by tensor, and a cap it must stay under.

A CPU process has no allocator peak and no memory limit, so an emulated cluster's ``memory_gb`` means nothing to
it by itself.  ``MemoryMeter`` stands in for the device's allocator: it counts the bytes one rank holds in the
tensors that training keeps (each storage once, by part: ``PARTS``), keeps their peak, and, given a cap (the
emulated device's ``memory_gb``), raises ``EmulatedOutOfMemoryError`` the moment the count exceeds it, naming the
rank, the device, the bytes needed and the cap.  Like the speed padding (``emulation.speeds``), it is a test and
benchmark device: it is on only where a caller builds one (``MemoryMeter.for_device`` logs one line saying so),
never silently.  ``MemoryMeter``'s docstring says what it counts and what it leaves out.

Usage (per rank)::

    meter = MemoryMeter.for_device(cluster, device_name, rank, sharded=sharded, optimizer=optimizer)
    for x, y in batches:
        with meter.track():
            loss = compute_loss(sharded(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    meter.peak_bytes, meter.peak_parts
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch

from het_strategy.core.errors import field_error
from het_strategy.core.log import rank_zero_info

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec

__all__ = ["MemoryMeter", "EmulatedOutOfMemoryError", "PARTS", "format_bytes"]

PARTS = ("parameters", "gradients", "optimizer", "gathered", "collectives", "activations")
"""The parts of a count, in the order the module docstring lists them."""

_GiB = 2**30


def format_bytes(num_bytes: float) -> str:
    """``1.32 GiB`` from 1 GiB up, else ``12.34 MiB``."""
    return f"{num_bytes / _GiB:.2f} GiB" if abs(num_bytes) >= _GiB else f"{num_bytes / 2**20:.2f} MiB"


class EmulatedOutOfMemoryError(torch.OutOfMemoryError):
    """A rank's counted bytes exceeded its emulated device's memory (``MemoryMeter`` with a cap): code that
    handles ``torch.OutOfMemoryError`` handles it alike."""

    def __init__(self, rank: int, device: str, need_bytes: float, cap_bytes: float, parts: dict[str, float]) -> None:
        self.rank, self.device, self.need_bytes, self.cap_bytes = rank, device, need_bytes, cap_bytes
        self.parts = dict(parts)
        by_part = " + ".join(f"{name} {format_bytes(parts[name])}" for name in PARTS)
        super().__init__(f"emulated out of memory: rank {rank} ({device}) needs {format_bytes(need_bytes)}, its "
                         f"emulated memory is {format_bytes(cap_bytes)} ({by_part})")


def _storage_key(tensor: torch.Tensor) -> int:
    """One number per storage, the same for every view of it and across ``resize_`` (the StorageImpl's address)."""
    return tensor.untyped_storage()._cdata


class _Packed:
    """What autograd keeps in place of a saved tensor: the tensor itself, plus a finalizer that releases its count."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class MemoryMeter:
    """The bytes one rank holds on its emulated device: ``peak_bytes`` since construction or ``reset_peak()``,
    ``current_bytes()``, and ``EmulatedOutOfMemoryError`` when ``cap_bytes`` is exceeded.

    ``sharded``: the rank's ``fsdp.ShardedModel`` (read through its ``units``; emulation sits below the runtimes
    and does not import them); ``params``: parameters of a model that is not sharded (counted whole, with their
    gradients); ``optimizer``: its state is counted, and a count taken after each of its steps.  ``cap_bytes=None``:
    count only.  What it counts (each storage once, however many tensors view it):

    1. **parameters**: the units' shards (``FlatUnit.shard``), or the ``params`` given;
    2. **gradients**: their ``.grad``;
    3. **optimizer**: every tensor in the optimizer's ``state`` (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``);
    4. **gathered**: each unit's gathered vector while it holds storage (``FlatUnit.full``: resized to 0 bytes when
       freed) and its whole-unit gradient while one exists (``full.grad``, until reduce-scattered);
    5. **collectives**: the buffers of each unit's collectives in flight (``FlatUnit.in_flight_tensors``: a
       prefetched gather's padded pieces, a reduce-scatter's input gradient and padded copy, until awaited);
    6. **activations**: the tensors autograd saves for backward, seen through
       ``torch.autograd.graph.saved_tensors_hooks`` inside ``track()``: a storage is counted from the first tensor
       saved from it until the last packed reference to it is released (``weakref.finalize`` on the packed
       object: autograd drops it once the backward has used it).  Saved tensors that view a parameter, a shard or
       a gathered vector (a linear layer saves its weight) are counted there, not again here.

    Not counted: the forward's outputs and temporaries that nothing saved (the logits the loss consumed, the
    batch unless saved), autograd's gradient buffers between nodes (an activation's gradient, a unit's per-view
    gradients before they are joined into ``full.grad``), a synchronous collective's buffers (alive only inside
    the call), and the allocator's rounding and fragmentation: on a real device those add to the peak.

    The count is taken at every event that can raise it (a tensor saved; one unpacked in backward, its unit
    gathered again; a unit's whole gradient computed; the optimizer's step) and at ``sample()``: the peak is the
    largest of those counts, with its parts (``peak_parts``).
    """

    def __init__(self, rank: int = 0, device: str = "", cap_bytes: float | None = None,
                 sharded: Any = None, params: Iterable[torch.Tensor] = (),
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        if cap_bytes is not None and not (isinstance(cap_bytes, (int, float)) and cap_bytes > 0):
            raise field_error("memory_cap.cap_bytes", cap_bytes, "be > 0 bytes, or None for no cap")
        self.rank, self.device, self.cap_bytes = rank, device, cap_bytes
        self.sharded = sharded
        self.optimizer = optimizer
        self._params = [p for p in params]
        self._live: dict[int, list[int]] = {}
        """Per saved storage: [packed references alive, its bytes]."""
        self.activation_bytes = 0
        """Bytes of the saved activations alive now."""
        self.peak_bytes = 0
        """The largest count taken since construction or ``reset_peak``."""
        self.peak_parts: dict[str, int] = dict.fromkeys(PARTS, 0)
        """That count by part (``PARTS``)."""
        self._hooks: list[Any] = []
        if optimizer is not None:
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.sample()))
        for unit in sharded.units if sharded is not None else ():
            if unit.full.requires_grad:  # the whole unit's gradient, computed and not yet reduce-scattered
                self._hooks.append(unit.full.register_hook(self._unit_gradient))

    @classmethod
    def for_device(cls, cluster: "ClusterSpec", device: str, rank: int, sharded: Any = None,
                   params: Iterable[torch.Tensor] = (), optimizer: torch.optim.Optimizer | None = None,
                   cap: bool = True) -> "MemoryMeter":
        """The meter of the rank playing ``device`` of ``cluster``, capped at its ``memory_gb`` (``cap=False``:
        counting only); says so in one log line."""
        spec = cluster.device(device)
        cap_bytes = float(spec.memory_bytes) if cap else None
        rank_zero_info(0, "EMULATED memory: rank %d (%s) counts the tensors it holds%s", rank, device,
                       f", capped at {format_bytes(cap_bytes)}" if cap_bytes is not None else " (no cap)")
        return cls(rank, device, cap_bytes, sharded, params, optimizer)

    def close(self) -> None:
        """Remove the meter's hooks (the optimizer's step, the units' gradients)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- the count -------------------------------------------------------------------------------------
    def _owned(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of parts 1-5 held now, with its part (storages may repeat: the caller counts each once)."""
        out: list[tuple[str, torch.Tensor]] = []
        units = self.sharded.units if self.sharded is not None else []
        for p in self._params + [u.shard for u in units]:
            out.append(("parameters", p))
            if p.grad is not None:
                out.append(("gradients", p.grad))
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out.extend(("optimizer", v) for v in state.values() if isinstance(v, torch.Tensor))
        for unit in units:
            out.append(("gathered", unit.full))
            if unit.full.grad is not None:
                out.append(("gathered", unit.full.grad))
        for unit in units:  # after the others: a gather's send buffer may be the shard itself
            out.extend(("collectives", t) for t in unit.in_flight_tensors())
        return out

    def parts(self) -> dict[str, int]:
        """The count now, by part (each storage once, in the first part that holds it)."""
        counted: set[int] = set()
        parts = dict.fromkeys(PARTS, 0)
        for part, tensor in self._owned():
            key = _storage_key(tensor)
            if key not in counted:
                counted.add(key)
                parts[part] += tensor.untyped_storage().nbytes()
        parts["activations"] = self.activation_bytes
        return parts

    def current_bytes(self) -> int:
        """The count now (every part)."""
        return sum(self.parts().values())

    def sample(self, gathered_extra: int = 0) -> int:
        """Take a count now (plus ``gathered_extra`` bytes of a gathered unit's gradient about to be stored):
        update the peak, raise ``EmulatedOutOfMemoryError`` above the cap; returns the count."""
        parts = self.parts()
        parts["gathered"] += gathered_extra
        total = sum(parts.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_parts = total, parts
        if self.cap_bytes is not None and total > self.cap_bytes:
            raise EmulatedOutOfMemoryError(self.rank, self.device, total, self.cap_bytes, parts)
        return total

    def reset_peak(self) -> None:
        """Start the peak again from the count now (no check against the cap)."""
        parts = self.parts()
        self.peak_bytes, self.peak_parts = sum(parts.values()), parts

    # -- activations -----------------------------------------------------------------------------------
    @contextmanager
    def track(self) -> Iterator["MemoryMeter"]:
        """Count the tensors autograd saves inside the block (the forward); the backward, wherever it runs,
        releases them."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self

    def _pack(self, tensor: torch.Tensor) -> Any:
        key = _storage_key(tensor)
        if key in {_storage_key(t) for _, t in self._owned()}:  # a parameter's, a shard's or a gathered view
            return tensor
        packed = _Packed(tensor)
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, tensor.untyped_storage().nbytes()]
            self.activation_bytes += entry[1]
        entry[0] += 1
        weakref.finalize(packed, self._release, key)
        if entry[0] == 1:
            self.sample()
        return packed

    def _unpack(self, packed: Any) -> torch.Tensor:
        self.sample()  # backward: the unit this tensor belongs to is gathered again now
        return packed.tensor if isinstance(packed, _Packed) else packed

    def _unit_gradient(self, grad: torch.Tensor) -> None:
        self.sample(grad.untyped_storage().nbytes())

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.activation_bytes -= entry[1]
            del self._live[key]
