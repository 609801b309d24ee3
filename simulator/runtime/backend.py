"""Backends host the actor classes: ``ray`` (actors on a Ray cluster, objects in the object
store) or ``inline`` (the same classes in this process). The engine speaks only this
interface, through the typed handles of ``simulator.runtime.handles``, so both run the same
round loop. A call names its method by the method itself (``ClientWorker.train``): its name
is read here, the only place that turns it into an actor call."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast, overload

from simulator.errors import FedrayError, UsageError, WorkerLost
from simulator.messages import Ref
from simulator.runtime.pool import ActorKey, current_pool

R = TypeVar("R")

ROLE_OPTIONS: dict[str, dict[str, Any]] = {
    # A worker takes a CPU and is spread over nodes. Ray does not restart a dead one: a
    # restart would wait, silently and forever, for a CPU that the surviving nodes may not
    # have, and its constructor's object refs are not kept for restarts. The engine moves the
    # lost worker's clients to live workers instead and recomputes the round (a client's
    # computation is a pure function of seed, round and client).
    "worker": {"num_cpus": 1, "scheduling_strategy": "SPREAD", "max_restarts": 0,
               "max_task_retries": 0},
    "server": {"num_cpus": 0},
    "adversary": {"num_cpus": 0},
}


class ClusterUnreachable(UsageError):
    """``--address`` names a Ray cluster this process cannot join (its head answers, but Ray
    cannot join it: its token, its version): an address to fix, exit 2."""


PLACE_TIMEOUT = 120.0  # seconds a new worker may wait for a CPU before the run stops
PING_TIMEOUT = 600.0  # seconds a live worker may take to finish its calls and answer


class Backend(Protocol):
    name: str
    # calls run in the background (a ref comes back at once): the engine may submit the
    # next round's training before it reads this round's results
    pipelined: bool
    # its resources cannot grow (a local Ray instance this process started): workers that do
    # not fit are refused at once rather than waited for (a cluster may gain nodes)
    fixed: bool
    # why the run uses it (BackendChoice.reason; "" where nothing chose it), logged with it
    reason: str

    def spawn(self, cls: type, *args: Any, role: str,
              options: dict[str, Any] | None = None) -> Any: ...
    def ready(self, handles: list[Any], timeout: float) -> list[bool]: ...
    def call(self, handle: Any, method: Callable[..., R], *args: Any) -> Ref[R]: ...
    @overload
    def get(self, ref: Ref[R]) -> R: ...
    @overload
    def get(self, ref: list[Ref[R]]) -> list[R]: ...
    def put(self, value: R) -> Ref[R]: ...
    # an object later runs may share (a data set's client source): a warm pool keeps its
    # reference for the next run on the same data
    def put_data(self, value: R) -> Ref[R]: ...
    def default_workers(self) -> int: ...
    def gpus(self) -> float: ...
    def num_nodes(self) -> int: ...
    # the run is done with these actors: ended, or kept for the next run by a warm pool
    def release(self, handles: list[Any]) -> None: ...
    def shutdown(self) -> None: ...


class InlineBackend:
    """Everything in this process; calls run at once and "references" are the values."""

    name = "inline"
    pipelined = False  # a call runs when it is made
    fixed = False  # no resources to run out of

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def spawn(self, cls: type, *args: Any, role: str,
              options: dict[str, Any] | None = None) -> Any:
        return cls(*args)

    def ready(self, handles: list[Any], timeout: float) -> list[bool]:
        return [True] * len(handles)

    def call(self, handle: Any, method: Callable[..., R], *args: Any) -> Ref[R]:
        return cast(Ref[R], getattr(handle, method.__name__)(*args))

    def get(self, ref: Any) -> Any:
        return ref

    def put(self, value: R) -> Ref[R]:
        return cast(Ref[R], value)

    def put_data(self, value: R) -> Ref[R]:
        return cast(Ref[R], value)

    def default_workers(self) -> int:
        return 1

    def gpus(self) -> float:
        import torch

        return float(torch.cuda.device_count())

    def num_nodes(self) -> int:
        return 1

    def release(self, handles: list[Any]) -> None:
        return None

    def shutdown(self) -> None:
        return None


class RayBackend:
    """Actors on Ray: a local instance started here, or an existing cluster by address; in
    a warm pool (``simulator.runtime.pool``) the pool's, whose idle actors a run reuses."""

    name = "ray"
    pipelined = True

    def __init__(self, address: str | None = None, reason: str = "", **init_kwargs: Any) -> None:
        ray = import_ray()
        self.ray = ray
        self.reason = reason
        self._owns = False
        self.fixed = False
        self.pool = current_pool()
        if self.pool is not None:
            self.pool.check_address(address)
            if not ray.is_initialized():
                fixed = _start_ray(ray, self.pool.address, {**self.pool.ray_init, **init_kwargs})
                self.pool.started(fixed, lambda: _stop_ray(ray, fixed))
            self.fixed = self.pool.fixed
        elif not ray.is_initialized():
            self.fixed = _start_ray(ray, address, init_kwargs)
            self._owns = True
        self._classes: dict[tuple[Any, ...], Any] = {}
        # the actors this backend spawned, by id: their pool key (released to the pool)
        self._spawned: dict[int, tuple[ActorKey, Any]] = {}
        self._rebuilt: dict[int, Any] = {}  # reused actors: the ref of their rebuild call

    def spawn(self, cls: type, *args: Any, role: str,
              options: dict[str, Any] | None = None) -> Any:
        """An actor of ``cls`` with its role's options, ``options`` (resources: num_cpus,
        num_gpus) over them; in a warm pool, an idle one of the same options rebuilt for
        this run (``Reusable.rebuild``) where the pool has one."""
        extra = dict(options or {})
        holds = any(float({**ROLE_OPTIONS[role], **extra}.get(r) or 0) > 0
                    for r in ("num_cpus", "num_gpus"))
        # options as text: a runtime_env is a dict
        key: ActorKey = (cls, role, repr(sorted(extra.items())), holds)
        handle = self.pool.take(key, self._answers) if self.pool is not None else None
        if handle is not None:
            # an actor runs one caller's calls in order: the run's calls follow the rebuild
            self._rebuilt[id(handle)] = handle.rebuild.remote(*args)
        else:
            handle = self._actor_class(key, extra).remote(*args)
        self._spawned[id(handle)] = (key, handle)
        return handle

    def _actor_class(self, key: ActorKey, extra: dict[str, Any]) -> Any:
        cls, role = key[:2]
        if key not in self._classes:
            options = {**ROLE_OPTIONS[role], **extra}
            if role != "worker":
                # The server, mixer and adversary hold the run's state and are not restarted:
                # they live on the driver's node, which the run cannot outlive anyway, never
                # on a worker node that may be lost (hard affinity: soft affinity is ignored
                # for actors that take no CPU).
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                node = self.ray.get_runtime_context().get_node_id()
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
            self._classes[key] = self.ray.remote(cls).options(**options)
        return self._classes[key]

    def _answers(self, handle: Any, timeout: float) -> bool:
        """Whether an idle actor answers a ping within ``timeout`` seconds (else it is
        killed)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            self.ray.get(handle.__ray_ready__.remote(), timeout=timeout)
            return True
        except (RayActorError, GetTimeoutError):
            self._kill([handle])
            return False

    def call(self, handle: Any, method: Callable[..., R], *args: Any) -> Ref[R]:
        return cast(Ref[R], getattr(handle, method.__name__).remote(*args))

    def get(self, ref: Any) -> Any:
        """``ray.get``; a result lost with a dead actor (or its node) raises WorkerLost.
        Reused actors' rebuilds not yet waited for (``ready`` waits for the workers') are
        first: an error of a constructor is raised before any result of the actor's."""
        from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

        if self._rebuilt:
            pending = list(self._rebuilt.values())
            self._rebuilt.clear()
            self.get(pending)
        try:
            return self.ray.get(ref)
        except RayTaskError as e:
            if isinstance(e.cause, FedrayError):  # ours, raised in an actor: its one line
                raise e.cause from None
            if not isinstance(e, (RayActorError, ObjectLostError)):
                raise
            raise WorkerLost(_ray_kind(e)) from None
        except (RayActorError, ObjectLostError) as e:
            raise WorkerLost(_ray_kind(e)) from None

    def ready(self, handles: list[Any], timeout: float) -> list[bool]:
        """Which actors answer a ping within ``timeout`` seconds (a busy actor answers once
        its queued calls are done; a dead one, or one still waiting for resources, does not).
        Actors that do not answer are killed, so that they cannot come back later. A reused
        actor's ping is its rebuild: an error of its constructor is raised as a new actor's
        would be at its first call."""
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        refs = [self._rebuilt.pop(id(h), None) or h.__ray_ready__.remote() for h in handles]
        self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        out = []
        for h, ref in zip(handles, refs):
            try:
                self.ray.get(ref, timeout=0)
                out.append(True)
            except (RayActorError, GetTimeoutError):
                self._kill([h])
                out.append(False)
            except RayTaskError as e:  # a rebuild that raised
                if isinstance(e.cause, FedrayError):
                    raise e.cause from None
                raise
        return out

    def put(self, value: R) -> Ref[R]:
        return cast(Ref[R], self.ray.put(value))

    def put_data(self, value: R) -> Ref[R]:
        if self.pool is None:
            return self.put(value)
        return cast(Ref[R], self.pool.shared(value, self.ray.put))

    def default_workers(self) -> int:
        return max(1, int(self.ray.cluster_resources().get("CPU", 1)))

    def gpus(self) -> float:
        return float(self.ray.cluster_resources().get("GPU", 0))

    def num_nodes(self) -> int:
        return sum(1 for n in self.ray.nodes() if n.get("Alive"))

    def release(self, handles: list[Any]) -> None:
        """The run is done with ``handles``: into the warm pool, emptied (``forget``), where
        one is open, else killed. Actors found dead are not kept."""
        if self.pool is None:
            self._kill(handles)
            return
        for h in handles:
            spawned = self._spawned.pop(id(h), None)
            if spawned is not None:
                self._rebuilt.pop(id(h), None)
                h.forget.remote()
                self.pool.give(spawned[0], h)

    def _kill(self, handles: list[Any]) -> None:
        for h in handles:
            self._spawned.pop(id(h), None)
            self._rebuilt.pop(id(h), None)
            with contextlib.suppress(Exception):  # already dead is fine
                self.ray.kill(h)

    def evict_idle(self) -> None:
        """End the warm pool's idle actors (a sweep's or a search's tasks need their CPUs)."""
        if self.pool is not None:
            self.pool.evict()

    def shutdown(self) -> None:
        """End the Ray instance this backend started (a warm pool's ends with the pool)."""
        if self._owns and self.ray.is_initialized():
            _stop_ray(self.ray, self.fixed)


