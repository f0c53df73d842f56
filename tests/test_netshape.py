"""The shaped network namespace: validation, lifetime, the rate it really gives, the CLI.

Namespace tests need root and iproute2; they skip with netns_available()'s
reason elsewhere.  Rates are measured with a real TCP transfer over 127.0.0.1
inside the namespace.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from het_strategy.core.errors import ConfigError
from het_strategy.emulation.netns import NetnsUnavailable
from het_strategy.emulation.netshape import (
    LinkShape,
    main,
    netem_available,
    netns_available,
    remove_stale_namespaces,
    shaped_namespace,
)

_OK, _REASON = netns_available()
needs_netns = pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_REASON}")

# One process, a server thread and a client: sends N bytes over 127.0.0.1 and
# prints "bytes_received seconds" (from the first send to the last byte received).
_TRANSFER = r"""
import socket, sys, threading, time
n = int(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
result = {}
def serve():
    conn, _ = srv.accept()
    got = 0
    while got < n:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        got += len(chunk)
    result["t"], result["got"] = time.perf_counter(), got
    conn.close()
th = threading.Thread(target=serve); th.start()
cl = socket.create_connection(srv.getsockname())
buf = memoryview(bytes(1 << 20))
t0 = time.perf_counter()
sent = 0
while sent < n:
    k = min(len(buf), n - sent)
    cl.sendall(buf[:k]); sent += k
cl.shutdown(socket.SHUT_WR)
th.join()
print(result["got"], result["t"] - t0)
"""

# Ping-pong of one byte over TCP_NODELAY: prints the mean round-trip seconds.
_ROUND_TRIP = r"""
import socket, sys, threading, time
rounds = int(sys.argv[1])
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def echo():
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        conn.sendall(conn.recv(1))
th = threading.Thread(target=echo); th.start()
cl = socket.create_connection(srv.getsockname())
cl.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
cl.sendall(b"x"); cl.recv(1)          # warm-up, not counted
t0 = time.perf_counter()
for _ in range(rounds - 1):
    cl.sendall(b"x"); cl.recv(1)
print((time.perf_counter() - t0) / (rounds - 1))
th.join()
"""


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _own_namespaces() -> set[str]:
    """Namespaces this test process made (others may run benchmarks in namespaces meanwhile)."""
    return {n for n in _namespaces() if n.startswith(f"het-{os.getpid()}-")}


def _transfer_mbit(ns, num_bytes: int) -> float:
    proc = ns.run([sys.executable, "-c", _TRANSFER, str(num_bytes)],
                  capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    got, seconds = proc.stdout.split()
    assert int(got) == num_bytes
    return num_bytes * 8 / float(seconds) / 1e6


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf"), True, "100", None, 1e-9])
def test_link_shape_rejects_bad_rate(rate):
    with pytest.raises(ConfigError) as info:
        LinkShape(rate_mbit=rate)
    shown = "null" if rate is None else repr(rate)  # the way a config file spells a missing value
    assert "`rate_mbit`" in str(info.value) and shown in str(info.value) and "must" in str(info.value)


@pytest.mark.parametrize("delay", [-0.5, float("nan"), float("inf"), False, "5"])
def test_link_shape_rejects_bad_delay(delay):
    with pytest.raises(ConfigError) as info:
        LinkShape(rate_mbit=100, delay_ms=delay)
    assert "`delay_ms`" in str(info.value) and repr(delay) in str(info.value) and "must" in str(info.value)


def test_link_shape_burst_covers_loopback_mtu_and_a_tick():
    assert LinkShape(1).burst_bytes == 4 * 65536
    assert LinkShape(10_000).burst_bytes == 10_000 * 10**6 // 8 // 250
    assert LinkShape(12.5).rate_bit_per_s == 12_500_000


def test_bad_namespace_name_is_a_config_error():
    with pytest.raises(ConfigError, match="`name`"):
        with shaped_namespace(None, name="bad/name"):
            pass


# ------------------------------------------------------------------------- lifetime


@needs_netns
def test_namespace_exists_inside_and_is_gone_after():
    with shaped_namespace(LinkShape(100)) as ns:
        assert ns.name.startswith(f"het-{os.getpid()}-")
        assert ns.name in _namespaces()
        assert "tbf" in ns.qdisc_stats()
        assert ns.command(["true"])[-2:] == [ns.name, "true"]
    assert ns.name not in _namespaces()


@needs_netns
@pytest.mark.parametrize("exc_type", [RuntimeError, KeyboardInterrupt])
def test_namespace_is_deleted_when_the_block_raises(exc_type):
    with pytest.raises(exc_type):
        with shaped_namespace(LinkShape(100)) as ns:
            assert ns.name in _namespaces()
            raise exc_type("boom")
    assert ns.name not in _namespaces()


@needs_netns
def test_unshaped_namespace_has_no_tbf_and_leftover_process_is_ended():
    with shaped_namespace(None) as ns:
        assert "tbf" not in ns.qdisc_stats()
        sleeper = ns.popen(["sleep", "30"])
    assert sleeper.wait(timeout=5) == -signal.SIGTERM
    assert ns.name not in _namespaces()


@needs_netns
def test_explicit_name_is_used_and_an_existing_one_is_not_adopted():
    name = f"het-test-{os.getpid()}"
    with shaped_namespace(None, name=name) as ns:
        assert ns.name == name
        with pytest.raises(NetnsUnavailable, match="already exists"):
            with shaped_namespace(None, name=name):
                pass
        assert name in _namespaces()       # the failed second attempt did not delete the first
    assert name not in _namespaces()


# ---------------------------------------------------------------------------- rates


@needs_netns
@pytest.mark.slow
def test_shaped_rate_is_close_to_the_limit_and_unshaped_is_much_faster():
    num_bytes = 8 * 2**20
    with shaped_namespace(LinkShape(rate_mbit=50)) as ns:
        before = ns.lo_tx_bytes()
        shaped = _transfer_mbit(ns, num_bytes)
        sent_on_lo = ns.lo_tx_bytes() - before
    with shaped_namespace(None) as ns:
        unshaped = _transfer_mbit(ns, num_bytes)
    assert 0.5 * 50 <= shaped <= 1.2 * 50, shaped
    assert unshaped > 5 * shaped, (unshaped, shaped)
    assert sent_on_lo >= num_bytes          # payload + TCP/IP headers + ACKs all cross lo


@needs_netns
def test_delay_needs_netem():
    ok, reason = netem_available()
    if not ok:
        assert "netem" in reason
        with pytest.raises(NetnsUnavailable, match="netem") as info:
            with shaped_namespace(LinkShape(rate_mbit=100, delay_ms=20)):
                pass
        assert "rate shaping" in str(info.value)
        assert not _own_namespaces()       # nothing half-made left behind
        return
    with shaped_namespace(LinkShape(rate_mbit=100, delay_ms=20)) as ns:
        proc = ns.run([sys.executable, "-c", _ROUND_TRIP, "20"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) >= 0.9 * 2 * 0.020     # each direction is delayed once


# ------------------------------------------------------------------------------ CLI
# main() is called in-process where it can be: `python -m het_strategy.emulation.netshape`
# first imports the package (torch + Lightning, ~4 s); one test runs it for real.


@needs_netns
def test_cli_forwards_exit_code_and_leaves_no_namespace(capfd):
    assert main(["--rate-mbit", "100", "--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert "tbf rate 100 Mbit/s" in capfd.readouterr().err       # shaping is announced, never silent
    assert not _own_namespaces()


@needs_netns
@pytest.mark.slow
def test_cli_sigterm_reaches_the_command_and_tears_down():
    proc = subprocess.Popen([sys.executable, "-m", "het_strategy.emulation.netshape", "--rate-mbit", "100", "--",
                             "sleep", "30"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 15
        while not any(n.startswith(f"het-{proc.pid}-") for n in _namespaces()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        time.sleep(0.2)                                       # let the command start
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 128 + signal.SIGTERM
        assert not any(n.startswith(f"het-{proc.pid}-") for n in _namespaces())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_bad_rate_exits_2(capfd):
    assert main(["--rate-mbit", "-1", "--", "true"]) == 2
    assert "`rate_mbit`" in capfd.readouterr().err


def test_cli_check_reports_availability(capfd):
    assert main(["--check"]) == (0 if _OK else 1)
    assert capfd.readouterr().out.startswith("ok:" if _OK else "unavailable:")


# -------------------------------------------------------------------------- cleanup


@needs_netns
def test_remove_stale_namespaces_deletes_only_those_of_dead_creators():
    with open("/proc/sys/kernel/pid_max") as f:
        dead_pid = int(f.read()) + 1                     # no process can have it
    stale = f"het-{dead_pid}-0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with shaped_namespace(None) as live:
            removed = remove_stale_namespaces()
            assert stale in removed
            assert live.name not in removed and live.name in _namespaces()
        assert stale not in _namespaces()
    finally:
        if stale in _namespaces():
            subprocess.run(["ip", "netns", "del", stale])
