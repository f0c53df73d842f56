"""The DDP comm hook: per-layer compression with checkpointable state.

Usage on any DDP model (CPU/gloo or CUDA/NCCL)::

    state = CompressionState(ddp_model, CompressionConfig(method="adaptive"))
    ddp_model.register_comm_hook(state, compression_hook)

or ``Trainer(strategy=HeteroStrategy(compression="adaptive"))``.

What one call does, for one gradient bucket:

1. Name each gradient by its parameter (names are stable across restarts and
   DDP's bucket rebuilds, so error-feedback buffers and choices key by them).
2. Give each a method token: ``none`` during warm-up and for small or 1-D
   tensors; afterwards the configured method, or the controller's per-layer
   choice (``adaptive``).
3. If the whole bucket is ``none``, launch one asynchronous allreduce, exactly
   what DDP does without a hook.  Otherwise add each layer's error-feedback
   residual, exchange each method's group of layers (``exchange.py``, in a
   fixed order so every rank issues the same collectives), write the means into
   the bucket and keep the new residuals.
4. On the last bucket of a step, count the step; on an ``adaptive`` measuring
   step, re-solve the per-layer choice (``adaptive.py``).
"""

import warnings
import zlib
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.config import CompressionConfig, compression_config, quantizer_for
from het_strategy.compression.adaptive import maybe_keep_off, measure_layers, solve
from het_strategy.compression.controller import LinkModel, wire_bytes
from het_strategy.compression.exchange import HALF_DTYPES, allreduce_mean, half_precision_mean, quantized_mean, \
    topk_mean
from het_strategy.core.errors import field_error

__all__ = ["CompressionState", "compression_hook", "STATE_VERSION"]

STATE_VERSION = 1
_ORDER = ("none", "fp16", "bf16", "q8", "q7", "q6", "q5", "q4", "q3", "q2", "topk", "powersgd")


