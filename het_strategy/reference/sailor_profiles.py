"""Measured reference data from the Sailor project (SOSP'25, ETH Zurich; MIT licence).

The JSON files under ``het_strategy/reference/data/sailor/`` were measured on real GPUs by
Sailor's authors and are the figures Sailor's own planner and simulator use, so a
plan scored with them competes on equal terms.  This module turns them into our
types, which the planning core takes as plain data (it never reads this folder):

* ``load_sailor_profile`` — per-layer (forward, backward, optimizer update) seconds
  as a ``MeasuredProfile`` keyed by our catalog's device names (``request_profile``:
  the one ``planner.profile=sailor`` names, for het-plan and other callers of ``plan``);
* ``sailor_bandwidth_gbs`` / ``SailorNetwork`` — the measured intra- and inter-node
  bandwidth fits, evaluated at a message size.

Layout of ``layer_profiles.json``: ``[model][gpu][micro_batch][tp][layer]``.  The
shared README gives the two middle keys the other way round; the data and Sailor's
simulator say otherwise: the simulator reads ``prof_gpu[str(mbs)][tmp]``, the
block time grows linearly with the first key and shrinks with the second, the
per-layer optimizer time halves with the second key (parameters sharded by tp)
and is flat in the first, and the first key reaches 128 for OPT-350 (16 heads),
which only a micro-batch size can.  Times are seconds per micro-batch.

Planning core: no torch.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from het_strategy.core.catalog import lookup_device_type
from het_strategy.core.errors import ConfigError, field_error
from het_strategy.core.network import Network, ring_steps
from het_strategy.core.workload import MeasuredProfile, WorkloadSpec

if TYPE_CHECKING:
    from het_strategy.core.cluster import ClusterSpec
    from het_strategy.planning.request import PlanRequest

__all__ = [
    "SAILOR_DATA_DIR",
    "DEFAULT_ZONE",
    "sailor_models",
    "load_sailor_profile",
    "request_profile",
    "load_sailor_training_config",
    "sailor_bandwidth_gbs",
    "sailor_peak_bandwidth_gbs",
    "SailorNetwork",
    "read_sailor_json",
    "SAILOR_GPU_TYPES",
    "sailor_device_type",
]

SAILOR_DATA_DIR = Path(__file__).with_name("data") / "sailor"
"""Folder of the vendored Sailor JSON files (shipped in the wheel)."""

DEFAULT_ZONE = "us-central1-a"
"""The zone Sailor's single-site experiments use on both sides of a link."""

_TRAINING_FILES = {"OPT-350": "training_opt_350.json", "GPT-Neo-2.7": "training_gpt_neo27.json"}


@functools.lru_cache(maxsize=None)
def read_sailor_json(name: str) -> Any:
    """One vendored Sailor JSON file, parsed once (ConfigError if the install lacks it)."""
    path = SAILOR_DATA_DIR / name
    if not path.exists():
        raise ConfigError(f"Sailor reference file {path} is missing; reinstall het_strategy", field="sailor_data",
                          value=str(path))
    return json.loads(path.read_text())


def sailor_models() -> list[str]:
    """Model names with measured layer profiles (``OPT-350``, ``GPT-Neo-2.7``, ...)."""
    return sorted(read_sailor_json("layer_profiles.json"))


SAILOR_GPU_TYPES = {"RTX-2080": "RTX-2080-Ti"}
"""Sailor's GPU names whose catalog type is not the one the name finds: Sailor's ``RTX-2080`` has 11 GB, the
RTX 2080 Ti's memory (the RTX 2080 has 8 GB), and its measured fp32 blocks match the Ti's rate."""


def sailor_device_type(sailor_gpu: str) -> str | None:
    """Our catalog's name for one of Sailor's GPU names, or None if the catalog lacks it."""
    try:
        return lookup_device_type(SAILOR_GPU_TYPES.get(sailor_gpu, sailor_gpu), "gpu").name
    except ConfigError:
        return None


