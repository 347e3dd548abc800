"""Load generation: latency histogram, in-flight driver, client worker processes.

The load comes from client *processes* (multiprocessing, spawn), each running one
asyncio event loop (uvloop when installed) with grpc.aio channels and many requests
in flight. The orchestrator (`ClientPool`) hands every process a `JobSpec`: which
client program to run (a module-level coroutine function of a workload module),
its share of the concurrency and of the operation count, and the time bound.

A job has two phases, separated by a barrier shared by all processes of the job and
the orchestrator: setup (connect, warm up, create watchers...) and the timed window.
The orchestrator measures the server's CPU and RSS from the moment the barrier
opens, so setup never counts. Every loop is bounded both in count and in time; a
hard timeout around each job is the last resort.

A server that answers UNIMPLEMENTED makes the job end with status
``unimplemented``; the orchestrator turns that into an `Unavailable` outcome with
the note "not implemented" rather than a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from grpc import aio
from grpc.aio import EOF as _EOF  # type: ignore[attr-defined,unused-ignore]

from benchmarks.results import NOT_IMPLEMENTED, Failed, Measurement, Outcome, Unavailable

STREAM_END: Any = _EOF
"""What `read()` on a grpc.aio stream returns once the server closed it (grpc.aio.EOF)."""

# -- latency histogram ------------------------------------------------------------

_SUB_BITS = 7
"""Each power-of-two range is split into 2**7 = 128 buckets: relative error < 0.8%."""
_EXACT_BELOW = 2 << _SUB_BITS  # 256: values below are their own bucket


class LatencyHistogram:
    """A mergeable log-linear histogram of latencies in nanoseconds.

    Like HdrHistogram: values below 256 ns are counted exactly; above, every
    power-of-two range [2**k, 2**(k+1)) is split into 128 equal buckets, so a
    reported percentile is within 1/128 (< 0.8%) of a recorded value. Percentiles
    use the nearest-rank definition: the value at rank ceil(q * count).
    """

    __slots__ = ("count", "counts", "max_ns", "min_ns", "total_ns")

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.count = 0
        self.total_ns = 0
        self.min_ns = 0
        self.max_ns = 0

    @staticmethod
    def bucket_of(ns: int) -> int:
        if ns < _EXACT_BELOW:
            return max(ns, 0)
        shift = ns.bit_length() - (_SUB_BITS + 1)
        return (shift << _SUB_BITS) + (ns >> shift)

    @staticmethod
    def bucket_bounds(key: int) -> tuple[int, int]:
        """The smallest and largest value (inclusive) counted in bucket `key`."""
        if key < _EXACT_BELOW:
            return key, key
        shift = (key >> _SUB_BITS) - 1
        low = (key - (shift << _SUB_BITS)) << shift
        return low, low + (1 << shift) - 1

    def record(self, ns: int) -> None:
        if ns < _EXACT_BELOW:
            key = max(ns, 0)
        else:
            shift = ns.bit_length() - (_SUB_BITS + 1)
            key = (shift << _SUB_BITS) + (ns >> shift)
        counts = self.counts
        counts[key] = counts.get(key, 0) + 1
        if self.count == 0 or ns < self.min_ns:
            self.min_ns = ns
        if ns > self.max_ns:
            self.max_ns = ns
        self.count += 1
        self.total_ns += ns

    def merge(self, other: LatencyHistogram) -> None:
        if other.count == 0:
            return
        for key, n in other.counts.items():
            self.counts[key] = self.counts.get(key, 0) + n
        if self.count == 0 or other.min_ns < self.min_ns:
            self.min_ns = other.min_ns
        self.max_ns = max(self.max_ns, other.max_ns)
        self.count += other.count
        self.total_ns += other.total_ns

    def percentile(self, q: float) -> float | None:
        """The latency (ns) at quantile `q` in [0, 1], or None when empty."""
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile {q} not in [0, 1]")
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count))
        seen = 0
        for key in sorted(self.counts):
            seen += self.counts[key]
            if seen >= rank:
                low, high = self.bucket_bounds(key)
                mid = (low + high) / 2
                return float(min(max(mid, self.min_ns), self.max_ns))
        return float(self.max_ns)  # pragma: no cover - counts add up to count

    def percentile_ms(self, q: float) -> float | None:
        ns = self.percentile(q)
        return None if ns is None else ns / 1e6

    @property
    def mean_ns(self) -> float | None:
        return self.total_ns / self.count if self.count else None


# -- errors -----------------------------------------------------------------------


class Unimplemented(Exception):
    """The server answered UNIMPLEMENTED: the feature does not exist there (yet)."""


class BadResponse(Exception):
    """A response that is not what the workload expects (counted as an error)."""


def check_unimplemented(error: grpc.aio.AioRpcError, what: str) -> None:
    """Raise `Unimplemented` when `error` is UNIMPLEMENTED; otherwise return."""
    if error.code() == grpc.StatusCode.UNIMPLEMENTED:
        raise Unimplemented(f"{what}: {error.details() or 'UNIMPLEMENTED'}")


@contextlib.asynccontextmanager
async def unimplemented_as(what: str, call: Any = None) -> AsyncIterator[None]:
    """Within the block, an UNIMPLEMENTED answer (from a unary call, or ending the
    stream `call`) becomes `Unimplemented(what)`; other errors pass through."""
    try:
        yield
    except aio.AioRpcError as e:
        check_unimplemented(e, what)
        raise
    except asyncio.InvalidStateError:
        # Writing to a stream the server already ended: find out why.
        if call is not None and await call.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise Unimplemented(f"{what}: UNIMPLEMENTED") from None
        raise


async def require_watch(channel: Any) -> None:
    """Raise `Unimplemented` when the server has no Watch service.

    Probes with a Watch stream that writes nothing: a server without Watch ends
    it at once with UNIMPLEMENTED, a real one keeps it open. Probing this way
    avoids racing many writes against that reply, which grpcio 1.85 can report
    as INTERNAL instead of UNIMPLEMENTED."""
    from etcdserverpb import rpc_pb2_grpc

    call = rpc_pb2_grpc.WatchStub(channel).Watch()
    try:
        await asyncio.wait_for(call.read(), WATCH_PROBE_SECONDS)
    except TimeoutError:
        pass
    except aio.AioRpcError as e:
        check_unimplemented(e, "Watch")
        raise
    finally:
        call.cancel()


WATCH_PROBE_SECONDS = 0.3
"""How long the Watch probe listens; a missing service answers within
milliseconds on loopback."""


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


# -- one client process -----------------------------------------------------------

Op = Callable[[int], Awaitable[object]]
"""One operation of a closed-loop workload; its argument is a sequence number."""


class BarrierLike(Protocol):
    def wait(self, timeout: float | None = None) -> int: ...

    def abort(self) -> None: ...


@dataclass
class JobSpec:
    """What one client process runs. Must pickle (it crosses into a spawned process)."""

    program: Callable[[ClientRun], Awaitable[None]]
    endpoint: str
    index: int
    procs: int
    concurrency: int
    max_ops: int
    seconds: float
    warmup_seconds: float
    barrier: BarrierLike
    params: dict[str, Any] = field(default_factory=dict)
    channels: int = 1
    setup_timeout: float = 60.0
    drain_seconds: float = 5.0
    rpc_timeout: float = 10.0
    endpoints: tuple[str, ...] = ()
    """When set (a cluster's members), `connect` opens `channels` channels to each of
    these instead of `endpoint`, interleaved: channel i goes to endpoints[i % n]."""

    @property
    def hard_timeout(self) -> float:
        return self.setup_timeout + self.warmup_seconds + self.seconds + self.drain_seconds + 10


@dataclass
class JobResult:
    """What one client process reports back."""

    index: int
    status: str  # ok | unimplemented | aborted | failed
    detail: str = ""
    ops: int = 0
    errors: int = 0
    last_error: str = ""
    hist: LatencyHistogram = field(default_factory=LatencyHistogram)
    started: float | None = None
    ended: float | None = None
    cpu_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    payload: list[Any] = field(default_factory=list)


class ClientRun:
    """The context a client program runs in, inside one client process.

    A program connects, prepares, calls `start()` (the barrier: the timed window
    opens), does its work through `drive()` or records its own events with
    `record()`, and optionally calls `finish()`; the window closes at the last
    `finish()` or when the program returns.
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.params = spec.params
        self.index = spec.index
        self.hist = LatencyHistogram()
        self.ops = 0
        self.errors = 0
        self.last_error = ""
        self.extra: dict[str, float] = {}
        self.payload: list[Any] = []
        self.started: float | None = None
        self.ended: float | None = None
        self.last_event: float | None = None
        self._cpu_start = 0.0
        self._cpu_end: float | None = None
        self._barrier_passed = False
        self._channels: list[aio.Channel] = []

    # -- channels -----------------------------------------------------------------

    async def connect(self) -> None:
        """Open `spec.channels` channels, each its own TCP connection, and wait until
        they are ready; with `spec.endpoints`, that many to each endpoint, so that
        picking channel `seq % channel_count` goes round robin over the endpoints."""
        targets = self.spec.endpoints or (self.spec.endpoint,)
        for i in range(max(1, self.spec.channels)):
            for endpoint in targets:
                options = [
                    ("grpc.use_local_subchannel_pool", 1),  # a distinct connection each
                    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                    ("bench.channel", i),
                ]
                self._channels.append(aio.insecure_channel(endpoint, options=options))
        await asyncio.wait_for(
            asyncio.gather(*(ch.channel_ready() for ch in self._channels)),
            timeout=self.spec.setup_timeout,
        )

    def channel(self, i: int = 0) -> aio.Channel:
        if not self._channels:
            raise RuntimeError("connect() first")
        return self._channels[i % len(self._channels)]

    @property
    def channel_count(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close(grace=None)
        self._channels.clear()

    # -- phases -------------------------------------------------------------------

    async def warmup(self, op: Op, concurrency: int | None = None) -> None:
        """Run `op` untimed for the warm-up time (bounded by count too)."""
        if self.spec.warmup_seconds <= 0:
            return
        deadline = time.monotonic() + self.spec.warmup_seconds
        await self._loop(
            op,
            concurrency or self.spec.concurrency,
            max_ops=max(1, self.spec.max_ops // 4),
            deadline=deadline,
            record=False,
            first=1_000_000_000,
        )

    async def start(self) -> None:
        """Wait at the barrier with the other processes and the orchestrator; the
        timed window opens when everyone is there."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.spec.barrier.wait, self.spec.setup_timeout)
        self._barrier_passed = True
        self.started = time.monotonic()
        self._cpu_start = time.process_time()

    @property
    def deadline(self) -> float:
        """End of the timed window (monotonic seconds)."""
        if self.started is None:
            raise RuntimeError("start() first")
        return self.started + self.spec.seconds

    @property
    def drain_deadline(self) -> float:
        """When receivers stop waiting for in-flight events after the window."""
        return self.deadline + self.spec.drain_seconds

    def abort_barrier(self) -> None:
        if not self._barrier_passed:
            with contextlib.suppress(Exception):  # the manager may be gone already
                self.spec.barrier.abort()

    def finish(self, at: float | None = None) -> None:
        """Close the timed window (at `at`, default now)."""
        self.ended = at if at is not None else time.monotonic()
        self._cpu_end = time.process_time()

    # -- measuring ----------------------------------------------------------------

    async def drive(
        self, op: Op, concurrency: int | None = None, max_ops: int | None = None
    ) -> None:
        """Closed loop: `concurrency` tasks, each issuing `op` back to back, until
        `max_ops` operations were issued or the window's deadline passed."""
        await self._loop(
            op,
            concurrency or self.spec.concurrency,
            max_ops=self.spec.max_ops if max_ops is None else max_ops,
            deadline=self.deadline,
            record=True,
            first=0,
        )
        self.finish()

    async def issue(self, op: Op, concurrency: int, max_ops: int) -> int:
        """Like `drive` but untimed and unrecorded (e.g. a producer whose messages
        are measured by their consumers); returns how many operations it issued."""
        return await self._loop(
            op, concurrency, max_ops=max_ops, deadline=self.deadline, record=False, first=0
        )

    async def _loop(
        self, op: Op, concurrency: int, *, max_ops: int, deadline: float, record: bool, first: int
    ) -> int:
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while issued < max_ops and time.monotonic() < deadline:
                seq = first + issued
                issued += 1
                t0 = time.perf_counter_ns()
                try:
                    await op(seq)
                except aio.AioRpcError as e:
                    check_unimplemented(e, "rpc")
                    self.error(e)
                    continue
                except BadResponse as e:
                    self.error(e)
                    continue
                if record:
                    self.hist.record(time.perf_counter_ns() - t0)
                    self.ops += 1

        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(max(1, concurrency)):
                    tg.create_task(worker())
        except BaseExceptionGroup as group:
            raise _first_leaf(group) from None
        return issued

    def record(self, latency_ns: int) -> None:
        """Count one completed operation/event with its latency."""
        self.hist.record(latency_ns)
        self.ops += 1
        self.last_event = time.monotonic()

    def error(self, e: BaseException) -> None:
        self.errors += 1
        if isinstance(e, aio.AioRpcError):
            self.last_error = f"{e.code().name}: {e.details()}"
        else:
            self.last_error = repr(e)

    def add(self, name: str, amount: float = 1.0) -> None:
        """Add to a workload-specific counter (summed over processes)."""
        self.extra[name] = self.extra.get(name, 0.0) + amount

    def result(self, status: str, detail: str = "") -> JobResult:
        if status == "ok" and self.started is None:
            status, detail = "failed", "the program never opened the timed window"
        if self.started is not None and self.ended is None:
            self.finish()
        cpu = (self._cpu_end - self._cpu_start) if self._cpu_end is not None else 0.0
        return JobResult(
            index=self.index,
            status=status,
            detail=detail,
            ops=self.ops,
            errors=self.errors,
            last_error=self.last_error,
            hist=self.hist,
            started=self.started,
            ended=self.ended,
            cpu_s=cpu,
            extra=self.extra,
            payload=self.payload,
        )


_worker_loop: asyncio.AbstractEventLoop | None = None


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _init_worker() -> None:
    """Pool initializer: one event loop per client process, kept across jobs."""
    global _worker_loop
    _worker_loop = _new_loop()
    asyncio.set_event_loop(_worker_loop)


def uses_uvloop() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return True


def _noop() -> None:
    """A job that only makes the pool start a client process (see prestart)."""


def run_job(spec: JobSpec) -> JobResult:
    """Entry point in a client process: run one job to its end."""
    if _worker_loop is None:
        _init_worker()
    assert _worker_loop is not None
    return _worker_loop.run_until_complete(_run_job(spec))


async def _run_job(spec: JobSpec) -> JobResult:
    run = ClientRun(spec)
    status, detail = "ok", ""
    try:
        await asyncio.wait_for(spec.program(run), timeout=spec.hard_timeout)
    except Unimplemented as e:
        status, detail = "unimplemented", str(e)
    except threading.BrokenBarrierError:
        status, detail = "aborted", "another process failed during setup"
    except TimeoutError:
        status, detail = (
            "failed",
            f"client job exceeded its hard timeout ({spec.hard_timeout:.0f}s)",
        )
    except aio.AioRpcError as e:
        status, detail = "failed", f"{e.code().name}: {e.details()}"
    except Exception:  # reported to the orchestrator, which fails the row
        status, detail = "failed", traceback.format_exc(limit=6)
    if status != "ok":
        run.abort_barrier()
    with contextlib.suppress(Exception):  # closing is best effort
        await asyncio.wait_for(run.close(), timeout=5)
    return run.result(status, detail)


# -- the orchestrator's side ------------------------------------------------------


class WindowMonitor(Protocol):
    """Measures the server during the timed window (see servers.ResourceMonitor)."""

    def start(self) -> None: ...

    def stop(self) -> tuple[float, float]:
        """Stop; return (server CPU seconds, peak RSS MB) over the window."""
        ...


def split(total: int, parts: int) -> list[int]:
    """`total` spread over `parts` as evenly as integers allow (earlier parts get more)."""
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


@dataclass
class PoolResult:
    outcome: Outcome
    payload: list[Any]
    detail: str = ""


class ClientPool:
    """Client worker processes, started once and reused by every workload."""

    def __init__(self, max_procs: int) -> None:
        self.max_procs = max(1, max_procs)
        self._ctx = multiprocessing.get_context("spawn")
        self._manager = self._ctx.Manager()
        self._executor = self._new_executor()

    def _new_executor(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(
            max_workers=self.max_procs, mp_context=self._ctx, initializer=_init_worker
        )

    def prestart(self) -> None:
        """Start the client processes now (they start at the first job otherwise),
        e.g. while servers are starting; does not wait for them."""
        for _ in range(self.max_procs):
            self._executor.submit(_noop)

    def worker_pids(self) -> list[int]:
        # The executor keeps its processes in a private dict; we need the pids to end
        # a stuck worker (a process we started) by pid.
        procs: dict[int, Any] = getattr(self._executor, "_processes", None) or {}
        return list(procs)

    def _kill_workers(self) -> None:
        for pid in self.worker_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._executor = self._new_executor()

    def run(
        self,
        program: Callable[[ClientRun], Awaitable[None]],
        *,
        endpoint: str,
        monitor: WindowMonitor,
        procs: int,
        concurrency: int,
        max_ops: int,
        seconds: float,
        warmup_seconds: float = 0.0,
        params: dict[str, Any] | None = None,
        per_proc: list[dict[str, Any]] | None = None,
        channels: int = 1,
        setup_timeout: float = 60.0,
        drain_seconds: float = 5.0,
        endpoints: Sequence[str] = (),
    ) -> PoolResult:
        """Run `program` in `procs` client processes; merge what they measured."""
        procs = max(1, min(procs, self.max_procs))
        barrier = self._manager.Barrier(procs + 1)
        conc = split(max(concurrency, procs), procs)
        counts = split(max_ops, procs)
        specs = [
            JobSpec(
                program=program,
                endpoint=endpoint,
                index=i,
                procs=procs,
                concurrency=conc[i],
                max_ops=counts[i],
                seconds=seconds,
                warmup_seconds=warmup_seconds,
                barrier=barrier,
                params={**(params or {}), **(per_proc[i] if per_proc else {})},
                channels=channels,
                setup_timeout=setup_timeout,
                drain_seconds=drain_seconds,
                endpoints=tuple(endpoints),
            )
            for i in range(procs)
        ]
        try:
            futures = [self._executor.submit(run_job, spec) for spec in specs]
        except BrokenProcessPool:
            self._kill_workers()
            futures = [self._executor.submit(run_job, spec) for spec in specs]
        monitoring = False
        try:
            barrier.wait(timeout=setup_timeout + warmup_seconds + 5)
            monitor.start()
            monitoring = True
        except threading.BrokenBarrierError:
            pass
        results: list[JobResult] = []
        failure = ""
        try:
            for f in futures:
                results.append(f.result(timeout=specs[0].hard_timeout + 15))
        except FutureTimeout:
            failure = "client processes did not finish in time (killed)"
            self._kill_workers()
        except BrokenProcessPool:
            failure = "a client process died"
            self._kill_workers()
        server_cpu, rss = monitor.stop() if monitoring else (0.0, 0.0)
        if failure:
            return PoolResult(Failed(failure), [])
        return self._merge(results, server_cpu, rss, concurrency)

    @staticmethod
    def _merge(results: list[JobResult], server_cpu: float, rss: float, conc: int) -> PoolResult:
        payload = [item for r in results for item in r.payload]
        unimpl = [r for r in results if r.status == "unimplemented"]
        if unimpl:
            return PoolResult(Unavailable(NOT_IMPLEMENTED), payload, unimpl[0].detail)
        failed = [r for r in results if r.status == "failed"]
        if failed:
            return PoolResult(
                Failed(failed[0].detail.strip().splitlines()[-1]), payload, failed[0].detail
            )
        if any(r.status != "ok" for r in results):
            return PoolResult(Failed("setup did not complete (barrier broken)"), payload)
        hist = LatencyHistogram()
        extra: dict[str, float] = {}
        for r in results:
            hist.merge(r.hist)
            for k, v in r.extra.items():
                extra[k] = extra.get(k, 0.0) + v
        ops = sum(r.ops for r in results)
        errors = sum(r.errors for r in results)
        if ops == 0:
            last = next((r.last_error for r in results if r.last_error), "")
            note = "no operation completed" + (f" (last error {last})" if last else "")
            return PoolResult(Failed(note), payload)
        started = min(r.started for r in results if r.started is not None)
        ended = max(r.ended for r in results if r.ended is not None)
        measurement = Measurement(
            ops=ops,
            seconds=max(ended - started, 1e-9),
            errors=errors,
            p50_ms=hist.percentile_ms(0.50),
            p99_ms=hist.percentile_ms(0.99),
            p999_ms=hist.percentile_ms(0.999),
            cpu_s=server_cpu,
            rss_mb=rss,
            client_cpu_s=sum(r.cpu_s for r in results),
            client_procs=len(results),
            concurrency=conc,
            extra=extra,
        )
        return PoolResult(measurement, payload)

    def close(self, force: bool = False) -> None:
        """Stop the client processes and the manager; `force` ends the workers by
        pid at once (after an interruption, when they may be mid-job)."""
        if force:
            for pid in self.worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._executor.shutdown(wait=not force, cancel_futures=True)
        self._manager.shutdown()
