"""Which devices of the cluster file this (re)start runs on, and the checkpoint it goes on from.

Under torchrun's elastic agent (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=MIN:MAX
--nproc-per-node=1 --max-restarts=N --rdzv-backend=c10d ...``; ``check_agent_store`` says why the variable) the
ranks of a restart are the agents that joined its rendezvous: a subset of the cluster file's devices, in any
order.  Each agent names its device in ``HET_STRATEGY_DEVICE``; every rank gathers the names
(``gather_device_names``) and ``present_cluster`` makes the cluster of those devices, rank ``r`` playing the device
rank ``r`` named.  A checkpoint of other devices then re-plans (``checkpoint.restored_plan``) and its sampler
goes on at the next global batch of the epoch.

A plain torchrun restart (no device names, the agent's shared store) joins a process group of its own attempt
(``init_attempt_process_group``): torch's ``env://`` start reuses the agent's store with the same keys across
restarts, so a restarted worker would read the previous attempt's peers (pytorch/pytorch#167288).

``latest_checkpoint`` is the newest complete ``*.ckpt`` of a directory (by the step in its name): what a restart
resumes from.  Without ``HET_STRATEGY_DEVICE`` nothing changes: rank ``r`` plays the cluster's device ``r``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from het_strategy.core.cluster import ClusterSpec
from het_strategy.core.errors import field_error

__all__ = ["DEVICE_ENV", "SHARE_STORE_ENV", "COMPLETE_MARKER", "check_agent_store", "gather_device_names",
           "present_cluster", "latest_checkpoint", "is_whole_checkpoint", "init_attempt_process_group"]

DEVICE_ENV = "HET_STRATEGY_DEVICE"
"""The environment variable in which a rank names the cluster file's device it runs on."""

SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torchrun's switch (in the agent's environment) that keeps its rendezvous TCP store from the workers."""


def check_agent_store() -> None:
    """A ConfigError when ranks name their devices (``HET_STRATEGY_DEVICE``) under a torchrun agent that shares
    its TCP store with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's default).

    With the shared store a device that joins a running group waits for the round's ``MASTER_ADDR``, which the
    agent of rank 0 never writes again, and the whole group ends after the store timeout; and the agents'
    restart counts, which would key each attempt's process group, differ after a membership change
    (pytorch/pytorch#135712).  With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every round's rank 0 hosts a fresh
    store on a fresh port, and Lightning's ``env://`` start needs nothing more."""
    if os.environ.get(DEVICE_ENV) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise field_error(SHARE_STORE_ENV, os.environ.get(SHARE_STORE_ENV), "be 1 in torchrun's environment when "
                          f"ranks name their devices ({DEVICE_ENV}): with the agent's shared store a device that "
                          "joins hangs the rendezvous (pytorch/pytorch#135712)",
                          f"{SHARE_STORE_ENV}=1 {DEVICE_ENV}=<device> torchrun --nnodes=MIN:MAX ...")


def init_attempt_process_group(backend: str | None, rank: int, world_size: int, timeout: Any) -> bool:
    """Under torchrun's agent store, initialise the default process group on that store with its keys prefixed by
    the restart count (``TORCHELASTIC_RESTART_COUNT``); False (nothing done) anywhere else.  ``backend`` None:
    torch's default for each device type."""
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False,
                          timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"het_strategy/attempt_{attempt}", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    return True


def gather_device_names(world_size: int) -> list[str] | None:
    """Every rank's ``HET_STRATEGY_DEVICE``, in rank order (a collective), or None when no rank sets it; a
    ConfigError when some ranks set it and others do not."""
    import torch.distributed as dist

    own = os.environ.get(DEVICE_ENV) or None
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        names: list[str | None] = [None] * world_size
        dist.all_gather_object(names, own)
    else:
        names = [own]
    if all(n is None for n in names):
        return None
    if any(n is None for n in names):
        missing = [r for r, n in enumerate(names) if n is None]
        raise field_error(DEVICE_ENV, None, f"be set on every rank when set on one (ranks {missing} have none)")
    return [str(n) for n in names]


def present_cluster(cluster: ClusterSpec, names: list[str]) -> ClusterSpec:
    """The devices ``names`` (rank order) of ``cluster``, as a cluster whose device ``r`` is ``names[r]``.

    A node's ranks must be consecutive (the cluster lists devices node by node); links and slowdowns of the
    devices and nodes left out are dropped."""
    known = {d.name: d for d in cluster.devices}
    seen: set[str] = set()
    for name in names:
        if name not in known:
            raise field_error(DEVICE_ENV, name, f"name a device of cluster `{cluster.name}` "
                              f"({', '.join(known)})")
        if name in seen:
            raise field_error(DEVICE_ENV, name, "name one rank's device (two ranks name it)")
        seen.add(name)
    order: list[str] = []  # nodes in rank order
    for name in names:
        node = known[name].node
        if order and order[-1] != node and node in order:
            raise field_error(DEVICE_ENV, name, f"keep node `{node}`'s ranks consecutive (ranks in order: {names})",
                              "start each node's agents one after the other, or give one agent per node")
        if not order or order[-1] != node:
            order.append(node)
    nodes = tuple(dataclasses.replace(cluster.node(node), devices=tuple(known[n] for n in names
                                                                          if known[n].node == node))
                  for node in order)
    kept = set(order)
    return dataclasses.replace(cluster, nodes=nodes, links=tuple(l for l in cluster.links if set(l.nodes) <= kept),
                               slowdowns=tuple(s for s in cluster.slowdowns if s.device in seen))


_STEP = re.compile(r"step[=_](\d+)")


COMPLETE_MARKER = "complete"
"""In a checkpoint directory (``hetero_deepspeed`` writes one, every rank its share): the file rank 0 writes once
every rank's files are written.  A directory without it was cut short."""


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The ``*.ckpt`` of ``directory`` with the highest step in its name (``step_30.ckpt``, ``epoch=0-step=30.ckpt``)
    that is whole: a file cut short (its writer died mid-write: Lightning writes checkpoints in place) has no zip
    directory at its end, and a checkpoint directory (``hetero_deepspeed``'s) no ``COMPLETE_MARKER``; such a one is
    passed over for the one before; None when there is none."""
    folder = Path(directory)
    if not folder.is_dir():
        return None
    found = sorted(((int(m.group(1)), p) for p in folder.glob("*.ckpt") if (m := _STEP.search(p.name))),
                   reverse=True)
    return next((p for _, p in found if is_whole_checkpoint(p)), None)


def is_whole_checkpoint(path: Path) -> bool:
    """``torch.save`` writes a zip archive: a file whose central directory reads is complete; a directory is
    complete with its ``COMPLETE_MARKER``."""
    if path.is_dir():
        return (path / COMPLETE_MARKER).is_file()
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False
