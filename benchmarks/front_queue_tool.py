"""The etcd-key queue through fronts over a 3-member etcd, against etcd's own queue recipe.

Run it with::

    python -m benchmarks.front_queue_tool [--quick] [--queue-tool PATH] [--etcd PATH] \\
        [--out FILE.md] [--json FILE] [--timeout SECONDS] [--kills N]

What it owns: one 3-member etcd (Debian's etcd, fresh temporary data dirs, loopback ports)
for the whole run, and on it, one after another:

- `recipe`: tools/queue-bench `recipe` straight to etcd (claim by mod_revision Txn), the
  producers on one member and the consumers over all three, with the same clients as the
  queue's rows (`CLIENTS`); `recipe-4` the same with 4 producers, where it loses fewer
  claim races. The queue's rows are compared with the better of the two;
- `fronts=1`, `fronts=2`, `fronts=3`: that many fronts (`--backend-endpoints`) over the same
  etcd, tools/queue-bench `mq` with the producers on the first front and the consumers on
  the others (on the first one too when it is alone), one put and one delete a message;
- `failover`: two fronts, a consumer on each, a producer putting one message every
  `PRODUCE_EVERY` seconds through the second; the dispatching front (the one holding
  `/q/{name}`) is SIGKILLed `--kills` times (restarted after each) and the time from the
  kill to the next delivery is measured.

The CPU of etcd's members and of the fronts is read from /proc over each run. Every tool run
is bounded by `--timeout`; every process is ended by its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from benchmarks.cluster_tool import Cluster
from benchmarks.front_tool import FrontServer
from benchmarks.options import (
    add_common_args,
    finish_report,
    queue_bench,
    resolve_common_args,
    run_meta,
    stop_on_sigterm,
)
from benchmarks.runs import driver_answer, run_measured
from benchmarks.servers import log, process_tree_cpu
from etcdserverpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

QUICK_TIMEOUT = 60.0
FULL_TIMEOUT = 300.0
FULL_MESSAGES = 20_000
QUICK_MESSAGES = 1_000
RECIPE_SHARE = 4
"""The recipe is slow; it runs 1/RECIPE_SHARE of the messages (its rate is what counts)."""
CLIENTS = ["--consumers=8", "--producers=64", "--inflight=1024", "--conns=4"]
"""The same clients on both sides, as queue_tool's `mq-64` and `recipe-64`: 64
producers (as put64's 64 clients), 8 consumers, at most 1,024 messages unacknowledged."""
MQ_FLAGS = [*CLIENTS, "--put-batch=1", "--ack-batch=1", "--acks-in-flight=16"]
RECIPE_RUNS = {
    "recipe": CLIENTS,
    "recipe-4": ["--consumers=8", "--producers=4", "--inflight=128", "--conns=4"],
}
"""The recipe with the same clients, and with 4 producers, where it loses fewer
claim races; the queue's rows are compared with the better of the two."""
PRODUCE_EVERY = 0.02
FAILOVER_BOUND = 20.0


def run_driver(cmd: list[str], timeout: float, work: Path, name: str) -> dict[str, Any]:
    """queue-bench's answer, or `ok` false and the failure when it gave none or was killed."""
    out_path, err_path = work / f"{name}.json", work / f"{name}.err"
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        done = run_measured(cmd, out, err, timeout + 30, lambda: 0.0)
    driver, error = driver_answer(out_path, done)
    if driver is None or done.rc is None:
        tail = err_path.read_text(errors="replace")[-300:]
        return {"ok": False, "failures": [f"{error}: {tail}"]}
    return driver


def measured(
    cmd: list[str], args: argparse.Namespace, work: Path, name: str, pids: dict[str, list[int]]
) -> dict[str, Any]:
    before = {k: sum(process_tree_cpu(p) for p in v) for k, v in pids.items()}
    result = run_driver(cmd, args.timeout, work, name)
    result["cpu_s"] = {k: sum(process_tree_cpu(p) for p in v) - before[k] for k, v in pids.items()}
    return result


class Consumer:
    """A consumer of `name` through `endpoint`, its deliveries timestamped on arrival."""

    def __init__(self, endpoint: str, name: bytes) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.arrivals: queue.Queue[tuple[float, kv_pb2.KeyValue]] = queue.Queue()
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        key = b"/q/%s/c/%s" % (name, str(uuid.uuid4()).encode())
        self._requests.put(rpc_pb2.WatchRequest(create_request=rpc_pb2.WatchCreateRequest(key=key)))
        self.key = key
        self.ended = ""
        """Why its watch or an ack failed, which ends it (a client's retries are
        not the harness's business: an error here is a finding)."""
        stub = rpc_pb2_grpc.WatchStub(self.channel)
        self._call = stub.Watch(iter(self._requests.get, None), timeout=600)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        kv = rpc_pb2_grpc.KVStub(self.channel)
        try:
            for response in self._call:
                for event in response.events:
                    if event.type == kv_pb2.Event.PUT:
                        self.arrivals.put((time.monotonic(), event.kv))
                        kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=event.kv.key), timeout=10)
        except grpc.RpcError as e:
            self.ended = f"{e.code().name}: {e.details()}"

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        self.channel.close()