class CompressionState:
    """Everything the hook remembers between steps; checkpointed (process group dropped).

    Args:
        module: the model (the DDP wrapper or its module): names the parameters.
        config: a ``CompressionConfig``, a method name or a mapping of its fields.
        process_group: the group to exchange over; ``None``: the default group.
    """

    __slots__ = (
        # what was asked, and over which group (the group is not saved)
        "config", "process_group",
        # parameter identity in this process: id(parameter) -> name (rebuilt, not saved)
        "_names",
        # progress: optimizer steps seen; the per-layer choice and when to re-solve it
        "step", "choices", "next_solve", "interval",
        # error feedback: per-layer residual of what compression left out last time, and per quantized group
        # this rank's residual of re-quantizing its chunk of the mean (keyed by the group's layer names)
        "residuals", "chunk_residuals",
        # torch's PowerSGD state for the layers that use it (its own error feedback and warm start)
        "powersgd",
        # measurements: per-layer statistics of the measuring step, the fitted link, the log
        # (bytes_fp32: what an uncompressed allreduce of the same buckets would send)
        "_stats", "link", "decisions", "bytes_sent", "bytes_fp32",
        # bookkeeping
        "_eligible_seen", "_steps_here", "_generator", "_chunk_keys_used",
        # from the last full solve: (least codec seconds any compression needs, fp32 wire bytes, buckets, elements)
        "_profile",
    )

    def __init__(self, module: torch.nn.Module, config: Any = "adaptive",
                 process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise field_error("module", type(module).__name__,
                              "be the torch.nn.Module (or its DDP wrapper) whose gradients are exchanged")
        cfg = compression_config(config)
        if cfg is None:
            raise field_error("config", None, "be a CompressionConfig, a method name or a mapping")
        self.config: CompressionConfig = cfg
        self.process_group = process_group
        self._names = {id(p): name for name, p in module.named_parameters()}
        self.step = 0
        self.choices: dict[str, str] = {}
        self.next_solve = cfg.warmup_steps
        self.interval = cfg.resolve_every
        self.residuals: dict[str, torch.Tensor] = {}
        self.chunk_residuals: dict[str, torch.Tensor] = {}
        self.powersgd: Any = None
        self._stats: dict[str, dict[str, Any]] = {}
        self.link: LinkModel | None = None
        self.decisions: list[dict[str, Any]] = []
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self._eligible_seen = False
        self._steps_here = 0  # steps this process has exchanged (a resumed run starts at 0 with step > 0)
        self._generator = torch.Generator()
        self._generator.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
        self._chunk_keys_used: set[str] = set()
        self._profile: tuple[float, int, int, int] | None = None

    # -- what each layer gets ---------------------------------------------------------------------
    def eligible(self, grad: torch.Tensor) -> bool:
        """Small and 1-D tensors are never compressed: the saving is nil and they are often sensitive."""
        return grad.dim() >= 2 and grad.numel() >= self.config.min_numel

    def token_for(self, name: str, grad: torch.Tensor) -> str:
        if not self.eligible(grad) or self.step < self.config.warmup_steps:
            return "none"
        if self.config.method == "adaptive":
            return self.choices.get(name, "none")
        return self.config.uniform_token

    @property
    def wire_ratio(self) -> float:
        """fp32-allreduce bytes over the bytes actually sent, so far."""
        return self.bytes_fp32 / self.bytes_sent if self.bytes_sent else 1.0

    def measuring(self) -> bool:
        return self.config.method == "adaptive" and self.step >= self.next_solve

    def uncompressed_step(self) -> bool:
        """True when every layer of every bucket goes uncompressed this step and no residual is pending: the
        hook then needs no per-layer work at all (looking up a bucket's gradients and parameters costs about a
        millisecond a step on a small GPT)."""
        if self.residuals or self.measuring():
            return False
        cfg = self.config
        if cfg.method == "none" or self.step < cfg.warmup_steps:
            return True
        return cfg.method == "adaptive" and all(t == "none" for t in self.choices.values())

    def _name(self, param: torch.Tensor, bucket_index: int, position: int) -> str:
        return self._names.get(id(param), f"bucket{bucket_index}.{position}")

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors on the CPU).  Error feedback is per rank: save every rank's (the hetero
        strategy gathers them into its Lightning checkpoint) and give each rank its own back."""
        powersgd = None
        if self.powersgd is not None:
            powersgd = self.powersgd.__getstate__()  # torch's own: drops the process group
        return {"version": STATE_VERSION, "config": self.config.to_dict(), "step": self.step,
                "choices": dict(self.choices), "next_solve": self.next_solve, "interval": self.interval,
                "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
                "chunk_residuals": {k: v.detach().cpu().clone() for k, v in self.chunk_residuals.items()},
                "generator": self._generator.get_state(),
                "powersgd": powersgd,
                "link": None if self.link is None else [self.link.latency_s, self.link.bytes_per_s],
                "decisions": list(self.decisions[-1000:]), "bytes_sent": self.bytes_sent,
                "bytes_fp32": self.bytes_fp32}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise field_error("compression state.version", state.get("version"), f"be {STATE_VERSION}",
                              "the checkpoint was written by another het_strategy")
        saved = compression_config(state["config"])
        if saved != self.config:
            warnings.warn(f"resuming with compression {self.config.to_dict()} instead of the checkpoint's "
                          f"{saved.to_dict() if saved else None}; its residuals and choices are kept")
        self.step = int(state["step"])
        self.choices = dict(state["choices"])
        self.next_solve = int(state["next_solve"])
        self.interval = int(state["interval"])
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.chunk_residuals = {k: v.clone() for k, v in state.get("chunk_residuals", {}).items()}
        if state.get("generator") is not None:
            self._generator.set_state(state["generator"])
        if state.get("powersgd") is not None:
            self._powersgd_state().__setstate__(dict(state["powersgd"]))
            self.powersgd.process_group = self.process_group
        self.link = None if state.get("link") is None else LinkModel(*state["link"])
        self.decisions = list(state.get("decisions", []))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.bytes_fp32 = int(state.get("bytes_fp32", 0))

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = compression_config(state["config"])  # type: ignore[assignment]
        self.process_group = None
        self._names = {}
        self.powersgd = None
        self._stats = {}
        self._eligible_seen = False
        self._steps_here = 0
        self._generator = torch.Generator()
        self._generator.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
        self._chunk_keys_used = set()
        self._profile = None
        self.residuals, self.chunk_residuals = {}, {}
        self.load_state_dict(state)

    def _powersgd_state(self) -> Any:
        if self.powersgd is None:
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            # start_powerSGD_iter must be > 1 with error feedback; our own warm-up decides when it runs
            self.powersgd = PowerSGDState(process_group=self.process_group,
                                          matrix_approximation_rank=self.config.rank,
                                          start_powerSGD_iter=2, min_compression_rate=1.0,
                                          use_error_feedback=self.config.error_feedback, warm_start=True)
            self.powersgd.iter = 2
        return self.powersgd


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
    """DDP comm hook: compress each layer of the bucket as ``state`` says (module docstring)."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    uncompressed = 2 * (world - 1) * bucket.buffer().numel() * bucket.buffer().element_size() // world
    state.bytes_fp32 += uncompressed
    if state._steps_here == 0 and any(state.eligible(g) for g in bucket.gradients()):
        state._eligible_seen = True
    tokens: list[str] = []
    if not state.uncompressed_step():
        grads = bucket.gradients()
        names = [state._name(p, bucket.index(), i) for i, p in enumerate(bucket.parameters())]
        if state.measuring():
            measure_layers(state, names, grads, bucket.index())
        tokens = [state.token_for(n, g) for n, g in zip(names, grads)]
        if all(t == "none" for t in tokens) and not any(n in state.residuals for n in names):
            tokens = []
    if not tokens:
        # the common fast path: one asynchronous allreduce of the whole bucket, like DDP's default
        buffer = bucket.buffer()
        buffer.div_(world)
        state.bytes_sent += uncompressed
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        result = fut.then(lambda f: f.value()[0])
    else:
        _exchange_mixed(state, names, grads, tokens, group)
        result = torch.futures.Future()
        result.set_result(bucket.buffer())

    if bucket.is_last():
        _end_step(state, group, world, bucket.buffer().device)
    return result


