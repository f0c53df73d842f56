"""``CompressionState``: what the comm hook remembers between steps, and its checkpoint format.

One object per rank, passed to ``ddp_model.register_comm_hook(state,
compression_hook)``.  It holds the configuration, the step count and the
per-layer choice, the error-feedback residuals, torch's PowerSGD state, this
rank's random generator, the wire-byte log and, for ``adaptive``, the
controller (``adaptive.AdaptiveController``) that decides the choice.

Distributed invariant: every rank must issue the same collectives for every
bucket, so whatever decides them (``step``, ``choices``, the controller's
schedule) is equal on every rank and is saved and restored on every rank
together.  Error feedback and the generator are per rank: each rank saves its
own (``state_dict``) and gets its own back.
"""

import warnings
from typing import Any

import torch
import torch.distributed as dist

from het_strategy.compression.adaptive import AdaptiveController
from het_strategy.compression.config import ADAPTIVE, CompressionConfig, compression_config
from het_strategy.core.codecs import Codec
from het_strategy.core.errors import field_error

__all__ = ["CompressionState", "STATE_VERSION"]

STATE_VERSION = 1
_DECISIONS_KEPT = 10_000  # per-layer decision rows kept in memory, bounded over long runs
_DECISIONS_SAVED = 1000  # ... and in checkpoints