def load_sailor_profile(model: str = "OPT-350", workload: WorkloadSpec | None = None) -> MeasuredProfile:
    """Sailor's measured per-layer times for ``model`` as a ``MeasuredProfile``.

    Keys are ``(catalog device name, tp)`` (Sailor's ``A100-40`` becomes
    ``A100-40GB``); GPUs the catalog lacks are skipped.  Micro-batch sizes and
    tp become ints.  With ``workload``, every table must have one entry per layer
    of it (OPT-350: 26 = embedding + 24 blocks + head), else ConfigError.
    """
    data = read_sailor_json("layer_profiles.json")
    if model not in data:
        raise field_error("model", model, "be a model Sailor profiled", f"profiled: {', '.join(sorted(data))}")
    times: dict[tuple[str, int], dict[int, list[tuple[float, float, float]]]] = {}
    num_layers: int | None = None
    for sailor_gpu, by_mbs in data[model].items():
        device_type = sailor_device_type(sailor_gpu)
        if device_type is None:
            continue
        for mbs_key, by_tp in by_mbs.items():
            for tp_key, by_layer in by_tp.items():
                where = f"sailor[{model}][{sailor_gpu}][mbs={mbs_key}][tp={tp_key}]"
                rows = _layer_rows(by_layer, where)
                if num_layers is None:
                    num_layers = len(rows)
                elif len(rows) != num_layers:
                    raise field_error(where, f"{len(rows)} layers", f"have {num_layers} layers like the other tables")
                times.setdefault((device_type, int(tp_key)), {})[int(mbs_key)] = rows
    profile = MeasuredProfile(model=model, times=times, network=SailorNetwork)
    if workload is not None:
        profile.check_matches(workload)
    return profile


def request_profile(request: PlanRequest, workload: WorkloadSpec,
                    profile: MeasuredProfile | None = None) -> MeasuredProfile | None:
    """The measured per-layer times ``request.profile`` names for ``workload`` (``profile`` when the request names
    none; None: datasheet figures), to hand to ``planning.plan`` / ``rescore`` as their ``profile``."""
    if request.profile is None:
        return profile
    if profile is not None:
        raise field_error("planner.profile", str(request.profile), "be null when the model's own profile is given "
                          "(planner.profile names Sailor's profiles of the models it measured)")

    def normalized(name: str) -> str:  # ``OPT-350`` and ``opt350`` name the same model
        return re.sub(r"[^a-z0-9]", "", name.lower())

    profiled = {normalized(m): m for m in sailor_models()}
    sailor_name = profiled.get(normalized(workload.name))
    if sailor_name is None:
        raise field_error("planner.profile", str(request.profile), "be used with a model Sailor profiled "
                          f"({', '.join(profiled.values())})",
                          f"model `{workload.name}` has no Sailor profile; use planner.profile=null")
    return load_sailor_profile(model=sailor_name, workload=workload)


def _layer_rows(by_layer: dict[str, list[float]], where: str) -> list[tuple[float, float, float]]:
    indices = sorted(int(k) for k in by_layer)
    if indices != list(range(len(indices))):
        raise field_error(f"{where}.layers", indices, "number the layers 0..n-1 without gaps")
    rows = []
    for i in indices:
        entry = by_layer[str(i)]
        if len(entry) != 3:
            raise field_error(f"{where}[{i}]", entry, "be [forward_s, backward_s, update_s]")
        rows.append((float(entry[0]), float(entry[1]), float(entry[2])))
    return rows


def load_sailor_training_config(model: str = "OPT-350") -> dict[str, Any]:
    """The model shape and global batch of Sailor's experiments (``training_*.json``)."""
    if model not in _TRAINING_FILES:
        raise field_error("model", model, "be a model with a Sailor training config",
                          f"known: {', '.join(sorted(_TRAINING_FILES))}")
    return dict(read_sailor_json(_TRAINING_FILES[model]))


# -- bandwidth fits ---------------------------------------------------------------------------


