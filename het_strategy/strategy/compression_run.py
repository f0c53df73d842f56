"""Which comm hook a ``hetero`` run's compression registers, built once per fit.

``compression.scope="all"`` (the default) is ``compression_hook`` over every rank;
``"inter_node"`` is ``hierarchical_hook``: the cluster's nodes (rank r plays
device r; a node's devices are consecutive ranks, every node the same count)
reduce uncompressed inside, and only their leaders' exchange is compressed.
Either way ``compression_state`` is a ``CompressionState`` on every rank (for
the hierarchical hook, the inter-node one), which the monitors read and the
checkpoint gathers; a restored checkpoint's states are loaded into it.

``CommHookBuilder`` is the ``hetero`` strategy's part that registers one comm
hook on every device type (Lightning registers hooks only on CUDA): the
compression hook, the user's hook or allreduce, counted in ``wire`` and
wrapped to pad an emulated device and timestamp the last gradient bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from het_strategy.compression import CompressionConfig, CompressionState, WireBytes, compression_hook, \
    counted_comm_hook
from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error
from het_strategy.emulation.padding import padded_comm_hook
from het_strategy.strategy import checkpoint as ckpt

__all__ = ["CommHookBuilder", "CompressionRun", "build_compression", "ranks_per_node", "prepared_comm_hook"]


@dataclass
class CompressionRun:
    """The hook a compressed run registers, the state DDP hands it, and this rank's ``CompressionState``."""

    hook: Callable[[Any, Any], Any]
    hook_state: Any
    compression_state: CompressionState


def ranks_per_node(cluster: ClusterSpec, world: int) -> int:
    """The ranks of each node of ``cluster`` (equal for every node, consecutive ranks), or ConfigError."""
    counts: dict[str, int] = {}  # node -> its ranks, in rank order
    for device in cluster.devices[:world]:
        if device.node in counts and device.node != next(reversed(counts)):
            raise field_error("compression.scope", "inter_node", f"go with a cluster whose nodes hold "
                              f"consecutive ranks; node `{device.node}`'s devices are not contiguous")
        counts[device.node] = counts.get(device.node, 0) + 1
    sizes = list(counts.values())
    if len(set(sizes)) != 1:
        raise field_error("compression.scope", "inter_node", f"go with nodes of equal size (cluster "
                          f"`{cluster.name}` has {sizes} ranks per node)", "use scope=all")
    return sizes[0]


def build_compression(model: Any, config: CompressionConfig, cluster: ClusterSpec | None, world: int, rank: int,
                      restored: dict[str, Any] | None) -> CompressionRun:
    """The hook, its state and the ``CompressionState`` of this rank (a collective for ``inter_node``: every rank
    creates the node groups)."""
    if config.scope == "inter_node":
        from het_strategy.compression.hierarchical import HierarchicalState, hierarchical_hook, node_groups

        if cluster is None:
            raise field_error("compression.scope", "inter_node", "go with a known cluster (its nodes)")
        state = HierarchicalState(model, config, node_groups(ranks_per_node(cluster, world)))
        run = CompressionRun(hierarchical_hook, state, state.inter)
    else:
        flat = CompressionState(model, config)
        run = CompressionRun(compression_hook, flat, flat)
    if restored is not None:
        ckpt.restore_compression(run.compression_state, restored["ranks"], world, rank)
    return run


def prepared_comm_hook(inner: Callable[[Any, Any], Any], prepare: Callable[[Any], None]) -> Callable[[Any, Any], Any]:
    """``inner`` after ``prepare(bucket.buffer())`` (in place) on each bucket."""

    def prepared_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations only
        prepare(bucket.buffer())
        return inner(state, bucket)

    return prepared_hook


class CommHookBuilder:
    """The comm hook a ``hetero`` run registers, and its compression state.

    Args:
        config: the compression to run (None or method ``none``: the user's hook, else allreduce).
        user_hook: a DDP comm hook ``(state, bucket) -> Future`` of the user's, used when ``config`` is None.
        user_state: the state DDP hands ``user_hook``.
        wrapper: a DDP comm wrapper applied around the whole hook (Lightning's ``ddp_comm_wrapper``).
    """

    def __init__(self, config: CompressionConfig | None, user_hook: Callable[[Any, Any], Any] | None = None,
                 user_state: Any = None, wrapper: Callable[[Any], Any] | None = None) -> None:
        if config is not None and user_state is not None:
            raise field_error("compression_state", type(user_state).__name__,
                              "be None when `compression` names a method (the strategy builds the state)")
        if user_hook is None and user_state is not None:
            raise field_error("compression_state", type(user_state).__name__,
                              "go with a DDP comm hook passed as `compression=` (the state is that hook's)")
        self.config, self.user_hook, self.user_state, self.wrapper = config, user_hook, user_state, wrapper
        self.wire = WireBytes()
        """This rank's gradient bytes (uncompressed and on the wire)."""
        self.run: CompressionRun | None = None
        """The compressed hook and its state, once registered with a compression ``config``."""

    @property
    def compression_state(self) -> CompressionState | None:
        """This rank's ``CompressionState`` when the run compresses (after ``register``)."""
        return None if self.run is None else self.run.compression_state

    def register(self, model: Any, cluster: ClusterSpec | None, world: int, rank: int,
                 restored: dict[str, Any] | None, on_last_bucket: Callable[[], None],
                 on_bucket: Callable[[], None],
                 prepare_bucket: Callable[[Any], None] | None = None,
                 process_group: Any = None) -> Callable[[Any, Any], Any]:
        """Register the hook on ``model`` (a DDP module); ``restored``: the checkpoint's compression part;
        ``prepare_bucket(buffer)`` runs on each bucket before it is counted and reduced (``PerDevicePrecision``
        unscales an fp16 rank's gradients there); ``process_group``: the group the model's DDP reduces over
        (None: every rank), which the uncompressed allreduce uses.

        The compression state is built once per strategy: a later ``trainer.validate``/``test`` keeps the
        fitted one.  A collective for ``compression.scope="inter_node"``.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner, state = ((self.user_hook, self.user_state) if self.user_hook is not None
                        else (allreduce_hook, process_group))
        if self.config is not None and self.config.method != "none":
            if self.run is None:
                self.run = build_compression(model, self.config, cluster, world, rank, restored)
            inner, state = self.run.hook, self.run.hook_state
        hook = counted_comm_hook(inner, self.wire)
        if prepare_bucket is not None:
            hook = prepared_comm_hook(hook, prepare_bucket)
        hook = padded_comm_hook(hook, on_last_bucket, on_bucket)
        if self.wrapper is not None:
            hook = self.wrapper(hook)
        model.register_comm_hook(state=state, hook=hook)
        return hook
