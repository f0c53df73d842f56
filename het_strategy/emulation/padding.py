"""Padding a batch to its emulated device's time, once, from one comm-hook wrapper.

Both runtimes that emulate devices — the ``hetero`` strategy and
``callbacks.emulation.EmulatedDeviceCallback`` under plain ``ddp`` — register
``padded_comm_hook`` around their real hook.  When DDP hands it the step's last
gradient bucket, the forward and backward are over: the rank sleeps for what
of its emulated time the real work did not take (``BatchPadding.finish``), then
the last collective starts, as it would on the slower device.  A backward that
DDP does not sync (gradient accumulation) runs no hook; the runtime then calls
``finish`` after backward itself.  ``finish`` pads at most once per batch.
"""

from __future__ import annotations

from typing import Any, Callable

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.log import logger
from het_strategy.core.workload import WorkloadSpec
from het_strategy.emulation.speeds import EmulatedCompute, emulated_factor, emulated_seconds_per_sample

__all__ = ["BatchPadding", "padded_comm_hook"]


class BatchPadding:
    """One rank's emulated compute of each batch: ``begin`` at its start, ``finish`` pads it (once)."""

    def __init__(self, compute: EmulatedCompute, cluster: ClusterSpec, device: str) -> None:
        self.compute, self.cluster, self.device = compute, cluster, device
        self.samples = 0
        self.step = 0
        self.padded = False
        self.pad_s = 0.0
        """Seconds slept for the current batch."""
        self.target_s = 0.0
        """The current batch's emulated compute seconds (known once padded)."""
        self.warn = False
        """Say (once) when the emulated time is far below the real compute: set on rank 0 by the runtime."""
        self._too_fast: list[float] = []
        self.excluded: Any = None
        """A clock (``inside_s``, ``reset()``) of time the batch padding leaves out: MoE layers pad their experts
        themselves (``moe/padding.py``), so their whole time is not the dense compute padded here."""

    @classmethod
    def for_device(cls, cluster: ClusterSpec, device: str, workload: WorkloadSpec, dtype: str,
                   experts: bool = True) -> BatchPadding:
        """The padding of ``device``: its emulated seconds per sample for ``workload`` in ``dtype``
        (``experts=False``: the dense part only)."""
        return cls(EmulatedCompute(emulated_seconds_per_sample(cluster, device, workload, dtype, experts)),
                   cluster, device)

    def begin(self, samples: int, step: int) -> None:
        """A batch of ``samples`` starts at optimizer step ``step`` (slowdown schedules count steps)."""
        self.samples, self.step = samples, step
        self.padded, self.pad_s, self.target_s = False, 0.0, 0.0
        if self.excluded is not None:
            self.excluded.reset()
        self.compute.begin()

    def finish(self, computed_s: float | None = None) -> None:
        """Sleep for what of the emulated time ``computed_s`` (default: the wall time since ``begin``) did not take.

        The emulated device is busy from the batch's start for its whole time:
        real compute and any wait inside it (a ``sync_dist`` log waiting for
        another rank) fall within that window, as they would on the device.
        """
        if self.padded:
            return
        factor = emulated_factor(self.cluster, self.device, self.step)
        self.target_s = self.compute.target_s(self.samples, factor)
        if computed_s is None:
            computed_s = self.compute.elapsed_s() - (self.excluded.inside_s if self.excluded is not None else 0.0)
        self.pad_s = self.compute.pad(self.samples, factor, computed_s)
        self.padded = True
        if self.warn and self.target_s > 0:
            self._check_emulation_visible(computed_s)

    def _check_emulation_visible(self, computed_s: float) -> None:
        """After 8 batches (the first 3 skipped): warn once if the real compute took >= 2x the emulated time."""
        self._too_fast.append(computed_s / self.target_s)
        if len(self._too_fast) < 8:
            return
        self.warn = False
        ratio = sorted(self._too_fast[3:])[len(self._too_fast[3:]) // 2]
        if ratio >= 2.0:
            device = self.cluster.device(self.device)
            tflops = device.tflops.get("fp32", min(device.tflops.values()))
            logger.warning(
                "emulated device %s (speed %g): its emulated compute is %.1fx below the real compute measured here "
                "(median over batches), so the emulation has no visible effect; declare a lower `tflops` for it "
                "in the cluster YAML (about %.3g for fp32 makes the emulated time 4x the real one)",
                self.device, device.emulated_speed or 1.0, ratio, tflops / (4.0 * ratio))

    def finish_before_backward(self) -> None:
        """Where no hook can be registered: pad before backward, estimating the backward still to come."""
        self.finish(self.compute.estimate_with_backward())


def padded_comm_hook(inner: Callable[[Any, Any], Any], on_last_bucket: Callable[[], None],
                     on_bucket: Callable[[], None] | None = None) -> Callable[[Any, Any], Any]:
    """``inner`` (a DDP comm hook), preceded by ``on_last_bucket()`` on the step's last bucket and
    ``on_bucket()`` on every bucket (after the padding: a timestamp of when this rank's gradients are ready)."""

    def padded_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
        if bucket.is_last():
            on_last_bucket()
        if on_bucket is not None:
            on_bucket()
        return inner(state, bucket)

    padded_hook.__qualname__ = f"padded_hook({getattr(inner, '__qualname__', type(inner).__name__)})"
    return padded_hook