def _measured_key(gpu: str, available: list[str]) -> str | None:
    """Sailor's key for ``gpu`` (Sailor's name or our catalog name) among ``available``; None if not measured."""
    if gpu in available:
        return gpu
    wanted = sailor_device_type(gpu)
    return next((key for key in available if wanted is not None and sailor_device_type(key) == wanted), None)


def _sailor_gpu_key(gpu: str, available: list[str], field_name: str) -> str:
    """Sailor's key for ``gpu`` given as Sailor's name or our catalog name."""
    key = _measured_key(gpu, available)
    if key is None:
        raise field_error(field_name, gpu, "be a GPU type Sailor measured here", f"measured: {', '.join(available)}")
    return key


def _fit(gpu: str, num_gpus: int, inter_node: bool, zone: str, peer_gpu: str | None,
         peer_num_gpus: int | None) -> tuple[list[float], float]:
    """(coefficients, peak bytes/s) of the matching fit."""
    if inter_node:
        data = read_sailor_json("inter_node_bandwidth_fits.json")
        if zone not in data:
            raise field_error("zone", zone, "be a zone Sailor measured", f"measured: {', '.join(sorted(data))}")
        side = data[zone]
        key = _sailor_gpu_key(gpu, sorted(side), "gpu")
        n = _num_gpus_key(side[key], num_gpus, "num_gpus")
        remote = side[key][n].get(zone, {})
        peer_key = _sailor_gpu_key(peer_gpu or gpu, sorted(remote), "peer_gpu")
        peer_n = _num_gpus_key(remote[peer_key], num_gpus if peer_num_gpus is None else peer_num_gpus,
                               "peer_num_gpus")
        coeffs, peak = remote[peer_key][peer_n]
    else:
        data = read_sailor_json("intra_node_bandwidth_fits.json")
        key = _sailor_gpu_key(gpu, sorted(data), "gpu")
        n = _num_gpus_key(data[key], num_gpus, "num_gpus")
        coeffs, peak = data[key][n]
    return [float(c) for c in coeffs], float(peak)


def _num_gpus_key(table: dict[str, Any], num_gpus: int, field_name: str) -> str:
    if str(num_gpus) not in table:
        raise field_error(field_name, num_gpus, "be a GPU count Sailor measured",
                          f"measured: {', '.join(sorted(table, key=int))}")
    return str(num_gpus)


def sailor_bandwidth_gbs(gpu: str, num_gpus: int, message_bytes: float, inter_node: bool = False,
                         zone: str = DEFAULT_ZONE, *, peer_gpu: str | None = None,
                         peer_num_gpus: int | None = None) -> float:
    """Measured bandwidth in GB/s for a message of ``message_bytes``, from Sailor's fits.

    The fit gives ``sum(c[i] * m**(n-1-i))`` GB/s with ``m = log2(x / 1e6)``; the
    result is capped at the fit's measured peak.  Intra-node fits are per GPU
    type and group size; inter-node fits join ``num_gpus`` GPUs of ``gpu`` to
    ``peer_num_gpus`` of ``peer_gpu`` (both default to this side) in ``zone``.
    A message so small that the fit gives <= 0 GB/s is outside the measured
    range and raises ConfigError rather than inventing a figure.
    """
    if isinstance(message_bytes, bool) or not isinstance(message_bytes, (int, float)) or not message_bytes > 0 \
            or not math.isfinite(message_bytes):
        raise field_error("message_bytes", message_bytes, "be a finite number > 0 (bytes)")
    coeffs, peak = _fit(gpu, num_gpus, inter_node, zone, peer_gpu, peer_num_gpus)
    m = math.log2(message_bytes / 1e6)
    n = len(coeffs)
    gbs = sum(c * m ** (n - 1 - i) for i, c in enumerate(coeffs))
    if gbs <= 0:
        raise field_error("message_bytes", message_bytes,
                          f"be large enough for the fit to hold (it gives {gbs:.3g} GB/s there)")
    return min(gbs, peak / 1e9)


