"""Bounded work queues of the explorer (private).

A :class:`Lane` runs the computing part of requests on its own worker threads:
at most ``workers`` at once and ``waiting`` more in line; a request beyond that
is refused at once with :class:`Busy` (the app answers 503 with
``Retry-After``). Requests that compute nothing (the page, static files,
``/api/examples``) never enter a lane, so they never wait behind heavy ones,
and the threads that run heavy work are bounded.

Work is abandoned when its client goes away: a request still in line leaves
it; a running one has its flag set, and ``check()`` (which the work calls
between tile steps or phases) raises :class:`Cancelled`.

When every lane of a :class:`Lanes` group has been idle for ``idle_s``
seconds, the memory the work left behind is given back: the native step's
scratch pool is emptied and, on glibc, ``malloc_trim(0)`` returns the freed
heap pages to the system.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import math
import os
import platform
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from flashledger import _native

from . import _guard
from ._guard import ASGIApp, Receive, Scope, Send

__all__ = [
    "Admission",
    "Busy",
    "Cancelled",
    "Lane",
    "LaneStats",
    "Lanes",
    "cores",
    "release_memory",
]

T = TypeVar("T")
Check = Callable[[], None]

SECONDS_PER_REQUEST = 1.0
"""What one request costs at most (the per-request work limit), for ``Retry-After``."""


class Busy(Exception):
    """The lane is full; ``retry_after`` is a fair wait in whole seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Cancelled(Exception):
    """The client went away; the work stopped at a check."""


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@dataclass
class LaneStats:
    """What a lane did so far (for tests and diagnostics)."""

    done: int = 0
    """Work that ran to its end (or raised)."""
    refused: int = 0
    """Requests answered 503 because the lane was full."""
    dropped: int = 0
    """Requests whose client went away while they waited: never run."""
    cancelled: int = 0
    """Running work stopped at a check because its client went away."""


class Lane:
    """``workers`` threads and ``waiting`` places in line for one kind of work."""

    def __init__(
        self,
        name: str,
        *,
        workers: int,
        waiting: int,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        if workers < 1 or waiting < 0:
            raise ValueError(
                f"a lane needs workers >= 1 and waiting >= 0, got {workers}, {waiting}"
            )
        self.name = name
        self.workers = workers
        self.waiting = waiting
        self.stats = LaneStats()
        self._on_idle = on_idle
        self._lock = threading.Lock()
        self._admitted = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"explorer-{name}")
        self._flags: set[threading.Event] = set()

    @property
    def admitted(self) -> int:
        """Requests running or waiting now."""
        return self._admitted

    def full(self) -> bool:
        """True when a request would be refused now."""
        return self._admitted >= self.workers + self.waiting

    def busy(self) -> Busy:
        """The refusal: how many are ahead, and a fair wait."""
        ahead = self._admitted
        retry = max(1, math.ceil(ahead / self.workers * SECONDS_PER_REQUEST))
        return Busy(
            f"the explorer is busy: {ahead} requests are running or waiting "
            f"(at most {self.workers} run at once and {self.waiting} wait); "
            f"try again in {retry} s",
            retry,
        )

    def _admit(self) -> None:
        with self._lock:
            if self.full():
                self.stats.refused += 1
                raise self.busy()
            self._admitted += 1

    def _leave(self, future: Future[Any], flag: threading.Event) -> None:
        with self._lock:
            self._flags.discard(flag)
            if future.cancelled():
                self.stats.dropped += 1
            elif isinstance(future.exception(), Cancelled):
                self.stats.cancelled += 1
            else:
                self.stats.done += 1
            self._admitted -= 1
            idle = self._admitted == 0
        if idle and self._on_idle is not None:
            self._on_idle()

    async def run(self, work: Callable[[Check], T], receive: Receive) -> T | None:
        """Run ``work(check)`` on a worker thread; ``None`` if the client went away first.

        Raises :class:`Busy` when the lane is full, and whatever ``work`` raised.
        ``receive`` is the request's ASGI receive, its body already read: its next
        message is ``http.disconnect``.
        """
        self._admit()
        flag = threading.Event()

        def check() -> None:
            if flag.is_set():
                raise Cancelled

        try:
            future = self._pool.submit(work, check)
        except BaseException:
            with self._lock:
                self._admitted -= 1
            raise
        with self._lock:
            self._flags.add(flag)
        future.add_done_callback(lambda f: self._leave(f, flag))
        result: asyncio.Future[T] = asyncio.wrap_future(future)
        gone: asyncio.Future[None] = asyncio.ensure_future(_disconnected(receive))
        try:
            either: list[asyncio.Future[Any]] = [result, gone]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the server is stopping
            flag.set()
            future.cancel()
            raise
        finally:
            gone.cancel()
        went_away = gone.done() and not gone.cancelled() and gone.exception() is None
        if not result.done() and went_away:  # leave the line, or stop at the next check
            flag.set()
            future.cancel()
            result.add_done_callback(_consume)
            return None
        return await result

    def stop_all(self) -> None:
        """Ask every running work to stop (the server is stopping); the lane stays usable."""
        with self._lock:
            for flag in self._flags:
                flag.set()


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned future's outcome, so that asyncio does not log it."""
    if not fut.cancelled():
        fut.exception()


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone away."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Admission:
    """ASGI middleware: a POST to a lane's path is refused at once (503, ``Retry-After``)
    while that lane is full, before its body is read, parsed or validated: a burst
    of requests costs the event loop next to nothing."""

    def __init__(self, app: ASGIApp, routes: dict[str, Lane]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            lane = self.routes.get(scope["path"])
            if lane is not None and lane.full():
                with lane._lock:
                    lane.stats.refused += 1
                refusal = lane.busy()
                headers = [("retry-after", str(refusal.retry_after)), ("connection", "close")]
                limits = {"retry_after": refusal.retry_after}
                await _guard.send_error(send, 503, str(refusal), "busy", limits, headers)
                return
        await self.app(scope, receive, send)


class Lanes:
    """The explorer's lanes; memory is given back once all of them have been idle a while."""

    def __init__(self, *, workers: int, waiting: int, idle_s: float = 1.0) -> None:
        self.idle_s = idle_s
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self.releases = 0
        """Times memory was given back."""
        self.heavy = Lane("heavy", workers=workers, waiting=waiting, on_idle=self._idle)
        """Traced runs, the conventions table, measurements, the ring."""
        self.light = Lane("light", workers=1, waiting=waiting, on_idle=self._idle)
        """The one-row ledger and the closed-form storage ledger."""

    def all(self) -> tuple[Lane, ...]:
        return (self.heavy, self.light)

    def idle(self) -> bool:
        return all(lane.admitted == 0 for lane in self.all())

    def _idle(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.idle_s, self._release_if_idle)
            self._timer.daemon = True
            self._timer.start()

    def _release_if_idle(self) -> None:
        if self.idle():
            release_memory()
            self.releases += 1

    def stop_all(self) -> None:
        """Ask all running work to stop (the server is stopping)."""
        for lane in self.all():
            lane.stop_all()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None on other C libraries."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def release_memory() -> int:
    """Give back what finished work left: the native step's scratch, and free heap pages
    (glibc's ``malloc_trim``). Returns the scratch bytes let go."""
    freed = _native.release_scratch()
    if _TRIM is not None:
        _TRIM(0)
    return freed
