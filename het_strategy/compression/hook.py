"""The DDP comm hook: per-layer compression, its state in ``state.py``.

Usage on any DDP model (CPU/gloo or CUDA/NCCL)::

    state = CompressionState(ddp_model, CompressionConfig(method="adaptive"))
    ddp_model.register_comm_hook(state, compression_hook)

or ``Trainer(strategy=HeteroStrategy(compression="adaptive"))``.

``compression_hook`` gives each layer of a bucket a codec (``none`` during
warm-up and for small or 1-D tensors; afterwards the configured method or the
controller's per-layer choice) and exchanges each codec's group of layers
through its ``Exchange`` (``exchange.py``); its docstring has the steps.

Invariants:

- gradients are keyed by their parameter's name, stable across restarts and
  DDP's bucket rebuilds, so error-feedback buffers and choices survive both;
- every rank issues the same collectives in the same order: codec groups go in
  ``Codec`` order, and on NCCL the chained callbacks write means and residuals
  in that same fixed order (``exchange.overlaps`` states why gloo runs each
  collective to completion instead).
"""

import zlib

import torch
import torch.distributed as dist

from het_strategy.compression.torch_codecs import wire_bytes
from het_strategy.compression.exchange import Steps, allreduce_steps, quantized_steps, run_steps, topk_steps
from het_strategy.compression.state import CompressionState
from het_strategy.core.codecs import CODECS, Codec, Exchange
from het_strategy.core.network import ring_allreduce_bytes

__all__ = ["compression_hook"]

_ORDER = list(Codec)


