"""Which ranks are still there: a heartbeat per rank through the rendezvous store, and a bounded end when one stops.

Without it a rank that dies ends a run badly: on gloo the survivors fail in whatever collective they are in, each
with its own traceback and no word of which device went; on NCCL a dead peer is often not seen at all.

``Liveness`` (one per rank, once the process group is up) runs a daemon thread that:

- **beats**: adds 1 to ``het_liveness/<rank>`` in the job's TCP store (the one rank 0 hosts) every ``interval_s``.
  A counter, not a time stamp (the hosts' clocks need not agree).  A *slow* rank keeps beating (slowness is the
  straggler callbacks' business); a rank that is *gone* or frozen stops;
- **watches**: reads every rank's counter in one ``multi_get`` per beat.  A peer silent for ``timeout_s`` is gone,
  unless its teardown marked it finished.  The lowest survivor logs one line naming its rank, device and node and
  announces the verdict in the store; every survivor ends with ``EXIT_PEER_GONE`` (``os._exit``: a collective it
  may be blocked in would otherwise wait out its timeout), the lowest last, once the others took the verdict.
  A checkpoint being written (``writing()``) is finished first.  A store silent for ``timeout_s``: rank 0 is gone.

A failed collective (``wait_for_verdict``, from ``on_exception``) waits up to ``timeout_s`` for the verdict, so
the run ends with that one line; an error with no silent peer behind it propagates as usual.

Invariant: every rank ends within ``timeout_s`` plus one beat of a peer going silent.  Cost: three store requests
per rank per beat (``interval_s`` = ``timeout_s / 10``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

from het_strategy.core.log import logger

__all__ = ["EXIT_PEER_GONE", "HEARTBEAT_TIMEOUT_S", "COLLECTIVE_TIMEOUT_S", "Liveness", "LivenessGuard",
           "liveness_interval_s"]

EXIT_PEER_GONE = 3
"""The exit code of every surviving rank when a peer is gone."""
HEARTBEAT_TIMEOUT_S = 30.0
"""Default bound on finding a rank gone: long enough that no pause of a live process (a garbage collection, a
checkpoint written by the main thread) silences its heartbeat thread, short against torch's 30-minute default."""
COLLECTIVE_TIMEOUT_S = 300.0
"""Default timeout of one collective (Lightning's ``timeout=``, torch's 30 minutes otherwise): the bound on a rank
that is alive and beating but never reaches the collective (a hang in user code); the slowest legitimate wait,
rank 0 planning or writing a checkpoint while the others wait, stays well inside it."""

_PREFIX = "het_liveness/"
_DONE = "het_liveness_done/"
"""``_DONE<rank>`` holds a rank's counter as it stopped normally (its teardown): silent since, it is finished,
not gone.  A rank that starts again (``validate`` after ``fit``) beats past that value and is watched again."""


def liveness_interval_s(timeout_s: float) -> float:
    """Seconds between beats for a ``timeout_s`` bound: a tenth of it (a live peer's counter then moves many times
    within the bound), at least 0.05 s."""
    return max(0.05, timeout_s / 10.0)