def dispatcher_of(endpoint: str, name: bytes) -> bytes:
    with grpc.insecure_channel(endpoint) as ch:
        reply = rpc_pb2_grpc.KVStub(ch).Range(rpc_pb2.RangeRequest(key=b"/q/" + name), timeout=5)
    return reply.kvs[0].value if reply.kvs else b""


def run_failover(etcd: Cluster, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Median kill-to-next-delivery over `args.kills` SIGKILLs of the dispatching front."""
    backend = ",".join(m.url for m in etcd.members)
    fronts = [FrontServer(work / f"fo{i}", args.etcdctl, backend) for i in (1, 2)]
    for f in fronts:
        f.start()
    name = b"failover-%s" % uuid.uuid4().hex[:8].encode()
    consumers = [Consumer(f.endpoint, name) for f in fronts]
    stop = threading.Event()
    seq = [0]

    def produce() -> None:
        while not stop.is_set():
            target = (
                fronts[seq[0] % 2]
                if all(f.alive for f in fronts)
                else next((f for f in fronts if f.alive), fronts[0])
            )
            with contextlib.suppress(grpc.RpcError), grpc.insecure_channel(target.endpoint) as ch:
                rpc_pb2_grpc.KVStub(ch).Put(
                    rpc_pb2.PutRequest(key=b"/q/%s/p/m%d" % (name, seq[0]), value=b"x"), timeout=2
                )
                seq[0] += 1
            time.sleep(PRODUCE_EVERY)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    times: list[float] = []
    try:
        for k in range(args.kills):
            time.sleep(1.0)  # a steady stream before each kill
            holder = dispatcher_of(etcd.members[0].endpoint, name)
            victim = next(
                (f for f in fronts if holder and f.alive and holder in f.log_path.read_bytes()),
                fronts[0],
            )
            survivor = consumers[1 - fronts.index(victim)]
            while not survivor.arrivals.empty():
                survivor.arrivals.get_nowait()
            victim.kill()
            killed = time.monotonic()
            deadline = killed + FAILOVER_BOUND
            took = None
            while time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    at, _ = survivor.arrivals.get(timeout=0.2)
                    if at > killed:
                        took = at - killed
                        break
            log(f"  kill {k + 1}: next delivery after {took if took is not None else 'none'}")
            if took is None and survivor.ended:
                log(f"  the survivor's consumer had ended: {survivor.ended}")
            if took is not None:
                times.append(took)
            index = fronts.index(victim)
            consumers[index].close()
            victim.start()
            consumers[index] = Consumer(victim.endpoint, name)
    finally:
        stop.set()
        producer.join(timeout=5)
        for c in consumers:
            c.close()
        for f in fronts:
            f.stop()
    return {
        "ok": len(times) == args.kills,
        "seconds": times,
        "median_s": statistics.median(times) if times else None,
    }


def markdown(
    rows: dict[str, dict[str, Any]], failover: dict[str, Any], meta: dict[str, Any]
) -> str:
    recipe = max(rows[name].get("per_second") or 0.0 for name in RECIPE_RUNS)
    out = [
        "# The etcd-key queue through fronts over a 3-member etcd, against etcd's recipe",
        "",
        f"- commit {meta.get('commit')}, etcd {meta.get('etcd_version')}, {meta.get('date')}",
        "- tools/queue-bench: `mq` through the fronts (producers on the first, consumers on the "
        "others), `recipe` straight to etcd, with the same clients (64 producers, 8 consumers, "
        "1,024 messages unacknowledged at most); `recipe-4` with 4 producers",
        "- vs recipe: against the better of the two recipe rows",
        "",
        "| row | msgs/s | vs recipe | p50 ms | p99 ms | etcd CPU µs/msg | fronts CPU µs/msg |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for row, r in rows.items():
        if not r.get("ok"):
            out.append(
                f"| {row} | failed: {'; '.join(map(str, r.get('failures', [])))} | | | | | |"
            )
            continue
        rate, count = r["per_second"], r["count"]
        lat = r.get("latency_ms", {})
        cpu = r.get("cpu_s", {})
        fronts = cpu.get("fronts")
        out.append(
            f"| {row} | {rate:,.0f} | {rate / recipe if recipe else 0:.1f}x | "
            f"{lat.get('p50', 0):.1f} | "
            f"{lat.get('p99', 0):.1f} | {cpu.get('etcd', 0) * 1e6 / count:,.0f} | "
            f"{'—' if fronts is None else f'{fronts * 1e6 / count:,.0f}'} |"
        )
    times = ", ".join(f"{t:.2f}" for t in failover.get("seconds", []))
    median = failover.get("median_s")
    out += [
        "",
        f"Dispatcher failover, {len(failover.get('seconds', []))} SIGKILLs of the dispatching "
        f"front: median {'—' if median is None else f'{median:.2f}'} s to the next delivery "
        f"({times} s).",
    ]
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.front_queue_tool",
        description="The etcd-key queue through fronts over etcd, against etcd's recipe.",
    )
    add_common_args(p, QUICK_TIMEOUT, FULL_TIMEOUT)
    p.add_argument("--kills", type=int, default=5, help="SIGKILLs of the dispatching front")
    args = p.parse_args(argv)
    resolve_common_args(p, args, QUICK_TIMEOUT, FULL_TIMEOUT, need_tool=False, need_queue_tool=True)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    with queue_bench(args):
        return run_all(args)


def run_all(args: argparse.Namespace) -> int:
    started = time.monotonic()
    meta = run_meta(args)
    n = QUICK_MESSAGES if args.quick else FULL_MESSAGES
    root = Path(tempfile.mkdtemp(prefix="front-queue-tool-"))
    etcd = Cluster("etcd", root, args)
    rows: dict[str, dict[str, Any]] = {}
    failover: dict[str, Any] = {}
    try:
        etcd.start()
        backend = ",".join(m.url for m in etcd.members)
        etcd_pids = [m.pid for m in etcd.members]
        for name, flags in RECIPE_RUNS.items():
            cmd = [
                str(args.queue_tool),
                "recipe",
                f"--total={max(n // RECIPE_SHARE, 100)}",
                *flags,
                f"--endpoint={etcd.members[0].endpoint}",
                f"--producer-endpoints={etcd.members[0].endpoint}",
                f"--consumer-endpoints={etcd.endpoints}",
                f"--timeout={args.timeout:.0f}s",
                "--progress=0",
            ]
            log(name)
            rows[name] = measured(cmd, args, root, name, {"etcd": etcd_pids})
        for count in (1, 2, 3):
            fronts = [
                FrontServer(root / f"f{count}-{i}", args.etcdctl, backend) for i in range(count)
            ]
            try:
                for f in fronts:
                    f.start()
                consumers = fronts[1:] or fronts
                cmd = [
                    str(args.queue_tool),
                    "mq",
                    f"--total={n}",
                    *MQ_FLAGS,
                    f"--endpoint={fronts[0].endpoint}",
                    f"--producer-endpoints={fronts[0].endpoint}",
                    f"--consumer-endpoints={','.join(f.endpoint for f in consumers)}",
                    f"--timeout={args.timeout:.0f}s",
                    "--progress=0",
                ]
                log(f"fronts={count}")
                rows[f"fronts={count}"] = measured(
                    cmd,
                    args,
                    root,
                    f"fronts{count}",
                    {"etcd": etcd_pids, "fronts": [f.pid for f in fronts]},
                )
            finally:
                for f in fronts:
                    f.stop()
            log(f"  {rows[f'fronts={count}'].get('per_second')}")
        log("failover")
        failover = run_failover(etcd, args, root)
    finally:
        etcd.stop()
    failed = [name for name, r in rows.items() if not r.get("ok")]
    failed += [] if failover.get("ok") else ["failover"]
    if not failed:
        shutil.rmtree(root, ignore_errors=True)
    doc = {"meta": meta, "rows": rows, "failover": failover}
    return finish_report(args, markdown(rows, failover, meta), doc, failed, started, log)


if __name__ == "__main__":
    sys.exit(main())