class _SubBucket:
    """A bucket of only the layers routed to PowerSGD, in the shape torch's hook expects."""

    def __init__(self, key: int, grads: list[torch.Tensor]) -> None:
        self._key = key
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._views, start = [], 0
        for g in grads:
            self._views.append(self._buffer[start:start + g.numel()].view_as(g))
            start += g.numel()

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return self._key

    def is_last(self) -> bool:
        return False  # our state counts steps; torch's stays past its warm-up

    def parameters(self) -> list[torch.Tensor]:
        return self._views

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def compression_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: compress each layer of the bucket as ``state`` says.

    1. Name each gradient by its parameter (names are stable across restarts and
       DDP's bucket rebuilds, so error-feedback buffers and choices key by them).
    2. Give each a codec token: ``none`` during warm-up and for small or 1-D
       tensors; afterwards the configured method, or the controller's per-layer
       choice (``adaptive``; on a measuring step the controller first measures the
       bucket's eligible layers, ``adaptive.py``).
    3. If the whole bucket is ``none``, launch one asynchronous allreduce, exactly
       what DDP does without a hook.  Otherwise add each layer's error-feedback
       residual, exchange each codec's group of layers through the collective of
       its ``Exchange`` (``core/codecs.py``, ``exchange.py``; groups in ``Codec``
       order, so every rank issues the same collectives), write the means into the
       bucket and keep the new residuals.  On NCCL the compressed exchange is
       chained on its collectives' futures (``exchange.run_steps``): each phase is
       launched from the ``then`` of the one before, the means and residuals are
       written in those callbacks in the same fixed order, and the hook returns at
       once; on gloo and every other backend each collective runs to completion
       inside the hook and the returned future is already completed
       (``exchange.overlaps`` states why).
    4. On the last bucket of a step, ``CompressionState.end_step``: count the step
       and, for ``adaptive``, let the controller re-solve when due (for a
       compressed bucket, as the last step of its exchange: its collectives follow
       the bucket's).
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    uncompressed = ring_allreduce_bytes(bucket.buffer().numel() * bucket.buffer().element_size(), world)
    state.bytes_fp32 += uncompressed
    state.note_bucket(bucket)
    tokens: list[Codec] = []
    if not state.uncompressed_step():
        grads = bucket.gradients()
        names = [state.param_name(p, bucket.index(), i) for i, p in enumerate(bucket.parameters())]
        if state.measuring():
            state.measure(names, grads, bucket.index())
        tokens = [state.token_for(n, g) for n, g in zip(names, grads)]
        if all(t == Codec.NONE for t in tokens) and not any(n in state.residuals for n in names):
            tokens = []
    if tokens:
        return run_steps(_compressed(state, names, grads, tokens, group, bucket.buffer(), bucket.is_last()),
                         group, bucket.buffer().device)
    # the common fast path: one asynchronous allreduce of the whole bucket, like DDP's default
    buffer = bucket.buffer()
    buffer.div_(world)
    state.bytes_sent += uncompressed
    fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    result = fut.then(lambda f: f.value()[0])
    if bucket.is_last():
        state.end_step(group, world, bucket.buffer().device)
    return result


def _compressed(state: CompressionState, names: list[str], grads: list[torch.Tensor], tokens: list[Codec],
                group: dist.ProcessGroup, buffer: torch.Tensor, last: bool) -> Steps[torch.Tensor]:
    """A compressed bucket's steps: its exchange, then, on the step's last bucket, ``end_step``; the buffer."""
    yield from _exchange_mixed(state, names, grads, tokens, group)
    if last:
        state.end_step(group, group.size(), buffer.device)
    return buffer


def _exchange_mixed(state: CompressionState, names: list[str], grads: list[torch.Tensor], tokens: list[Codec],
                    group: dist.ProcessGroup) -> Steps[None]:
    """Exchange each codec's layers of this bucket, in ``Codec`` order (the same collectives on every rank),
    one group after the other."""
    cfg = state.config
    inputs: list[torch.Tensor] = []
    for name, grad in zip(names, grads):
        flat = grad.reshape(-1).to(torch.float32)
        residual = state.residuals.pop(name, None)
        inputs.append(flat + residual.to(flat.device) if residual is not None else flat)
    by_token: dict[Codec, list[int]] = {}
    for i, token in enumerate(tokens):
        by_token.setdefault(token, []).append(i)
    for token in sorted(by_token, key=_ORDER.index):
        # by name, not bucket position: DDP's bucket rebuild after the first step reorders a bucket, and a
        # resumed run starts before it; the group's layout (and its saved residuals) must not depend on that
        members = sorted(by_token[token], key=names.__getitem__)
        spec = CODECS[token]
        if spec.exchange is Exchange.LOW_RANK:
            yield from _powersgd_exchange(state, [names[i] for i in members], [grads[i] for i in members],
                                          [inputs[i] for i in members])
            continue
        if spec.exchange is Exchange.ALLGATHER:
            means, delivered, sent = yield from topk_steps([inputs[i] for i in members], spec, cfg, group)
            for i, mean, got in zip(members, means, delivered):
                grads[i].copy_(mean.view_as(grads[i]))
                if cfg.error_feedback:
                    state.residuals[names[i]] = inputs[i] - got
            state.bytes_sent += sent
            continue
        flat = torch.cat([inputs[i] for i in members])
        if spec.exchange is Exchange.ALLREDUCE:
            # a codec without a wire dtype goes in the gradients' own (a bf16 model's stay bf16 on the wire)
            out = yield from allreduce_steps(flat if spec.wire_dtype else flat.to(grads[members[0]].dtype), spec,
                                             cfg, group)
        else:
            key = f"{token}:" + "|".join(names[i] for i in members)
            out = yield from quantized_steps(flat, spec, cfg, group, state.generator,
                                             state.chunk_residuals.pop(key, None))
            if cfg.error_feedback and out.chunk_residual is not None:
                state.keep_chunk_residual(key, out.chunk_residual)
        state.bytes_sent += out.bytes_sent
        start = 0
        for i in members:
            n = inputs[i].numel()
            grads[i].copy_(out.mean[start:start + n].view_as(grads[i]))
            if spec.exchange is Exchange.QUANTIZED and cfg.error_feedback:
                state.residuals[names[i]] = inputs[i] - out.delivered[start:start + n]
            start += n


def _powersgd_exchange(state: CompressionState, names: list[str], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor]) -> Steps[None]:
    """torch's ``powerSGD_hook`` on a bucket of only these layers (its state keyed by their names); its future
    is this step's (torch chains its own allreduces on it)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    psgd = state.powersgd_state()
    key = zlib.crc32("|".join(names).encode())
    sub = _SubBucket(key, [x.view_as(g) for x, g in zip(inputs, grads)])
    world = (state.process_group or dist.group.WORLD).size()
    # torch's hook launches its later allreduces from callbacks: waited for at once off NCCL (exchange.overlaps)
    mean = yield powerSGD_hook(psgd, sub)
    start = 0
    for grad in grads:
        grad.copy_(mean[start:start + grad.numel()].view_as(grad))
        start += grad.numel()
        state.bytes_sent += wire_bytes(Codec.POWERSGD, list(grad.shape), world, state.config)