class Liveness:
    """This rank's heartbeat and watchdog (see the module docstring).

    Args:
        rank: this rank.
        names: per rank, how the report names it (``device `cpu2` on node `local```).
        timeout_s: seconds of silence after which a peer is gone.
        store_factory: builds this rank's own store client (default: a TCP client of ``MASTER_ADDR:MASTER_PORT``).
        exit: what ends the process (``os._exit``; tests pass a recorder).
    """

    def __init__(self, rank: int, names: Sequence[str], timeout_s: float,
                 store_factory: Callable[[], Any] | None = None, exit: Callable[[int], None] = os._exit) -> None:
        self.rank, self.names, self.timeout_s = rank, list(names), float(timeout_s)
        self.interval_s = liveness_interval_s(self.timeout_s)
        self._store_factory = store_factory or _job_store
        self._exit = exit
        self._stop = threading.Event()
        self._verdict = threading.Event()
        self._writing = threading.Lock()
        self._thread: threading.Thread | None = None
        self.gone: list[int] = []
        """The ranks found gone (empty while every rank beats)."""

    @property
    def world_size(self) -> int:
        return len(self.names)

    def start(self) -> None:
        """Begin beating and watching (a daemon thread)."""
        self._thread = threading.Thread(target=self._run, name="het-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread (the run ended normally)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 5.0)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """While a file is written the watchdog does not end the process (it ends it right after)."""
        with self._writing:
            yield

    def wait_for_verdict(self) -> None:
        """After a failed collective: wait up to ``timeout_s`` plus two beats for the watchdog to find a peer gone
        (it then ends the process); return when none is."""
        self._verdict.wait(timeout=self.timeout_s + 2 * self.interval_s)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        keys = [f"{_PREFIX}{r}" for r in range(self.world_size)]
        seen: list[bytes | None] = [None] * self.world_size
        last_change = [time.monotonic()] * self.world_size
        store = None
        store_ok = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            try:
                if store is None:
                    store = self._store_factory()
                store.add(keys[self.rank], 1)
                values = store.multi_get(keys) if all(v is not None for v in seen) or self._all_exist(store, keys) \
                    else None
                store_ok = now
            except Exception:  # the store is rank 0's: unreachable for long means rank 0 is gone
                store, values = None, None
                if now - store_ok > self.timeout_s and self.rank != 0:
                    self._end([0], now - store_ok, "the rendezvous store it hosts stopped answering", None, seen)
                    return
            if values is not None:
                for r, value in enumerate(values):
                    if value != seen[r]:
                        seen[r], last_change[r] = value, now
                silent = [r for r in range(self.world_size) if r != self.rank and now - last_change[r] > self.timeout_s
                          and not _finished(store, r, values[r])]
                if silent:
                    self._end(silent, max(now - last_change[r] for r in silent), "no heartbeat", store, seen)
                    return
                announced = _announced(store, values)  # taken once this rank too saw them silent a while
                if announced and all(now - last_change[r] >= self.timeout_s / 2 for r in announced):
                    self._end(announced, max(now - last_change[r] for r in announced), "no heartbeat", store, seen)
                    return
            self._stop.wait(self.interval_s)
        if store is not None:  # a normal stop: the others must not take this rank's silence for a loss
            try:
                store.set(f"{_DONE}{self.rank}", str(store.add(keys[self.rank], 0)))
            except Exception:  # noqa: BLE001 - the store may be gone at the very end of a run
                pass

    @staticmethod
    def _all_exist(store: Any, keys: list[str]) -> bool:
        """Every rank has beaten once (``multi_get`` would block on a key that does not exist yet)."""
        return bool(store.check(keys))

    def _end(self, gone: list[int], silent_s: float, why: str, store: Any, seen: list[bytes | None]) -> None:
        """Every survivor ends with ``EXIT_PEER_GONE``; the lowest logs the one line first and announces the verdict
        (``seen``: the counters it last saw), and the others wait (up to ``VERDICT_WAIT_S``) until it says so in
        ``store``, so a launcher that reports the first child to exit reports after the line, not instead of it."""
        self.gone = gone
        survivors = [r for r in range(self.world_size) if r not in gone]
        with self._writing:  # a checkpoint being written is finished first
            if survivors and self.rank == survivors[0]:
                names = "; ".join(f"rank {r} ({self.names[r]})" for r in gone)
                logger.error("%s %s gone: %s for %.1f s (heartbeat_timeout_s %g); the %d surviving rank(s) exit with "
                           "code %d", names, "is" if len(gone) == 1 else "are", why, silent_s, self.timeout_s,
                           len(survivors), EXIT_PEER_GONE)
                sys.stderr.flush()
                _say_logged(store, gone, seen, len(survivors))
            else:
                _wait_until_logged(store)
                _take(store)
            sys.stdout.flush()
            sys.stderr.flush()
            self._verdict.set()
            self._exit(EXIT_PEER_GONE)


class LivenessGuard:
    """A strategy's ``Liveness``: started once the process group is up (more than one rank, a timeout set),
    consulted on an exception, stopped at teardown; ``writing()`` is a no-op while there is none."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.liveness: Liveness | None = None
        """This rank's heartbeat and watchdog (None before ``start``, with one rank, or with no timeout)."""

    def start(self, rank: int, world_size: int, devices: Sequence[Any]) -> None:
        """Beat and watch, ``devices[r]`` naming rank ``r`` (the cluster's devices, in rank order)."""
        if self.timeout_s is None or world_size <= 1 or self.liveness is not None:
            return
        names = [f"device `{d.name}` on node `{d.node}`" for d in list(devices)[:world_size]]
        self.liveness = Liveness(rank, names, self.timeout_s)
        self.liveness.start()

    def after(self, exception: BaseException) -> None:
        """A collective that failed because a rank is gone (torch raises a ``RuntimeError``: ``DistBackendError``
        and the like) waits for the watchdog's verdict, which ends the process; anything else goes on at once."""
        if self.liveness is not None and isinstance(exception, RuntimeError):
            self.liveness.wait_for_verdict()

    def stop(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None

    @contextmanager
    def writing(self) -> Iterator[None]:
        """``Liveness.writing`` when there is one."""
        if self.liveness is None:
            yield
            return
        with self.liveness.writing():
            yield


def _finished(store: Any, rank: int, counter: bytes) -> bool:
    """``rank`` stopped normally at its counter's current value (``_DONE``); a store that fails to answer is no
    verdict (True here: the next beat meets the failure and handles it)."""
    key = f"{_DONE}{rank}"
    try:
        return bool(store.check([key])) and store.get(key) == counter
    except Exception:  # noqa: BLE001 - the store's own failure is handled at the next beat
        return True


def _job_store() -> Any:
    """A client of the job's TCP store (``MASTER_ADDR:MASTER_PORT``, hosted by rank 0's process group)."""
    import torch.distributed as dist

    return dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)


_LOGGED = "het_strategy/liveness/logged"
"""The announced verdict: ``rank:counter`` of each rank found gone, its heartbeat counter when it fell silent."""
_TAKEN = "het_strategy/liveness/taken"
"""How many survivors took a verdict (a counter)."""
VERDICT_WAIT_S = 3.0
"""How long a survivor other than the lowest waits for the lowest's line before it exits, and the lowest for the
others to take its verdict."""


def _say_logged(store: Any, gone: list[int], counters: list[bytes | None], survivors: int) -> None:
    """Announce the verdict, then wait (up to ``VERDICT_WAIT_S``) until the other ``survivors - 1`` took it."""
    if store is None:
        return
    try:
        taken = store.add(_TAKEN, 0)
        store.set(_LOGGED, ",".join(f"{r}:{(counters[r] or b'').decode()}" for r in gone))
        deadline = time.monotonic() + VERDICT_WAIT_S
        while store.add(_TAKEN, 0) < taken + survivors - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - best effort: the others then end by their own watch
        pass


def _announced(store: Any, values: list[bytes]) -> list[int]:
    """The ranks an announced verdict names, when each is still silent at the counter it names; else none.  A
    verdict of an earlier run on a store that outlives it names counters that move on as soon as those ranks beat
    again (the caller also wants to have seen them silent for half its bound)."""
    try:
        if not store.check([_LOGGED]):
            return []
        named = [entry.split(":") for entry in store.get(_LOGGED).decode().split(",") if entry]
    except Exception:  # noqa: BLE001 - the store's own failure is handled at the next beat
        return []
    gone = [int(r) for r, counter in named if int(r) < len(values) and values[int(r)] == counter.encode()]
    return gone if gone and len(gone) == len(named) else []


def _take(store: Any) -> None:
    try:
        if store is not None:
            store.add(_TAKEN, 1)
    except Exception:  # noqa: BLE001 - best effort: the lowest then waits out VERDICT_WAIT_S
        pass


def _wait_until_logged(store: Any) -> None:
    deadline = time.monotonic() + VERDICT_WAIT_S
    while time.monotonic() < deadline:
        try:
            if store is not None and store.check([_LOGGED]):
                return
        except Exception:  # noqa: BLE001 - no store to ask: wait the bound out
            store = None
        time.sleep(0.05)