def _start_ray(ray: Any, address: str | None, init_kwargs: dict[str, Any]) -> bool:
    """``ray.init`` of a new local instance (``address`` None: True, its resources cannot
    grow) or of the cluster at ``address`` (False)."""
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    kwargs.update(init_kwargs)
    if address is None:
        refuse_local_instance_in_job()
        # A fresh local instance. Never join a cluster from the environment: a bare
        # ray.init() also joins the one `ray start` recorded on this machine (and
        # hangs when its head is dead); "local" always starts a new instance.
        os.environ.pop("RAY_ADDRESS", None)
        _quiet_default_auth_notice()
        ray.init(address="local", **kwargs)
        return True
    kwargs.pop("include_dashboard", None)
    try:
        _check_listening(address)
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        raise ClusterUnreachable(
            f"--address {address}: cannot connect to the Ray cluster ({e}); check "
            "that it runs (`ray status`), and if it keeps Ray's token authentication "
            "run with RAY_AUTH_MODE=token and its token in ~/.ray/auth_token "
            "(docs/cluster.md)") from None
    return False


def _stop_ray(ray: Any, local: bool) -> None:
    if ray.is_initialized():
        if local:  # a local instance, whose processes are this process's children
            stop_autoscaler_monitor()
        ray.shutdown()


