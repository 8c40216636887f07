"""--workers N: a parent that forks N workers over sockets it bound, and keeps them up.

The parent binds and listens once (daemon.open_listeners), then forks: every
worker accepts on the same inherited socket, so no other process can join the
port (SO_REUSEPORT would let any process of the same user do that) and a
second lowproxy on it fails at start. The parent serves nothing itself; it
waits for signals with them blocked (sigtimedwait), which keeps its loop free
of handler re-entrancy:

- SIGCHLD: a worker exited. It is logged with its status and started again;
  one that keeps dying soon after start waits longer each time (back-off).
- SIGTERM/SIGINT: forwarded to every worker, which drains; the parent closes
  its own copy of the listening socket (so new connections are refused, not
  left queued) and exits when all have, 0 if all drained cleanly. A second
  signal is forwarded too (a worker exits at once on its second).
- A worker exiting with status 2 from its first start could not start (a start
  mistake, said in its one line): the others are stopped and the parent exits 2.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("lowproxy")

# A worker that lived this long before dying is restarted at once.
STABLE_SECONDS = 10.0
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


@dataclass
class _Slot:
    index: int
    pid: int = 0
    seq: int = 0
    started: float = 0.0
    quick_deaths: int = 0
    restart_at: float | None = None
    lives: int = 0  # forks of this slot


def _die_with(parent: int) -> None:
    """Make a worker get SIGTERM when its parent dies (Linux), so none is orphaned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's signal forwarding remains
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exited with status {code}"


class Supervisor:
    """Forks ``count`` workers running ``run_worker(index, seq)`` and keeps them running.

    ``seq`` is unique per fork (restarts included); ``on_exit(seq)`` runs in
    the parent when that worker has been reaped.
    """

    def __init__(self, count: int, run_worker: Callable[[int, int], int],
                 on_exit: Callable[[int], None],
                 on_stop: Callable[[], None] | None = None) -> None:
        self.slots = [_Slot(index) for index in range(count)]
        self.run_worker = run_worker
        self.on_exit = on_exit
        self.on_stop = on_stop  # in the parent, once, when the drain begins
        self.parent = os.getpid()
        self.stopping = False
        self.failed = False
        self.status = 0  # 2: a worker could not start (a start mistake): all stop
        self._forks = 0
        self._mask: set[int | signal.Signals] = set()

    def run(self) -> int:
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        try:
            for slot in self.slots:
                self._fork(slot)
            log.info("started %d workers", len(self.slots))
            while True:
                self._reap()
                if self.stopping and not any(slot.pid for slot in self.slots):
                    break
                timeout = self._restart_due()
                info = signal.sigtimedwait(_SIGNALS, timeout)
                if info is not None and info.si_signo != signal.SIGCHLD:
                    self._forward(info.si_signo)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        return self.status or (1 if self.failed else 0)

    def _fork(self, slot: _Slot) -> None:
        self._forks += 1
        seq = self._forks
        pid = os.fork()
        if pid == 0:  # the worker
            status = 1
            try:
                # SIGTERM/SIGINT stay blocked (pending) until the worker's event
                # loop has its handlers (daemon unblocks them): a drain asked for
                # while a restarted worker starts must drain it, not kill it.
                signal.pthread_sigmask(signal.SIG_SETMASK,
                                       set(self._mask) | {signal.SIGTERM, signal.SIGINT})
                _die_with(self.parent)
                status = self.run_worker(slot.index, seq)
            except BaseException:
                log.exception("worker %d failed", slot.index)
            finally:
                os._exit(status)
        slot.pid, slot.seq, slot.started, slot.restart_at = pid, seq, time.monotonic(), None
        slot.lives += 1

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            slot = next((s for s in self.slots if s.pid == pid), None)
            if slot is None:
                continue
            self.on_exit(slot.seq)
            slot.pid = 0
            if self.stopping:
                self.failed = self.failed or os.waitstatus_to_exitcode(status) != 0
                continue
            lived = time.monotonic() - slot.started
            if os.waitstatus_to_exitcode(status) == 2 and slot.lives == 1 \
                    and lived < STABLE_SECONDS:
                # Status 2 at a worker's first start is a start mistake (its one
                # line is above): starting it again would only print it again,
                # for ever. (A restart failing so, a CA file gone meanwhile say,
                # backs off and is tried again: the file may come back.)
                log.error("worker %d (pid %d) could not start (status 2): stopping",
                          slot.index, pid)
                self.status = 2
                self._forward(signal.SIGTERM)
                continue
            slot.quick_deaths = slot.quick_deaths + 1 if lived < STABLE_SECONDS else 0
            delay = 0.0 if not slot.quick_deaths else min(
                MAX_BACKOFF, FIRST_BACKOFF * 2 ** (slot.quick_deaths - 1))
            slot.restart_at = time.monotonic() + delay
            log.warning("worker %d (pid %d) %s after %.1fs; restarting in %gs",
                        slot.index, pid, describe(status), lived, delay)

    def _restart_due(self) -> float:
        """Fork the workers whose back-off is over; seconds until the next one is."""
        now = time.monotonic()
        waits = [3600.0]
        for slot in self.slots:
            if self.stopping or slot.restart_at is None:
                continue
            if slot.restart_at <= now:
                self._fork(slot)
            else:
                waits.append(slot.restart_at - now)
        return min(waits)

    def _forward(self, signum: int) -> None:
        if not self.stopping and self.on_stop is not None:
            self.on_stop()
        self.stopping = True
        for slot in self.slots:
            slot.restart_at = None
            if slot.pid:
                try:
                    os.kill(slot.pid, signum)
                except ProcessLookupError:
                    pass
