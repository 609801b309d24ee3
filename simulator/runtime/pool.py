"""A warm pool: the Ray instance and the actors of finished runs, kept in this process for
the next runs (``warm_pool``). A run pays Ray's start once per pool, and an actor's start (a
process that imports torch and fedray, about 2.4 s of CPU here) once per pool and kind of
actor: a run takes an idle actor whose Ray options are its own (the same role, CPUs, GPUs,
runtime environment) and has it rebuild itself for the run (``Reusable.rebuild``: the
constructor again, on the new run's Plan and data), so that everything a run computes is
made for it, and its numbers equal a cold run's to the bit. An idle actor that died (a
process killed, a node lost) is dropped when a run asks for one, and a new one started. A
data set's client source goes into the object store once for the runs on the same data.

Idle actors keep their Ray resources (a ClientWorker its CPU): a new actor that needs
resources has the idle ones of other options that hold some ended first, and a sweep's or a
search's Ray tasks have every idle actor ended before they start (``WarmPool.evict``).

The pool is used by every run in this process while it is open (``fedray run``'s
``run_loaded``, ``run_sweep``, ``resume_run``, ``run_tune``), through
``simulator.runtime.backend.RayBackend``. The ``fedray up`` daemon keeps one open.
Ray is not imported here.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from simulator.errors import UsageError

LOG = logging.getLogger("fedray.engine")

TAKE_TIMEOUT = 10.0  # seconds an idle actor may take to answer before it counts as dead
DATA_KEPT = 2  # data sets whose client source the pool keeps in the object store

# (the actor's class, its role, its Ray options as text, whether it holds Ray resources)
ActorKey = tuple[type, str, str, bool]


class Reusable:
    """An actor a warm pool may keep between runs: ``rebuild`` makes it anew for another run
    exactly as its constructor would (its process, with torch and fedray imported, is what
    the pool keeps), and ``forget`` drops what it holds of a finished run (its model, its
    clients' state, its object references) while it waits. A constructor sets everything a
    run's numbers depend on in its process (threads, deterministic algorithms, the kernels);
    randomness is never taken from global state (DESIGN: Plugins are pure)."""

    def rebuild(self, *args: Any) -> None:
        self.__dict__.clear()
        type(self).__init__(self, *args)

    def forget(self) -> None:
        self.__dict__.clear()


class WarmPool:
    """Ray (a local instance the first Ray run starts, or the cluster at ``address``) and
    the idle actors of finished runs, by (class, role, options). Thread-safe."""

    def __init__(self, address: str | None = None, **ray_init: Any) -> None:
        self.address, self.ray_init = address, ray_init
        self.fixed = False  # the instance is a local one the pool started (RayBackend.fixed)
        self._stop: Callable[[], None] | None = None  # ends the Ray instance it started
        self._idle: dict[ActorKey, list[Any]] = {}
        self._data: list[tuple[Any, Any]] = []  # (a data set's client source, its Ray ref)
        self._lock = threading.Lock()
        self.reused = 0  # actors given to a run again (for the tests and the debug lines)

    def check_address(self, address: str | None) -> None:
        """A run's ``--address`` must be the pool's: one Ray connection per process."""
        if address is not None and address != self.address:
            where = f"the cluster at {self.address}" if self.address else "a local Ray instance"
            raise UsageError(f"--address {address}: this process's warm pool runs on {where}; "
                             "close the pool (or `fedray down`) to run elsewhere")

    def started(self, fixed: bool, stop: Callable[[], None]) -> None:
        """The pool's first Ray run started (or joined) Ray: ``stop`` ends it when the pool
        closes; ``fixed``: a local instance, whose resources cannot grow."""
        self.fixed, self._stop = fixed, stop

    def idle(self, role: str | None = None) -> int:
        """How many idle actors (of ``role``) the pool holds."""
        with self._lock:
            return sum(len(v) for k, v in self._idle.items() if role in (None, k[1]))

    def take(self, key: ActorKey, alive: Callable[[Any, float], bool]) -> Any | None:
        """An idle actor of ``key`` that answers (``alive(handle, timeout)``), or None: a new
        one starts, and where it needs resources (CPUs, GPUs) the idle actors of other
        options that hold some end first."""
        while True:
            with self._lock:
                handles = self._idle.get(key)
                handle = handles.pop() if handles else None
                if handle is None:
                    others = [k for k in self._idle if key[3] and k[3] and k != key]
                    ended = [h for k in others for h in self._idle.pop(k)]
            if handle is None:
                self._end(ended)
                return None
            if alive(handle, TAKE_TIMEOUT):
                self.reused += 1
                return handle
            LOG.warning("fedray: an idle %s of the warm pool is gone (a process killed, a node "
                        "lost): a new one starts", key[0].__name__)

    def give(self, key: ActorKey, handle: Any) -> None:
        """A run is done with ``handle``: it waits in the pool for the next run."""
        with self._lock:
            self._idle.setdefault(key, []).append(handle)

    def shared(self, value: Any, put: Callable[[Any], Any]) -> Any:
        """The object store's reference of ``value`` (a data set's client source), put
        once for the runs on the same data: the engine's data cache gives them the same
        object (``simulator.sim.engine.load_data``). The last DATA_KEPT are kept."""
        with self._lock:
            for obj, ref in self._data:
                if obj is value:
                    return ref
        ref = put(value)
        with self._lock:
            self._data = [(value, ref), *self._data[:DATA_KEPT - 1]]
        return ref

    def evict(self) -> None:
        """End every idle actor (a sweep's or a search's tasks need their resources) and
        drop the data the pool kept in the object store."""
        with self._lock:
            ended = [h for v in self._idle.values() for h in v]
            self._idle.clear()
            self._data = []
        self._end(ended)

    def close(self) -> None:
        """End the idle actors, then the Ray instance the pool started (not one it joined
        or found running)."""
        self.evict()
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    @staticmethod
    def _end(handles: list[Any]) -> None:
        if not handles:
            return
        import sys

        ray = sys.modules["ray"]  # the handles are Ray's: it is imported
        for h in handles:
            with contextlib.suppress(Exception):  # already dead is fine
                ray.kill(h)


_current: WarmPool | None = None


def current_pool() -> WarmPool | None:
    """The warm pool open in this process, or None."""
    return _current


@contextlib.contextmanager
def warm_pool(address: str | None = None, **ray_init: Any) -> Iterator[WarmPool]:
    """Keep Ray and the actors of finished runs for the next runs in this process while the
    block runs; at its end the idle actors and the Ray instance the pool started end.
    ``address``: a Ray cluster to join (``--address``), else a local instance; ``ray_init``:
    more ``ray.init`` arguments. Inside an open pool, another ``warm_pool`` is that pool.

        with warm_pool():
            for path in scenarios:
                run_loaded(load(path))  # the second run on Ray starts no process
    """
    global _current
    if _current is not None:
        _current.check_address(address)
        yield _current
        return
    pool = _current = WarmPool(address, **ray_init)
    try:
        yield pool
    finally:
        _current = None
        pool.close()