def sailor_peak_bandwidth_gbs(gpu: str, num_gpus: int, inter_node: bool = False, zone: str = DEFAULT_ZONE, *,
                              peer_gpu: str | None = None, peer_num_gpus: int | None = None) -> float:
    """The fit's measured peak in GB/s (the file stores bytes/s)."""
    return _fit(gpu, num_gpus, inter_node, zone, peer_gpu, peer_num_gpus)[1] / 1e9


# -- the network Sailor measured ---------------------------------------------------------------


class SailorNetwork(Network):
    """Links priced from Sailor's measured bandwidth-vs-message-size fits (one zone).

    * inside a node: the intra-node fit for the group's GPU type and size;
    * across nodes: ``k`` concurrent flows from a node of ``g`` GPUs to one of
      ``g'`` get the fit measured between ``k`` GPUs of each (``[g][k] -> [g'][k]``,
      the aggregate of the node's interface), divided by ``k``: one flow gets the
      1-GPU fit, four share the 4-GPU fit.  Counts beyond those measured use
      the largest measured count;
    * a node whose devices are not all of one GPU type Sailor measured (an
      unmeasured type, or a mix), and a pair of nodes Sailor has no fit for,
      are priced from the cluster file's figures, as ``Network`` prices them,
      and ``describe`` names those nodes;
    * a ring's step message is its chunk, ``min(buffer, 5e8 B) / n`` (DeepSpeed's
      reduce bucket, as Sailor's simulator takes it), and a fit is evaluated at
      that size and capped at its measured peak.  No latency term beyond the
      fit (it is measured end to end).
    """

    BUCKET_BYTES = 5e8

    def __init__(self, cluster: "ClusterSpec", zone: str = DEFAULT_ZONE) -> None:
        super().__init__(cluster)
        self.latency_s = 0.0
        self.zone = zone
        measured = sorted(read_sailor_json("intra_node_bandwidth_fits.json"))
        self._gpu_of_node: dict[str, str] = {}
        """Sailor's GPU name of each node whose devices are all of one type it measured."""
        for node in cluster.nodes:
            types = {d.type for d in node.devices}
            key = _measured_key(next(iter(types)), measured) if len(types) == 1 else None
            if key is not None:
                self._gpu_of_node[node.name] = key
        self.unmeasured = [n.name for n in cluster.nodes if n.name not in self._gpu_of_node]
        """Nodes priced from the cluster file's figures (no single GPU type Sailor measured)."""

    def describe(self) -> str:
        line = f"Sailor's measured bandwidth fits ({self.zone}), per message size, shared node interfaces"
        if self.unmeasured:
            line += (f"; the cluster file's figures on node{'s' if len(self.unmeasured) > 1 else ''} "
                     f"{', '.join(self.unmeasured)} (no single GPU type Sailor measured)")
        return line

    def _gbs(self, coeffs: list[float], peak: float, message_bytes: Any) -> Any:
        m = np.log2(np.maximum(np.asarray(message_bytes, dtype=float), 1.0) / 1e6)
        n = len(coeffs)
        gbs = sum(c * m ** (n - 1 - i) for i, c in enumerate(coeffs))
        # below the measured range the polynomial may turn negative: hold the smallest positive figure
        return np.clip(gbs, 1e-3, peak / 1e9) * 1e9

    @functools.lru_cache(maxsize=None)
    def _intra_fit(self, gpu: str, group_size: int) -> tuple[list[float], float]:
        data = read_sailor_json("intra_node_bandwidth_fits.json")
        key = _sailor_gpu_key(gpu, sorted(data), "gpu")
        counts = sorted(int(k) for k in data[key])
        k = str(min((c for c in counts if c >= group_size), default=counts[-1]))
        coeffs, peak = data[key][k]
        return coeffs, peak

    @functools.lru_cache(maxsize=None)
    def _inter_fit(self, gpu: str, peer_gpu: str, k: int) -> tuple[list[float], float] | None:
        """The fit for ``k`` flows from ``gpu``'s node to ``peer_gpu``'s; None when Sailor measured no such pair."""
        data = read_sailor_json("inter_node_bandwidth_fits.json")[self.zone]
        key = _measured_key(gpu, sorted(data))
        if key is None:
            return None
        counts = sorted(int(c) for c in data[key])
        measured = max((c for c in counts if c <= k), default=counts[0])
        remote = data[key][str(measured)][self.zone]
        peer_key = _measured_key(peer_gpu, sorted(remote))
        if peer_key is None:
            return None
        peer_counts = sorted(int(c) for c in remote[peer_key])
        peer_measured = max((c for c in peer_counts if c <= k), default=peer_counts[0])
        coeffs, peak = remote[peer_key][str(peer_measured)]
        return coeffs, peak

    def intra_bandwidth(self, node: str, group_size: int, message_bytes: Any) -> Any:
        if node not in self._gpu_of_node:
            return super().intra_bandwidth(node, group_size, message_bytes)
        return self._gbs(*self._intra_fit(self._gpu_of_node[node], group_size), message_bytes)

    def inter_flow_bandwidth(self, node: str, peer: str, flows: int, peer_flows: int, message_bytes: Any) -> Any:
        k = max(flows, peer_flows)
        fit = (self._inter_fit(self._gpu_of_node[node], self._gpu_of_node[peer], k)
               if node in self._gpu_of_node and peer in self._gpu_of_node else None)
        if fit is None:
            return super().inter_flow_bandwidth(node, peer, flows, peer_flows, message_bytes)
        return self._gbs(*fit, message_bytes) / k

    def ring_message_bytes(self, num_bytes: Any, members: int) -> Any:
        """A ring step's message: its chunk of one bucket, ``min(buffer, 5e8 B) / n``."""
        return np.minimum(np.asarray(num_bytes, dtype=float), self.BUCKET_BYTES) / members

    def send_s(self, num_bytes: float, src_device: str, dst_device: str, flows: tuple[int, int] = (1, 1)) -> float:
        a, b = self.cluster.device(src_device).node, self.cluster.device(dst_device).node
        bw = self.intra_bandwidth(a, 2, num_bytes) if a == b else \
            self.inter_flow_bandwidth(a, b, flows[0], flows[1], num_bytes)
        return float(num_bytes / bw)