class CompressionState:
    """Everything the hook remembers between steps; checkpointed (process group dropped).

    Args:
        module: the model (the DDP wrapper or its module): names the parameters.
        config: a ``CompressionConfig``, a method name or a mapping of its fields.
        process_group: the group to exchange over; ``None``: the default group.

    The adaptive controller's schedule and fitted link are its own fields (``state.controller.next_solve``,
    ``.interval``, ``.link``).
    """

    __slots__ = (
        # what was asked, and over which group (the group is not saved)
        "config", "process_group",
        # progress: optimizer steps seen (equal on every rank); the per-layer choice the hook follows
        # (``adaptive``; layer name -> method token, equal on every rank: rank 0 solves and broadcasts it)
        "step", "choices",
        # the adaptive controller (its schedule, link and measurements); ``None`` for a uniform method
        "controller",
        # error feedback: per-layer residual of what compression left out last time, and per quantized group
        # this rank's residual of re-quantizing its chunk of the mean (keyed by the group's layer names)
        "residuals", "chunk_residuals",
        # torch's PowerSGD state for the layers that use it (its own error feedback and warm start)
        "powersgd",
        # this rank's random stream (stochastic rounding, measuring's random starts): seeded per rank, saved
        "generator",
        # the log: per-layer decisions of every solve, bytes sent
        # (bytes_fp32: what an uncompressed allreduce of the same buckets would send)
        "decisions", "bytes_sent", "bytes_fp32",
        # this process only (not saved): id(parameter) -> name; whether its first step saw an eligible layer;
        # steps it has exchanged (a resumed run starts at 0 with step > 0); chunk-residual keys used this step
        "_names", "_eligible_seen", "_steps_here", "_chunk_keys_used",
    )

    def __init__(self, module: torch.nn.Module, config: Any = "adaptive",
                 process_group: dist.ProcessGroup | None = None) -> None:
        if not isinstance(module, torch.nn.Module):
            raise field_error("module", type(module).__name__,
                              "be the torch.nn.Module (or its DDP wrapper) whose gradients are exchanged")
        cfg = compression_config(config)
        if cfg is None:
            raise field_error("config", None, "be a CompressionConfig, a method name or a mapping")
        self._start(cfg, process_group, {id(p): name for name, p in module.named_parameters()})

    def _start(self, config: CompressionConfig, process_group: dist.ProcessGroup | None,
               names: dict[int, str]) -> None:
        """Every field at its start value (``__init__``, and ``__setstate__`` before it loads)."""
        self.config = config
        self.process_group = process_group
        self.step = 0
        self.choices: dict[str, str] = {}
        self.controller: AdaptiveController | None = \
            AdaptiveController(config) if config.method == ADAPTIVE else None
        self.residuals: dict[str, torch.Tensor] = {}
        self.chunk_residuals: dict[str, torch.Tensor] = {}
        self.powersgd: Any = None
        self.generator = torch.Generator()
        self.generator.manual_seed(1234 + (dist.get_rank() if dist.is_initialized() else 0))
        self.decisions: list[dict[str, Any]] = []
        self.bytes_sent = 0
        self.bytes_fp32 = 0
        self._names = names
        self._eligible_seen = False
        self._steps_here = 0
        self._chunk_keys_used: set[str] = set()

    # -- what each layer gets ---------------------------------------------------------------------
    def eligible(self, grad: torch.Tensor) -> bool:
        """Small and 1-D tensors are never compressed: the saving is nil and they are often sensitive."""
        return grad.dim() >= 2 and grad.numel() >= self.config.min_numel

    def token_for(self, name: str, grad: torch.Tensor) -> Codec:
        """The codec this layer's gradient goes through this step."""
        if not self.eligible(grad) or self.step < self.config.warmup_steps:
            return Codec.NONE
        if self.config.method == ADAPTIVE:
            return Codec(self.choices.get(name, Codec.NONE))
        return Codec(self.config.method)

    @property
    def wire_ratio(self) -> float:
        """fp32-allreduce bytes over the bytes actually sent, so far."""
        return self.bytes_fp32 / self.bytes_sent if self.bytes_sent else 1.0

    def measuring(self) -> bool:
        return self.controller is not None and self.controller.measuring(self.step)

    def uncompressed_step(self) -> bool:
        """True when every layer of every bucket goes uncompressed this step and no residual is pending: the
        hook then needs no per-layer work at all (looking up a bucket's gradients and parameters costs about a
        millisecond a step on a small GPT)."""
        if self.residuals or self.measuring():
            return False
        cfg = self.config
        if cfg.method == Codec.NONE or self.step < cfg.warmup_steps:
            return True
        return cfg.method == ADAPTIVE and all(t == Codec.NONE for t in self.choices.values())

    def param_name(self, param: torch.Tensor, bucket_index: int, position: int) -> str:
        """The parameter's name in the module (stable across restarts and DDP's bucket rebuilds, unlike its
        place in a bucket); a positional name for a tensor the module did not name."""
        return self._names.get(id(param), f"bucket{bucket_index}.{position}")

    # -- what the hook reports during a step ------------------------------------------------------------------
    def note_bucket(self, bucket: dist.GradBucket) -> None:
        """On this process's first step, remember whether any layer is eligible (for ``end_step``'s warning);
        later steps skip the bucket's gradient lookup."""
        if self._steps_here == 0 and not self._eligible_seen \
                and any(self.eligible(g) for g in bucket.gradients()):
            self._eligible_seen = True

    def measure(self, names: list[str], grads: list[torch.Tensor], bucket_index: int) -> None:
        """On a measuring step: hand the bucket's eligible layers to the controller."""
        assert self.controller is not None, "measuring() is only true with a controller"
        picked = [i for i, g in enumerate(grads) if self.eligible(g)]
        self.controller.measure([names[i] for i in picked], [grads[i] for i in picked], bucket_index,
                                self.residuals, self.generator)

    def keep_chunk_residual(self, key: str, residual: torch.Tensor) -> None:
        """Keep a quantized group's chunk residual for its next exchange (``end_step`` drops the unused)."""
        self.chunk_residuals[key] = residual
        self._chunk_keys_used.add(key)

    def powersgd_state(self) -> Any:
        """torch's ``PowerSGDState`` for the layers routed to PowerSGD, made on first use."""
        if self.powersgd is None:
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            # start_powerSGD_iter must be > 1 with error feedback; our own warm-up decides when it runs
            self.powersgd = PowerSGDState(process_group=self.process_group,
                                          matrix_approximation_rank=self.config.rank,
                                          start_powerSGD_iter=2, min_compression_rate=1.0,
                                          use_error_feedback=self.config.error_feedback, warm_start=True)
            self.powersgd.iter = 2
        return self.powersgd

    def end_step(self, group: dist.ProcessGroup, world: int, device: torch.device) -> None:
        """After the last bucket of a step, on every rank:

        1. warn once (rank 0) if no layer was eligible on this process's first step;
        2. let the controller solve or time the link (collectives: it runs on every rank at the same step)
           and keep a new choice and its log rows;
        3. drop chunk residuals no group used (a group whose layers changed: new choice, DDP's bucket rebuild);
        4. count the step.
        """
        if self._steps_here == 0 and not self._eligible_seen:
            if not dist.is_initialized() or dist.get_rank() == 0:
                warnings.warn("gradient compression: no parameter is eligible (every tensor is 1-D or has fewer "
                              f"than min_numel={self.config.min_numel} elements); gradients use plain allreduce")
        if self.controller is not None:
            solution = self.controller.end_step(self.step, self.choices, group, world, device)
            if solution is not None:
                self.choices = solution.choices
                self.decisions = (self.decisions + solution.rows)[-max(_DECISIONS_KEPT, len(solution.rows)):]
        for key in set(self.chunk_residuals) - self._chunk_keys_used:
            del self.chunk_residuals[key]
        self._chunk_keys_used = set()
        self.step += 1
        self._steps_here += 1

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (tensors on the CPU).  Error feedback is per rank: save every rank's (the hetero
        strategy gathers them into its Lightning checkpoint) and give each rank its own back.  A uniform
        method saves a fresh controller's schedule, so every method's checkpoint has the same keys."""
        powersgd = None
        if self.powersgd is not None:
            powersgd = self.powersgd.__getstate__()  # torch's own: drops the process group
        schedule = (self.controller or AdaptiveController(self.config)).state_dict()
        return {"version": STATE_VERSION, "config": self.config.to_dict(), "step": self.step,
                "choices": {name: str(token) for name, token in self.choices.items()},
                "next_solve": schedule["next_solve"],
                "interval": schedule["interval"],
                "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
                "chunk_residuals": {k: v.detach().cpu().clone() for k, v in self.chunk_residuals.items()},
                "generator": self.generator.get_state(),
                "powersgd": powersgd,
                "link": schedule["link"],
                "decisions": list(self.decisions[-_DECISIONS_SAVED:]), "bytes_sent": self.bytes_sent,
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
        if self.controller is not None:
            self.controller.load_state_dict(state)
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.chunk_residuals = {k: v.clone() for k, v in state.get("chunk_residuals", {}).items()}
        if state.get("generator") is not None:
            self.generator.set_state(state["generator"])
        if state.get("powersgd") is not None:
            self.powersgd_state().__setstate__(dict(state["powersgd"]))
            self.powersgd.process_group = self.process_group
        self.decisions = list(state.get("decisions", []))
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.bytes_fp32 = int(state.get("bytes_fp32", 0))

    def __getstate__(self) -> dict[str, Any]:
        return self.state_dict()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # the process group and parameter identities belong to the process that pickled: start without them
        self._start(compression_config(state["config"]), None, {})  # type: ignore[arg-type]
        self.load_state_dict(state)
