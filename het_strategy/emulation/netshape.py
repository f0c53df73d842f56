"""A real slow network on one machine: a private network namespace whose loopback is shaped with ``tc``.

Benchmarks of gradient compression need a link that is actually slow, not a
sleep that pretends to be.  ``shaped_namespace`` makes one (its docstring has
the steps): processes started with ``ShapedNamespace.run``/``.popen`` (or
``.command(argv)``) talk over 127.0.0.1 through the ``lo`` that ``LinkShape``
shapes (a ``tbf`` rate, a ``netem`` delay).  What that means for a measurement:
docs/guide/compression.md, "A real slow network".

Invariants:

- ``rate_mbit`` is the *total* of all traffic inside the namespace (loopback has
  one transmit queue), not a per-link rate; ``node_network.py`` shapes per link;
- nothing half-made is left: the namespace is deleted on every exit path, and
  ``remove_stale_namespaces`` finds those of a killed run by the pid in the name;
- the shaping is never on silently: the CLI prints what it applied,
  ``qdisc_stats`` shows the qdisc's counters, and a delay on a kernel without
  ``sch_netem`` raises ``NetnsUnavailable`` rather than run unshaped.

Needs root and iproute2's ``ip``/``tc`` (``netns_available`` tells, cheaply).  Command line::

    python -m het_strategy.emulation.netshape --rate-mbit 100 [--delay-ms 0] -- CMD ARGS...
    python -m het_strategy.emulation.netshape -- CMD ARGS...          # unshaped namespace
    python -m het_strategy.emulation.netshape --check
    python -m het_strategy.emulation.netshape --remove-stale
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.emulation.netns import (
    NAMESPACE_PREFIX,
    NetnsUnavailable,
    create_namespace,
    delete_namespace,
    end_started_processes,
    failure_reason,
    iproute_tool,
    list_namespaces,
    namespace_exists,
    run_iproute,
)

__all__ = [
    "LinkShape",
    "ShapedNamespace",
    "netns_available",
    "netem_available",
    "shaped_namespace",
    "remove_stale_namespaces",
    "loopback_tx_bytes",
    "main",
]

_log = logging.getLogger(__name__)

#: Loopback's MTU (64 KiB); with GSO a single "packet" on lo can be this large,
#: and tbf drops any packet bigger than its bucket, so the bucket holds several.
_LO_MTU_BYTES = 65536
#: Time a packet may wait in tbf's queue before being dropped (sets its limit).
_TBF_LATENCY_MS = 100
#: Packets netem may hold while delaying them (its default of 1000 would drop
#: packets once rate x delay exceeds ~1000 small packets).
_NETEM_LIMIT_PACKETS = 100_000


@dataclass(frozen=True)
class LinkShape:
    """How the namespace's loopback is shaped."""

    rate_mbit: float
    """Total rate of all traffic on the namespace's loopback, in Mbit/s (10^6 bit/s); > 0."""
    delay_ms: float = 0.0
    """Delay added to every packet, in ms (a round trip sees it twice); >= 0; > 0 needs netem."""

    def __post_init__(self) -> None:
        rate = self.rate_mbit
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate):
            raise field_error("rate_mbit", rate, "be a finite number of Mbit/s")
        if rate * 1e6 < 1:
            raise field_error("rate_mbit", rate, "be >= 1e-6 (at least 1 bit/s)",
                              "use shape=None for an unshaped namespace")
        delay = self.delay_ms
        if isinstance(delay, bool) or not isinstance(delay, (int, float)) or not math.isfinite(delay):
            raise field_error("delay_ms", delay, "be a finite number of milliseconds")
        if delay < 0:
            raise field_error("delay_ms", delay, "be >= 0")

    @property
    def rate_bit_per_s(self) -> int:
        """The rate as whole bits per second, as given to tc."""
        return max(1, round(self.rate_mbit * 1e6))

    @property
    def burst_bytes(self) -> int:
        """tbf bucket size: >= 4 loopback MTUs, and >= one timer tick's worth at HZ=250."""
        return max(4 * _LO_MTU_BYTES, self.rate_bit_per_s // 8 // 250)

    def describe(self) -> str:
        """One line for logs: what the qdisc will do."""
        text = f"tbf rate {self.rate_mbit:g} Mbit/s (burst {self.burst_bytes} B)"
        if self.delay_ms > 0:
            text = f"netem delay {self.delay_ms:g} ms + " + text
        return text


# ------------------------------------------------------------------- shaping, teardown


@contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold back Ctrl-C during teardown, then deliver it; only the main thread can do this.

    Teardown takes milliseconds; a second Ctrl-C landing in it must not leave
    the namespace behind.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except ValueError:    # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
        if received and callable(previous):
            previous(signal.SIGINT, None)


def _shape_loopback(name: str, shape: LinkShape | None) -> None:
    """Bring ``lo`` up in ``name`` and attach the qdisc(s) of ``shape``; raises NetnsUnavailable."""
    ip, tc = iproute_tool("ip"), iproute_tool("tc")
    proc = run_iproute([ip, "-n", name, "link", "set", "lo", "up"])
    if proc.returncode != 0:
        raise NetnsUnavailable(f"could not bring loopback up in namespace {name}: {failure_reason(proc)}")
    if shape is None:
        return
    in_ns = [ip, "netns", "exec", name, tc]
    tbf = ["tbf", "rate", f"{shape.rate_bit_per_s}bit", "burst", str(shape.burst_bytes),
           "latency", f"{_TBF_LATENCY_MS}ms"]
    if shape.delay_ms > 0:
        # netem at the root delays every packet, then hands it to the tbf below (netem's
        # one class, 1:1), which paces it: the layout of the netem documentation's
        # "rate control" example.
        proc = run_iproute([*in_ns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", "netem",
                      "delay", f"{shape.delay_ms:g}ms", "limit", str(_NETEM_LIMIT_PACKETS)])
        if proc.returncode != 0:
            raise NetnsUnavailable(_netem_failure(proc))
        proc = run_iproute([*in_ns, "qdisc", "add", "dev", "lo", "parent", "1:1", "handle", "10:", *tbf])
    else:
        proc = run_iproute([*in_ns, "qdisc", "add", "dev", "lo", "root", "handle", "1:", *tbf])
    if proc.returncode != 0:
        raise NetnsUnavailable(f"could not attach tbf to loopback in namespace {name} "
                               f"({shape.describe()}): {failure_reason(proc)}")


def _netem_failure(proc: subprocess.CompletedProcess) -> str:
    why = failure_reason(proc)
    if "unknown" in why.lower() or "not supported" in why.lower():
        return (f"netem is missing from this kernel (sch_netem; tc says: {why}); only rate shaping "
                f"is available here -- use delay_ms=0")
    return f"could not attach netem (needed for delay_ms > 0) to loopback: {why}"


# ----------------------------------------------------------------------- the namespace


def loopback_tx_bytes() -> int:
    """Bytes loopback has transmitted in *this process's* network namespace (``/proc/net/dev`` is per
    namespace): what a worker running inside a ``ShapedNamespace`` reads around the traffic it counts."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        iface, _, counters = line.partition(":")
        if iface.strip() == "lo":
            return int(counters.split()[8])
    raise NetnsUnavailable("no loopback interface in /proc/net/dev")


class ShapedNamespace:
    """A live network namespace made by ``shaped_namespace``; valid only inside that ``with``."""

    __slots__ = ("name", "shape", "started")

    def __init__(self, name: str, shape: LinkShape | None) -> None:
        self.name = name
        """The namespace's name (``ip netns exec NAME ...``)."""
        self.shape = shape
        """The shaping of its loopback, or None for an unshaped namespace."""
        self.started: list[subprocess.Popen] = []
        """The processes ``popen`` started (ended at teardown if still running)."""

    def __repr__(self) -> str:
        return f"ShapedNamespace(name={self.name!r}, shape={self.shape!r})"

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed so that it runs inside the namespace."""
        return [iproute_tool("ip"), "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], **subprocess_kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` of ``argv`` inside the namespace (same keywords)."""
        return subprocess.run(self.command(argv), **subprocess_kwargs)

    def popen(self, argv: Sequence[str], **subprocess_kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen`` of ``argv`` inside the namespace; it is ended at teardown if still running."""
        proc = subprocess.Popen(self.command(argv), **subprocess_kwargs)
        self.started.append(proc)
        return proc

    def lo_tx_bytes(self) -> int:
        """Bytes loopback has transmitted in this namespace (every packet, both directions, headers included)."""
        proc = run_iproute([iproute_tool("ip"), "-n", self.name, "-s", "-j", "link", "show", "lo"])
        if proc.returncode != 0:
            raise NetnsUnavailable(f"could not read loopback counters in namespace {self.name}: {failure_reason(proc)}")
        return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])

    def qdisc_stats(self) -> str:
        """``tc -s qdisc show dev lo`` inside the namespace: sent, dropped, overlimits, backlog."""
        proc = run_iproute(self.command([iproute_tool("tc"), "-s", "qdisc", "show", "dev", "lo"]))
        if proc.returncode != 0:
            raise NetnsUnavailable(f"could not read qdisc stats in namespace {self.name}: {failure_reason(proc)}")
        return proc.stdout


@contextmanager
def shaped_namespace(shape: LinkShape | None, name: str | None = None) -> Iterator[ShapedNamespace]:
    """A fresh network namespace with shaped (or, for ``shape=None``, plain) loopback.

    The namespace is named ``het-<pid>-<n>`` unless ``name`` is given (an
    existing namespace is never adopted).  It is deleted when the block exits,
    however it exits; processes still inside are terminated first.  Raises
    ``NetnsUnavailable`` (nothing left behind) when it cannot be made, e.g. not
    root, no iproute2, or ``delay_ms > 0`` without netem.

    1. create a network namespace with a unique name ``het-<creator pid>-<n>``
       (``ip netns add``); the pid in the name lets ``remove_stale_namespaces``
       recognise namespaces left behind by a run that was killed;
    2. bring its loopback up (a fresh namespace's ``lo`` is down);
    3. attach a token-bucket filter (``tbf``) to ``lo``; with ``delay_ms > 0`` a
       ``netem`` root adds the delay and the ``tbf`` hangs below it;
    4. yield a ``ShapedNamespace``: processes started with ``.run``/``.popen`` (or
       with ``.command(argv)`` in any launcher) talk over 127.0.0.1 through the
       shaped ``lo``, so gloo's TCP traffic between them crosses the slow link;
    5. on exit -- normal, exception, KeyboardInterrupt -- end any process still
       inside and delete the namespace.  If any step of 1-3 fails the namespace is
       deleted before ``NetnsUnavailable`` is raised: nothing half-made is left.
    """
    if shape is not None and not isinstance(shape, LinkShape):
        raise field_error("shape", shape, "be a LinkShape or None")
    created = create_namespace(name)
    ns: ShapedNamespace | None = None
    try:
        _shape_loopback(created, shape)
        _log.debug("netshape: namespace %s, loopback %s", created,
                  shape.describe() if shape is not None else "unshaped")
        ns = ShapedNamespace(created, shape)
        yield ns
    finally:
        with _sigint_deferred():
            if ns is not None:
                end_started_processes(ns.started)
            delete_namespace(created)


# ------------------------------------------------------------------------------ probes


def netns_available() -> tuple[bool, str]:
    """Whether namespaces with a tbf-shaped loopback can be made here, and why (not).

    Creates and deletes a throwaway namespace (tens of milliseconds).  The
    reason also says whether netem (``delay_ms > 0``) is available.
    """
    try:
        with shaped_namespace(LinkShape(rate_mbit=100.0)):
            pass
    except (NetnsUnavailable, OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    netem_ok, netem_reason = netem_available()
    return True, ("network namespaces and tc tbf work; " + ("netem works too (delay_ms > 0 is available)"
                                                            if netem_ok else netem_reason))


def netem_available() -> tuple[bool, str]:
    """Whether ``delay_ms > 0`` works here (netem under tbf in a throwaway namespace), and why (not)."""
    try:
        with shaped_namespace(LinkShape(rate_mbit=100.0, delay_ms=1.0)):
            pass
    except (NetnsUnavailable, OSError, subprocess.SubprocessError) as exc:
        return False, str(exc)
    return True, "netem works"


def remove_stale_namespaces(prefix: str = NAMESPACE_PREFIX) -> list[str]:
    """Delete namespaces ``<prefix><pid>-<n>`` whose creator ``pid`` is no longer running.

    Such namespaces are left by a run killed with SIGKILL (no teardown ran).
    Namespaces of live creators and names of any other form are not touched.
    A recycled pid makes a stale namespace look alive; it is then kept, the
    safe error.  Returns the names deleted.
    """
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-(\d+)$")
    removed = []
    for name in list_namespaces():
        match = pattern.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        delete_namespace(name)
        if not namespace_exists(name):
            removed.append(name)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -------------------------------------------------------------------------------- CLI


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m het_strategy.emulation.netshape",
        description="Run a command inside a private network namespace whose loopback is rate-limited "
                    "with tc (the rate is shared by all traffic on loopback, both directions).",
        epilog="Exit code: the command's own (128+N if killed by signal N); 2 for bad options; "
               "125 if the namespace could not be made.")
    parser.add_argument("--rate-mbit", type=float, default=None,
                        help="loopback rate in Mbit/s; omit for an unshaped namespace")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="delay added to every packet in ms (needs netem)")
    parser.add_argument("--name", default=None, help="namespace name (default het-<pid>-<n>)")
    parser.add_argument("--check", action="store_true", help="print whether namespaces work here and exit")
    parser.add_argument("--remove-stale", action="store_true",
                        help="delete het-<pid>-<n> namespaces whose creator is dead, and exit")
    if "--" in argv:
        cut = argv.index("--")
        opts, command = argv[:cut], argv[cut + 1:]
    else:
        opts, command = argv, []
    args = parser.parse_args(opts)
    if not (args.check or args.remove_stale) and not command:
        parser.error("give the command to run after `--`")
    if args.rate_mbit is None and args.delay_ms:
        parser.error("--delay-ms needs --rate-mbit")
    return args, command


def _run_forwarding_signals(ns: ShapedNamespace, command: list[str]) -> int:
    """Run ``command`` inside ``ns``; SIGTERM/SIGINT sent to us are passed on, and we wait for it."""
    proc = ns.popen(command)

    def forward(signum: int, frame: Any) -> None:
        # A Ctrl-C at the terminal reaches the whole foreground process group, the
        # command included; passing it on again would deliver it twice.
        if signum == signal.SIGINT and _terminal_foreground():
            return
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        returncode = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - returncode if returncode < 0 else returncode


def _terminal_foreground() -> bool:
    """Whether we run in the foreground process group of a terminal (so a Ctrl-C hits our child too)."""
    try:
        return os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m het_strategy.emulation.netshape``; returns the exit code."""
    args, command = _parse(sys.argv[1:] if argv is None else list(argv))
    if args.check:
        ok, reason = netns_available()
        print(f"{'ok' if ok else 'unavailable'}: {reason}")
        return 0 if ok else 1
    if args.remove_stale:
        for name in remove_stale_namespaces():
            print(f"removed {name}")
        return 0
    try:
        shape = None if args.rate_mbit is None else LinkShape(args.rate_mbit, args.delay_ms)
        with shaped_namespace(shape, name=args.name) as ns:
            print(f"netshape: running in namespace {ns.name}, loopback "
                  f"{shape.describe() if shape is not None else 'unshaped'}", file=sys.stderr, flush=True)
            return _run_forwarding_signals(ns, command)
    except ConfigError as exc:
        print(f"netshape: {exc}", file=sys.stderr)
        return 2
    except NetnsUnavailable as exc:
        print(f"netshape: {exc}", file=sys.stderr)
        return 125


if __name__ == "__main__":
    sys.exit(main())
