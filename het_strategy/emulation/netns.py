"""Named network namespaces through iproute2: create one, list them, end what runs inside, delete one.

The plumbing under ``netshape.py``: every ``ip`` call runs with a timeout and
its output captured, and a failure is reported with the tool's own words
(plus a hint when this process is not root).  Namespaces this package names
itself are ``het-<creator pid>-<n>``, so a later run can tell which ones a
killed run left behind.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Iterator, Sequence

from het_strategy.core.errors import field_error

__all__ = [
    "NAMESPACE_PREFIX",
    "NetnsUnavailable",
    "iproute_tool",
    "run_iproute",
    "failure_reason",
    "list_namespaces",
    "namespace_exists",
    "create_namespace",
    "delete_namespace",
    "end_started_processes",
]

_log = logging.getLogger(__name__)

#: Prefix of every namespace this package names itself: ``het-<creator pid>-<n>``.
NAMESPACE_PREFIX = "het-"
#: Seconds a leftover process gets after SIGTERM before SIGKILL, at teardown.
_TERMINATE_GRACE_S = 2.0
#: Seconds any single ip/tc call may take.
_TOOL_TIMEOUT_S = 30.0

_counter = itertools.count()
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class NetnsUnavailable(RuntimeError):
    """A network namespace or its qdisc could not be made here; the message says why."""


def iproute_tool(name: str) -> str:
    """Absolute path of an iproute2 tool; /usr/sbin is often missing from a non-root PATH."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if found is None:
        raise NetnsUnavailable(f"`{name}` (iproute2) is not installed or not on PATH; "
                               f"install iproute2 to use network namespaces")
    return found


def run_iproute(argv: Sequence[str]) -> subprocess.CompletedProcess:
    """Run an ip/tc command, capturing its output; never raises for a non-zero exit."""
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def failure_reason(proc: subprocess.CompletedProcess) -> str:
    """The failure text of a tool call, with a hint when we are not root."""
    text = (proc.stderr or proc.stdout or "").strip() or f"exit code {proc.returncode}"
    if os.geteuid() != 0:
        text += f" (this process is not root: euid {os.geteuid()}; namespaces need CAP_SYS_ADMIN)"
    return text


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    proc = run_iproute([iproute_tool("ip"), "-j", "netns", "list"])
    if proc.returncode != 0:
        raise NetnsUnavailable(f"`ip netns list` failed: {failure_reason(proc)}")
    text = proc.stdout.strip()
    if not text:          # iproute2 prints nothing, not [], when /run/netns is empty
        return []
    return [entry["name"] for entry in json.loads(text)]


def namespace_exists(name: str) -> bool:
    """Whether a named network namespace ``name`` exists."""
    return name in list_namespaces()


def _pids_inside(name: str) -> list[int]:
    """Live processes in namespace ``name`` (``ip netns pids``; zombies are not listed)."""
    proc = run_iproute([iproute_tool("ip"), "netns", "pids", name])
    if proc.returncode != 0:
        return []
    return [int(tok) for tok in proc.stdout.split() if tok.isdigit()]


def _end_processes_inside(name: str) -> None:
    """SIGTERM, then after a grace period SIGKILL, every process still in ``name``.

    A namespace with a process in it outlives ``ip netns del`` (anonymously, and
    still shaped), so a worker left behind would keep running on the slow link.
    """
    pids = [p for p in _pids_inside(name) if p != os.getpid()]
    if not pids:
        return
    _log.warning("netshape: ending %d process(es) still in namespace %s: %s", len(pids), name, pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (_TERMINATE_GRACE_S if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline:
            pids = [p for p in _pids_inside(name) if p != os.getpid()]
            if not pids:
                return
            time.sleep(0.05)


def end_started_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM, then after the grace period SIGKILL, the still running processes a namespace started.

    They are ended by their own handles, not found through ``ip netns pids``: a
    child started just before teardown may not have entered the namespace yet,
    and would then outlive it.
    """
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


def delete_namespace(name: str) -> None:
    """End what runs in ``name`` and delete it; logs (never raises) if the kernel refuses."""
    try:
        _end_processes_inside(name)
        proc = run_iproute([iproute_tool("ip"), "netns", "del", name])
        if proc.returncode != 0 and namespace_exists(name):
            _log.error("netshape: could not delete namespace %s: %s; remove it with `ip netns del %s`",
                       name, failure_reason(proc), name)
    except (OSError, subprocess.SubprocessError, NetnsUnavailable) as exc:
        _log.error("netshape: could not delete namespace %s: %s; remove it with `ip netns del %s`",
                   name, exc, name)


def create_namespace(name: str | None) -> str:
    """``ip netns add`` a fresh namespace; returns its name.  Ours never reuses an existing one."""
    ip = iproute_tool("ip")
    if name is not None:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise field_error("name", name, "be 1-64 characters of letters, digits, '_', '.', '-', "
                                            "starting with a letter or digit")
        if namespace_exists(name):
            raise NetnsUnavailable(f"network namespace {name!r} already exists; choose another name "
                                   f"or remove it with `ip netns del {name}`")
        candidates: Iterator[str] = iter([name])
    else:
        candidates = (f"{NAMESPACE_PREFIX}{os.getpid()}-{next(_counter)}" for _ in range(100))
    last = ""
    for candidate in candidates:
        proc = run_iproute([ip, "netns", "add", candidate])
        if proc.returncode == 0:
            return candidate
        last = failure_reason(proc)
        if "exists" not in last:     # a name clash is retried with the next counter; anything else is fatal
            break
    raise NetnsUnavailable(f"could not create a network namespace (`ip netns add`): {last}")