def measured_tp_link_efficiency(model: str = "OPT-350", layer: int | None = None) -> tuple[float, int]:
    """(median, count) over Sailor's profiles of the tp allreduce bandwidth a block implies / the link's peak.

    For every GPU with an intra-node fit and every (micro-batch, tp > 1) with a
    tp-1 time: one block's four Megatron allreduces take ``t_tp - t_1 / tp``; a
    ring of ``tp`` moving ``2 (tp-1)/tp`` of the block output (fp32, Sailor's runs)
    in that time implies a bandwidth, compared with the fit's measured peak for a
    group of that size.  The ``network.TP_LINK_EFFICIENCY`` constant is this median.
    """
    data = read_sailor_json("layer_profiles.json")[model]
    intra = read_sailor_json("intra_node_bandwidth_fits.json")
    shape = load_sailor_training_config(model)
    seq, hidden = int(shape.get("sequence_length", 2048)), int(shape.get("hidden_size", 1024))
    ratios = []
    for gpu, by_mbs in data.items():
        if gpu not in intra:
            continue
        for mbs, by_tp in by_mbs.items():
            if "1" not in by_tp:
                continue
            block = str(layer if layer is not None else len(by_tp["1"]) // 2)
            f1, b1, _ = by_tp["1"][block]
            for tp_key, rows in by_tp.items():
                tp = int(tp_key)
                if tp == 1:
                    continue
                sizes = sorted(int(k) for k in intra[gpu])
                group = str(min((k for k in sizes if k >= tp), default=sizes[-1]))
                each = (rows[block][0] + rows[block][1] - (f1 + b1) / tp) / 4
                if each <= 0:
                    continue
                moved = ring_steps(tp) / tp * int(mbs) * seq * hidden * 4
                ratios.append(moved / each / intra[gpu][group][1])
    ratios.sort()
    n = len(ratios)
    median = ratios[n // 2] if n % 2 else (ratios[n // 2 - 1] + ratios[n // 2]) / 2
    return median, n