def _exchange_mixed(state: CompressionState, names: list[str], grads: list[torch.Tensor], tokens: list[str],
                    group: dist.ProcessGroup) -> None:
    """Exchange each method's layers of this bucket, in the fixed ``_ORDER`` (same collectives on every rank)."""
    cfg = state.config
    inputs: list[torch.Tensor] = []
    for name, grad in zip(names, grads):
        flat = grad.reshape(-1).to(torch.float32)
        residual = state.residuals.pop(name, None)
        inputs.append(flat + residual.to(flat.device) if residual is not None else flat)
    by_token: dict[str, list[int]] = {}
    for i, token in enumerate(tokens):
        by_token.setdefault(token, []).append(i)
    for token in sorted(by_token, key=_ORDER.index):
        # by name, not bucket position: DDP's bucket rebuild after the first step reorders a bucket, and a
        # resumed run starts before it; the group's layout (and its saved residuals) must not depend on that
        members = sorted(by_token[token], key=names.__getitem__)
        if token == "powersgd":
            _powersgd_exchange(state, [names[i] for i in members], [grads[i] for i in members],
                               [inputs[i] for i in members])
            continue
        if token == "topk":
            means, delivered, sent = topk_mean([inputs[i] for i in members], cfg.topk_ratio, group)
            for i, mean, got in zip(members, means, delivered):
                grads[i].copy_(mean.view_as(grads[i]))
                if cfg.error_feedback:
                    state.residuals[names[i]] = inputs[i] - got
            state.bytes_sent += sent
            continue
        flat = torch.cat([inputs[i] for i in members])
        if token == "none":  # in the gradients' own dtype (a bf16 model's stay bf16 on the wire)
            out = allreduce_mean(flat.to(grads[members[0]].dtype), group)
        elif token in HALF_DTYPES:
            out = half_precision_mean(flat, HALF_DTYPES[token], group)
        else:
            key = f"{token}:" + "|".join(names[i] for i in members)
            out = quantized_mean(flat, quantizer_for(token, cfg), group, state._generator,
                                 state.chunk_residuals.pop(key, None))
            if cfg.error_feedback and out.chunk_residual is not None:
                state.chunk_residuals[key] = out.chunk_residual
                state._chunk_keys_used.add(key)
        state.bytes_sent += out.bytes_sent
        start = 0
        for i in members:
            n = inputs[i].numel()
            grads[i].copy_(out.mean[start:start + n].view_as(grads[i]))
            if token.startswith("q") and cfg.error_feedback:
                state.residuals[names[i]] = inputs[i] - out.delivered[start:start + n]
            start += n


def _powersgd_exchange(state: CompressionState, names: list[str], grads: list[torch.Tensor],
                       inputs: list[torch.Tensor]) -> None:
    """torch's ``powerSGD_hook`` on a bucket of only these layers (its state keyed by their names)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    psgd = state._powersgd_state()
    key = zlib.crc32("|".join(names).encode())
    sub = _SubBucket(key, [x.view_as(g) for x, g in zip(inputs, grads)])
    world = (state.process_group or dist.group.WORLD).size()
    # wait here: torch's hook launches its later allreduces from callbacks (see exchange.py on ordering)
    mean = powerSGD_hook(psgd, sub).wait()
    start = 0
    for grad in grads:
        grad.copy_(mean[start:start + grad.numel()].view_as(grad))
        start += grad.numel()
        state.bytes_sent += wire_bytes("powersgd", list(grad.shape), world, state.config)


def _end_step(state: CompressionState, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
    """After the last bucket: count the step; warn once if nothing is eligible; re-solve when due."""
    if state._steps_here == 0 and not state._eligible_seen:
        if not dist.is_initialized() or dist.get_rank() == 0:
            warnings.warn("gradient compression: no parameter is eligible (every tensor is 1-D or has fewer "
                          f"than min_numel={state.config.min_numel} elements); gradients use plain allreduce")
    if state.measuring():
        if state._stats:
            solve(state, group, world, device)
        else:  # nothing eligible was measured (the same on every rank): look again later
            state.next_solve = state.step + 1 + state.interval
    elif state.step + 1 == state.next_solve:
        maybe_keep_off(state, group, world, device)
    state._stats = {}
    # a group whose layers changed (new choice, DDP's bucket rebuild) leaves its chunk residual behind: drop it
    for key in set(state.chunk_residuals) - state._chunk_keys_used:
        del state.chunk_residuals[key]
    state._chunk_keys_used = set()
    state.step += 1
    state._steps_here += 1
