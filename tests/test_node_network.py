"""Emulated nodes: a namespace per node, joined by shaped veth links (``emulation/node_network.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from het_strategy.core.errors import ConfigError
from het_strategy.emulation.local_ranks import run_script_ranks
from het_strategy.emulation.netns import list_namespaces
from het_strategy.emulation.netshape import LinkShape, netns_available
from het_strategy.emulation.node_network import emulated_nodes

WORKER = Path(__file__).parent / "_node_network_worker.py"
_OK, _WHY = netns_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable here: {_WHY}")


@pytest.mark.parametrize("kwargs, field", [({"num_nodes": 1, "inter_node": None}, "num_nodes"),
                                           ({"num_nodes": 100, "inter_node": None}, "num_nodes"),
                                           ({"num_nodes": 2, "inter_node": 100}, "inter_node"),
                                           ({"num_nodes": 2, "inter_node": None, "pairs": {(0, 2): LinkShape(10)}},
                                            r"pairs\[\(0, 2\)\]"),
                                           ({"num_nodes": 2, "inter_node": None, "pairs": {(0, 1): 10}},
                                            r"pairs\[\(0, 1\)\]"),
                                           ({"num_nodes": 2, "inter_node": LinkShape(10, delay_ms=5)},
                                            "inter_node.delay_ms")])
def test_bad_input_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        with emulated_nodes(**kwargs):
            pass


@needs_netns
def test_everything_is_deleted_when_the_block_fails() -> None:
    before = set(list_namespaces())
    with pytest.raises(RuntimeError, match="boom"):
        with emulated_nodes(2, LinkShape(50)) as net:
            assert {n.namespace for n in net.nodes} | {net.switch} <= set(list_namespaces())
            raise RuntimeError("boom")
    assert set(list_namespaces()) == before


@needs_netns
@pytest.mark.multiprocess
def test_four_ranks_on_two_nodes_cross_only_the_shaped_link(tmp_path: Path) -> None:
    """2 nodes x 2 gloo ranks, 100 Mbit/s between nodes: the allreduce is exact; 4 MiB to the rank on the same
    node takes a fraction of what it takes to the other node, which runs at about the link's rate; the bytes
    node 0 sent over its uplink are the inter-node part of the traffic (the 4 MiB to rank 2 and its share of
    the allreduce), not the intra-node send."""
    rate_mbit = 100
    with emulated_nodes(2, LinkShape(rate_mbit)) as net:
        tx_before = net.uplink_tx_bytes(0)
        codes = run_script_ranks([sys.executable, str(WORKER), str(tmp_path)], 4, tmp_path, 120, nodes=net)
        sent = net.uplink_tx_bytes(0) - tx_before
    logs = "\n".join((tmp_path / f"log{r}.txt").read_text()[-1500:] for r in range(4))
    assert codes == [0, 0, 0, 0], logs
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["node"] for r in rows] == [0, 0, 1, 1]
    assert all(r["allreduce_exact"] and r["allreduce"] == 10 for r in rows)
    assert rows[1]["received_ok"] and rows[2]["received_ok"]
    payload_bits = 4 * 2**20 * 8
    cross_mbit = payload_bits / rows[0]["other_node_s"] / 1e6
    assert 0.6 * rate_mbit < cross_mbit < 1.15 * rate_mbit, rows[0]
    assert rows[0]["same_node_s"] < 0.25 * rows[0]["other_node_s"], rows[0]
    assert 4 * 2**20 < sent < 4 * 2**20 * 1.25 + 2**20, sent  # + headers + the allreduce's share (0.5 MiB)


BURST_WORKER = Path(__file__).parent / "_link_burst_worker.py"


@needs_netns
@pytest.mark.multiprocess
def test_a_short_message_after_an_idle_spell_takes_its_line_time(tmp_path: Path) -> None:
    """20 Mbit/s between two one-rank nodes: 256 KiB after an idle spell takes its line time (a shaper bucket of
    four 64 KiB loopback packets let all of it through at once)."""
    with emulated_nodes(2, LinkShape(20)) as net:
        codes = run_script_ranks([sys.executable, str(BURST_WORKER), str(tmp_path)], 2, tmp_path, 120, nodes=net)
    assert codes == [0, 0], (tmp_path / "log0.txt").read_text()[-1500:] + (tmp_path / "log1.txt").read_text()[-1500:]
    sender, receiver = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert receiver["received_ok"]
    line_s = (256 << 10) / (20e6 / 8)
    assert 0.85 * line_s < sender["short_s"] < 2 * line_s, sender


HIER_WORKER = Path(__file__).parent / "_hierarchical_worker.py"


@needs_netns
@pytest.mark.multiprocess
@pytest.mark.parametrize("method", ["none", "q4"])
def test_hierarchical_hook_on_two_nodes(tmp_path: Path, method: str) -> None:
    """4 gloo ranks in 2 namespaces: the hierarchical hook's gradient is the mean of every rank's (exact for
    none; within the two-phase quantizer's bound over the node sums for q4), identical on every rank; only
    the leaders cross the link, and the bytes on node 0's veth are about what its leader's hook counted."""
    steps = 10
    with emulated_nodes(2, LinkShape(200)) as net:
        codes = run_script_ranks([sys.executable, str(HIER_WORKER), str(tmp_path), method, str(steps)], 4,
                                 tmp_path, 120, nodes=net)
    logs = "\n".join((tmp_path / f"log{r}.txt").read_text()[-1500:] for r in range(4))
    assert codes == [0, 0, 0, 0], logs
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["identical"] for r in rows)
    if method == "none":
        assert all(r["max_error"] <= 1e-6 * r["scale"] for r in rows), rows
    else:
        assert all(r["excess"] <= 0 for r in rows), rows
        assert max(r["used_of_bound"] for r in rows) > 0.2  # the bound is not vacuous
        assert rows[0]["hook_inter_bytes"] < steps * rows[0]["bucket_bytes"] / 4  # 4-bit codes + scales
    leader, other = rows[0], rows[1]
    assert other["hook_inter_bytes"] == 0  # the non-leader never crosses the link
    # what crossed node 0's veth (TCP/IP headers and acks on top) is about what the leader's hook counted
    assert leader["hook_inter_bytes"] <= leader["uplink_tx"] <= 1.2 * leader["hook_inter_bytes"] + 64 * 1024, rows