MONITOR = b"autoscaler/_private/monitor.py"  # the command line of Ray's autoscaler monitor


def stop_autoscaler_monitor() -> None:
    """End the autoscaler monitor of the local Ray instance this process started, before
    ``ray.shutdown``: the shutdown sends each of the instance's processes SIGTERM and waits up
    to a second for it, and the monitor (which holds nothing of a run: the autoscaler's
    bookkeeping and its log) takes all of that second; its whole shutdown took 1.2-1.7 s here,
    0.4-0.7 s with the monitor ended first (SIGKILL). The monitor is found among this
    process's children by its command line (Linux's /proc; elsewhere nothing is done)."""
    me = os.getpid()
    try:
        children = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    except OSError:
        return
    for pid in children:
        with contextlib.suppress(OSError, ValueError):
            if MONITOR in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)


CONNECT_TIMEOUT = 10.0  # seconds to open a TCP connection to a cluster's head


ADDRESS_TIMEOUT = 2.0  # seconds the command line waits for a head to accept a connection


def _host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT``) of an ``--address``, else a UsageError."""
    host, sep, port = address.rpartition(":")
    host = host.strip("[]")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise UsageError(f"--address {address}: expected HOST:PORT (the head's port, 6379 "
                         "unless `ray start --port` said otherwise), auto, or ray://HOST:PORT")
    return host, int(port)


def check_address(address: str) -> None:
    """``--address`` as the user gave it, checked before anything is created (a tracking
    store, a run): its form, then a TCP connection to ``HOST:PORT`` (also of a
    ``ray://HOST:PORT``), within ADDRESS_TIMEOUT seconds; nothing that answers is a UsageError
    naming the address given. ``auto`` and ``local`` are left to Ray."""
    if address in ("auto", "local"):
        return
    host, port = _host_port(address.removeprefix("ray://"))
    import socket

    try:
        socket.create_connection((host, port), timeout=ADDRESS_TIMEOUT).close()
    except OSError as e:  # refused, unreachable, a name that does not resolve, the timeout
        why = e.strerror or f"no answer within {ADDRESS_TIMEOUT:g} s"
        raise UsageError(f"--address {address}: nothing answers there ({why}); start the "
                         "cluster (`ray start --head`), or give the address `ray start` "
                         "printed (`ray status` on the head shows whether it runs)") from None


def _check_listening(address: str) -> None:
    """Raise ConnectionError unless something accepts connections at a ``host:port`` address,
    where ``ray.init`` would connect. Against a head that is not there, ``ray.init`` retries
    for about 15 minutes (20 attempts of ~45 s in Ray 2.60), then raises a RuntimeError.
    For ``localhost``, ``127.0.0.1`` and ``::1`` Ray connects to this node's address
    (``ray.util.get_node_ip_address``) instead, and so does this check. ``auto``, ``local``
    and ``ray://`` addresses are left to Ray; any other form is a UsageError (Ray raised a
    ValueError with its traceback)."""
    if address in ("auto", "local") or address.startswith("ray://"):
        return
    host, port_number = _host_port(address)
    port = str(port_number)
    import socket

    ray = import_ray()
    if host in ("localhost", "127.0.0.1", "::1"):
        ip = ray.util.get_node_ip_address()
    else:
        try:
            ip = str(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][4][0])
        except OSError as e:
            raise ConnectionError(f"{host}: {e.strerror or e}") from None
    try:
        socket.create_connection((ip, int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {ip}:{port}: "
                              f"{e.strerror or type(e).__name__}") from None


# Ray's "Raylet is terminated ... Last 20 lines of the Raylet logs:" block: both agents of a
# node whose raylet died (the dashboard agent and the runtime-env agent) publish it to every
# driver, which prints it on stdout, about 20 lines each, quoting whatever raylet.out sits in
# that node's log folder (on one machine, the head's). The driver's error listener prints it
# through Ray's log deduplicator, whose skip pattern is this driver option. The run says what
# the loss meant in its own line ("ClientWorker(s) [i] lost ... its node died"); Ray's
# "node ... has been marked dead" message (3 lines, once) and every other error stay.
RAYLET_DIED_BLOCK = r"^Raylet is terminated\."


def import_ray() -> Any:
    """``import ray``, with Ray's raylet-death block (RAYLET_DIED_BLOCK) left out of what the
    driver prints. Ray reads RAY_DEDUP_LOGS_SKIP_REGEX when it is imported (a pattern the user
    set is kept beside ours); fedray imports Ray only through here. Under RAY_DEDUP_LOGS=0
    Ray applies no skip pattern at all, and prints the block."""
    if "ray" not in sys.modules:
        own = os.environ.get("RAY_DEDUP_LOGS_SKIP_REGEX")
        if not own:
            os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = RAYLET_DIED_BLOCK
        elif RAYLET_DIED_BLOCK not in own:
            os.environ["RAY_DEDUP_LOGS_SKIP_REGEX"] = f"(?:{own})|{RAYLET_DIED_BLOCK}"
    import ray

    return ray


class _DefaultAuthNotice(logging.Filter):
    """Drops Ray's WARNING that a new local instance has token authentication on, its
    default, printed on every run (the warning that it is off stays)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled")


