"""Crash consistency under a mixed load: SIGKILL the server at random points while
`mixed_load.py` runs puts, two-key txns, queue produces and acknowledgements and
lease grants with attached keys; after each restart check what the load recorded
(fsynced, one line per acknowledged operation) against the server:

- every acknowledged put, txn and lease-attached put is there, at the revision it
  was acknowledged at; every acknowledged lease exists;
- no txn is half-applied, acknowledged or not (its two keys exist together, with
  one value and one revision);
- every acknowledged produce is still queued (one message) or was delivered (and
  then acknowledged: the delete may be applied with its answer lost in the kill),
  and an acknowledged (deleted) message is never back;
- revisions only rise: each life's acknowledged revisions are above the last one's,
  and a restarted server's revision is at least the highest acknowledged.

CRASH_ITERATIONS sets the number of kills (5 by default, 50 for the nightly run).
The kill point is random: after a random number of acknowledged operations (read
from the load's output, not slept for) plus a random delay of up to 50 ms, so it
lands anywhere in a group commit, a snapshot (--snapshot-count 300) or a trim.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import REPO_ROOT, ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.crash]

ITERATIONS = int(os.environ.get("CRASH_ITERATIONS", "5"))
LOAD = Path(__file__).with_name("mixed_load.py")
QUEUE = "crashq"
MAX_OPS = 5000
"""Per life: far more than any kill point, so the load is still running at the kill."""
ITERATION_SECONDS = 60.0
MESSAGE_KEY = re.compile(rf"^/q/{QUEUE}/(\d{{16}})/(.+)$")


@dataclass
class Acknowledged:
    """What the load recorded, over all lives so far."""

    puts: dict[str, int] = field(default_factory=dict)
    txns: dict[str, int] = field(default_factory=dict)
    produced: dict[str, int] = field(default_factory=dict)
    acked: dict[str, int] = field(default_factory=dict)
    delivered: set[str] = field(default_factory=set)
    redelivered: list[str] = field(default_factory=list)  # delivered again after its ack
    leases: set[int] = field(default_factory=set)
    lease_keys: dict[str, tuple[int, int]] = field(default_factory=dict)
    lines: int = 0

    def read(self, path: Path) -> list[int]:
        """Parse the record file from the start; returns the revisions of the lines
        new since the last call, in file order."""
        revisions = []
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines[self.lines :]:
            kind, *args = line.split()
            if kind == "put":
                self.puts[args[0]] = int(args[1])
            elif kind == "txn":
                self.txns[args[0]] = int(args[1])
            elif kind == "produce":
                self.produced[args[0]] = int(args[1])
            elif kind == "ack":
                self.acked[args[0]] = int(args[1])
            elif kind == "lease":
                self.leases.add(int(args[0]))
                continue
            elif kind == "deliver":
                if args[0] in self.acked:
                    self.redelivered.append(args[0])
                self.delivered.add(args[0])
                continue
            elif kind == "leasekey":
                self.lease_keys[args[0]] = (int(args[1]), int(args[2]))
            revisions.append(int(args[-1]))
        self.lines = len(lines)
        return revisions

    @property
    def total(self) -> int:
        """Operations acknowledged (deliveries are not operations)."""
        return (
            len(self.puts)
            + len(self.txns)
            + len(self.produced)
            + len(self.acked)
            + len(self.leases)
            + len(self.lease_keys)
        )


def _range(kv: rpc_pb2_grpc.KVStub, prefix: bytes) -> rpc_pb2.RangeResponse:
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    response: rpc_pb2.RangeResponse = kv.Range(
        rpc_pb2.RangeRequest(key=prefix, range_end=end), timeout=30
    )
    return response


def check(endpoint: str, ack: Acknowledged, seed: int) -> int:
    """Compare the server with what was acknowledged; returns its revision."""
    where = f"(seed {seed})"
    with grpc.insecure_channel(endpoint) as ch:
        kv = rpc_pb2_grpc.KVStub(ch)
        mix = _range(kv, b"/mix/")
        queued = _range(kv, f"/q/{QUEUE}/".encode())
        leases = rpc_pb2_grpc.LeaseStub(ch).LeaseLeases(rpc_pb2.LeaseLeasesRequest(), timeout=30)
    found = {k.key.decode(): k for k in mix.kvs}

    lost = {k: r for k, r in ack.puts.items() if k not in found or found[k].mod_revision != r}
    assert not lost, f"acknowledged puts lost {where}: {list(lost.items())[:5]}"

    txa = {k.removeprefix("/mix/txa/"): v for k, v in found.items() if k.startswith("/mix/txa/")}
    txb = {k.removeprefix("/mix/txb/"): v for k, v in found.items() if k.startswith("/mix/txb/")}
    half = set(txa) ^ set(txb)
    assert not half, f"txns half-applied {where}: {sorted(half)[:5]}"
    for n, a in txa.items():
        b = txb[n]
        assert (a.value, a.mod_revision) == (b.value, b.mod_revision), f"txn {n} torn {where}"
    lost = {n: r for n, r in ack.txns.items() if n not in txa or txa[n].mod_revision != r}
    assert not lost, f"acknowledged txns lost {where}: {list(lost.items())[:5]}"

    live = {lease.ID for lease in leases.leases}
    assert ack.leases <= live, f"acknowledged leases lost {where}: {ack.leases - live}"
    for key, (lease_id, rev) in ack.lease_keys.items():
        k = found.get(key)
        assert k is not None and (k.lease, k.mod_revision) == (lease_id, rev), (
            f"lease-attached put {key} lost or detached {where}"
        )

    messages: dict[str, list[str]] = {}
    for k in queued.kvs:
        m = MESSAGE_KEY.match(k.key.decode())
        if m:
            messages.setdefault(m.group(2), []).append(k.key.decode())
    assert not ack.redelivered, f"acknowledged messages delivered again {where}"
    back = [key for key in ack.acked if MESSAGE_KEY.match(key) and key in _flat(messages)]
    assert not back, f"acknowledged messages back in the queue {where}: {back[:5]}"
    delivered = {m.group(2) for m in map(MESSAGE_KEY.match, ack.delivered) if m}
    gone = [n for n in ack.produced if n not in messages and n not in delivered]
    assert not gone, f"produced messages neither queued nor delivered {where}: {gone[:5]}"
    doubled = {n: keys for n, keys in messages.items() if len(keys) > 1}
    assert not doubled, f"messages queued twice {where}: {list(doubled.items())[:3]}"

    revision = int(mix.header.revision)
    highest = max([0, *ack.puts.values(), *ack.txns.values(), *ack.produced.values()])
    assert revision >= highest, f"revision {revision} below acknowledged {highest} {where}"
    return revision


def _flat(messages: dict[str, list[str]]) -> set[str]:
    return {key for keys in messages.values() for key in keys}


@pytest.mark.timeout(60 + 20 * ITERATIONS)  # the nightly size outlasts the default 300 s
def test_mixed_load_survives_sigkill(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    server = ServerProcess(tmp_path / "mixed.etcd", extra_args=["--snapshot-count", "300"])
    record = tmp_path / "acknowledged.txt"
    ack = Acknowledged()
    last_life_top = 0
    try:
        for life in range(ITERATIONS):
            server.start()
            if life:
                revision = check(server.endpoint, ack, seed)
                assert revision >= last_life_top
            kill_after = rng.randrange(20, 250)
            load = subprocess.Popen(
                [sys.executable, str(LOAD), server.endpoint, str(record), f"L{life}", str(MAX_OPS)],
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO_ROOT,
            )
            assert load.stdout is not None
            acknowledged = 0
            deadline = time.monotonic() + ITERATION_SECONDS
            for line in load.stdout:
                acknowledged += line.strip() == "ok"
                if acknowledged >= kill_after or time.monotonic() > deadline:
                    break
            time.sleep(rng.uniform(0, 0.05))  # the fault's timing, not a wait for anything
            server.kill()
            load.communicate(timeout=ITERATION_SECONDS)
            assert acknowledged >= kill_after, f"load stopped early (seed {seed})"
            revisions = ack.read(record)
            assert revisions, f"nothing acknowledged in life {life} (seed {seed})"
            assert min(revisions) > last_life_top, f"revisions went back (seed {seed})"
            last_life_top = max(revisions)

        server.start()
        check(server.endpoint, ack, seed)
        print(
            f"\ncrash-mixed: iterations={ITERATIONS} ops_acknowledged={ack.total} "
            f"puts={len(ack.puts)} txns={len(ack.txns)} produced={len(ack.produced)} "
            f"delivered={len(ack.delivered)} acked={len(ack.acked)} leases={len(ack.leases)} lost=0 seed={seed}"
        )
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