def _quiet_default_auth_notice() -> None:
    """Ray reads RAY_AUTH_MODE when it is imported: setting it here is too late (the driver
    then talks to its own instance without the token), so the notice is filtered instead."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _DefaultAuthNotice) for f in log.filters):
        log.addFilter(_DefaultAuthNotice())


def refuse_local_instance_in_job() -> None:
    """A command run as a Ray job (`ray job submit`: RAY_JOB_CONFIG_JSON_ENV_VAR is set)
    without --address would start a new local Ray instance that inherits the job's runtime
    environment, whose --working-dir package only the job's cluster holds: every actor then
    failed with RuntimeEnvSetupError and its traceback. Refused in one line."""
    if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        raise UsageError("--address: this runs as a Ray job (ray job submit); pass --address "
                         "auto to run on the job's cluster, or --backend inline")


# a Ray session's folder: session_<date>_<time>_<microseconds>_<pid>
_RAY_SESSION = re.compile(r"session_\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}_\d+_\d+")


def ray_temporary_folder(path: Path) -> Path | None:
    """The folder of Ray's temporary files that ``path`` (absolute) lies in, or None: a Ray
    session's folder anywhere (``ray start --temp-dir`` chooses where; a ``ray job submit
    --working-dir`` job runs in its ``runtime_resources/working_dir_files/_ray_pkg_*``), or
    Ray's default temporary folder (``$RAY_TMPDIR/ray``, else ``$TMPDIR/ray``, else
    ``/tmp/ray``, as Ray chooses it). Ray removes what is there: with the job's package, on
    ``ray stop``, at a reboot. Ray is not imported."""
    for i, part in enumerate(path.parts):
        if _RAY_SESSION.fullmatch(part) or part == "runtime_resources":
            return Path(*path.parts[:i + 1])
    system = os.environ.get("RAY_TMPDIR") or (os.environ.get("TMPDIR")
                                              if sys.platform.startswith("linux") else None)
    root = Path(system or "/tmp") / "ray"
    return root if path.is_relative_to(root) else None


def gpu_share(asked: float | None, on_gpu: bool, gpus: float, n: int) -> float:
    """The GPUs one of ``n`` actors or tasks takes: ``asked`` (``runtime.num_gpus``) when
    given, else none off the GPU, else ``gpus`` shared out among the ``n``, at most one."""
    if asked is not None:
        return asked
    return min(1.0, gpus / n) if on_gpu else 0.0


def _ray_kind(e: BaseException) -> str:
    """The Ray error's own type name (a RayTaskError subclass carries its cause's type), and
    ", its node died" where Ray says the actor died with its node (a raylet killed, a machine
    gone): the run's one line about a node loss, Ray's own 20-line block being left out."""
    kinds = [c.__name__ for c in type(e).__mro__ if c.__module__ == "ray.exceptions"
             and not c.__name__.startswith("RayTaskError")]
    kind = kinds[0] if kinds else type(e).__name__
    return kind + (", its node died" if "because its node has died" in str(e) else "")


# ``runtime.backend: auto`` (choose_backend). Ray's fixed cost for a run on a new local
# instance and its cost a round beyond its share of the training, measured on this
# project's 2-core machine (``python benchmarks/backend_choice.py``, medians of 3, load
# average about 2; docs/performance.md "The backend a run chooses"): ``ray.init`` of a new
# local instance 4.6 s (3.4-5.6; 4.5 s idle in RUNTIME-NOTES); two ClientWorkers and the
# server, each process importing torch and fedray, answer 3.6 s (2.5-4.1) after they are
# spawned, about 2.4 s of CPU each on 2 cores; 30 quickstart rounds take 1.73 s on Ray with
# 2 workers against 1.01 s inline (41 ms a round beyond half the inline round), 120 rounds
# of benchmarks/vs_flower.py's heavy workload about 105 ms a round against 153 ms (28 ms
# beyond half): the model put in the object store, the actor calls, their results fetched.
RAY_INIT_SECONDS = 4.5
RAY_ACTOR_SECONDS = 2.4  # of CPU; the actors start in parallel on the machine's cores
RAY_ROUND_SECONDS = 0.03


class WorkEstimate(Protocol):
    """A run's rounds in one process, estimated (``simulator.sim.work.estimate_work``)."""

    @property
    def rounds(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    def text(self) -> str: ...


@dataclass(frozen=True)
class BackendChoice:
    """The backend a run uses (``ray`` or ``inline``) and why, in one clause: shown by
    ``fedray show``, logged with each run (the params ``backend`` and ``backend.reason``)
    and at debug level."""

    name: str
    reason: str


def ray_needed(runtimes: list[Any], address: str | None, workers: int | None) -> str | None:
    """Why a run needs Ray whatever its work, or None: a cluster (``address``), more than
    one ClientWorker asked for (``workers``, ``runtime.workers``: one process trains them one
    after another), GPU shares (``runtime.num_gpus``) or a device other than the CPU where
    this machine has a GPU (Ray shares it out among the workers). ``runtimes``: each run
    point's ``runtime`` block."""
    if address is not None:
        return f"--address {address}: a Ray cluster"
    if workers is not None and workers > 1:
        return f"--workers {workers}: more ClientWorkers than one process trains at once"
    for rt in runtimes:
        if workers is None and rt.workers is not None and rt.workers > 1:
            return f"runtime.workers {rt.workers}: more ClientWorkers than one process " \
                "trains at once"
        if rt.num_gpus is not None and rt.num_gpus > 0:
            return f"runtime.num_gpus {rt.num_gpus:g}: GPU shares"
    if any("cuda" in (rt.device, rt.server_device) or "auto" in (rt.device, rt.server_device)
           for rt in runtimes) and _local_gpus() > 0:
        return f"a device other than cpu asked, and this machine has {_local_gpus()} GPU(s)"
    return None


def _local_gpus() -> int:
    import torch

    return int(torch.cuda.device_count())


def ray_running() -> bool:
    """Whether this process is connected to a Ray instance already (a session that started
    one, a test's shared instance): a run there pays no ``ray.init``. Ray is not imported."""
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def cpus_per_worker(runtimes: list[Any]) -> float:
    """The CPUs one ClientWorker (or a sweep's task) of these runs takes: the most of each
    point's ``runtime.num_cpus`` and ``threads``."""
    return float(max(max(rt.num_cpus, rt.threads) for rt in runtimes)) if runtimes else 1.0


def choose_backend(asked: str, runtimes: list[Any], address: str | None = None,
                   workers: int | None = None, cpus: float | None = None,
                   estimate: Callable[[], WorkEstimate] | None = None,
                   round_seconds: float = RAY_ROUND_SECONDS) -> BackendChoice:
    """The backend of a run: ``asked`` (``--backend``, else ``runtime.backend``) when it is
    ``ray`` or ``inline``; for ``auto``, Ray where the run needs it (``ray_needed``), else
    the one estimated to finish its rounds first. Inline, the rounds take the estimated work
    ``W`` (``estimate()``, called only then). On Ray, ``P`` ClientWorkers (this machine's
    ``cpus`` over each worker's ``runtime.num_cpus`` and ``threads``) share it, after Ray's
    start ``S`` (RAY_INIT_SECONDS, none where this process is connected to Ray already, and
    RAY_ACTOR_SECONDS for each of the ``P + 1`` actors, the server's included, spread over
    the cores), and each round costs ``round_seconds`` more (RAY_ROUND_SECONDS; a sweep's
    tasks, whose rounds run in one process each, none): ``S + W / P + rounds x
    round_seconds``. Inline where that is no shorter than ``W``; with one worker (a
    machine of one CPU), always inline. Without ``estimate`` where one is needed, the
    choice is ``auto`` (not made: ``fedray show`` fetches no data). In a warm pool
    (``simulator.runtime.pool``) ``S`` counts only the actors it has no idle one for (of the
    same role: an estimate, the options are the Plan's)."""
    if asked in ("ray", "inline"):
        if asked == "inline" and address:
            raise UsageError("--address: only with --backend ray or auto")
        return BackendChoice(asked, f"runtime.backend {asked}, as asked")
    if asked != "auto":
        raise UsageError(f"runtime.backend: must be one of 'auto', 'ray' or 'inline', got "
                         f"{asked!r}")
    need = ray_needed(runtimes, address, workers)
    if need is not None:
        return BackendChoice("ray", f"auto: {need}")
    if workers == 1 or (workers is None and any(rt.workers == 1 for rt in runtimes)):
        where = "--workers" if workers == 1 else "runtime.workers"
        return BackendChoice("inline", f"auto: {where} 1: one ClientWorker, which this "
                                       "process runs without Ray's start")
    have = float(cpus or os.cpu_count() or 1)
    per = cpus_per_worker(runtimes)
    parallel = max(1, int(have // per))
    if parallel == 1:
        return BackendChoice("inline", f"auto: {have:g} CPU(s) for workers of {per:g}: Ray's "
                                       "workers could not train at once")
    if estimate is None:  # fedray show of a run whose data is fetched when it starts
        return BackendChoice("auto", "auto: chosen when the run starts, from the rounds' work "
                                     "estimated on its data")
    work = estimate()
    pool = current_pool()
    warm = min(pool.idle("worker"), parallel) + min(pool.idle("server"), 1) if pool else 0
    cold = parallel + 1 - warm  # the actors that start a process, the server's included
    start = (0.0 if ray_running() else RAY_INIT_SECONDS) + \
        RAY_ACTOR_SECONDS * cold / max(1.0, min(have, cold))
    on_ray = start + work.seconds / parallel + work.rounds * round_seconds
    name = "inline" if work.seconds <= on_ray else "ray"
    kept = f"; {warm} warm actor(s)" if warm else ""
    return BackendChoice(name, f"auto: the rounds' work is estimated at {work.text()}; on Ray "
                               f"{on_ray:.1f} s with its start ({start:.1f} s{kept}) and "
                               f"{parallel} workers")


def make_backend(choice: BackendChoice | str, address: str | None = None,
                 **init_kwargs: Any) -> Backend:
    """The backend ``choice`` names (``choose_backend``; a name, ray or inline, as is):
    the inline backend, or Ray (a new local instance, or the cluster at ``address``)."""
    chosen = choice if isinstance(choice, BackendChoice) else \
        choose_backend(choice, [], address, estimate=None)
    if chosen.name not in ("ray", "inline"):
        raise ValueError(f"make_backend: no backend chosen ({chosen.reason})")
    if chosen.name == "inline":
        if address:
            raise UsageError("--address: only with --backend ray or auto")
        return InlineBackend(chosen.reason)
    return RayBackend(address, chosen.reason, **init_kwargs)
