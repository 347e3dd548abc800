"""Crash test: SIGKILL the server while a writer has many puts in flight; after a
restart every acknowledged put is there, with the revision it was acknowledged at.

Each round kills at a random point (after a random number of acknowledgements,
awaited by reading the writer's output, not by sleeping), with a small
--snapshot-count so kills also land around snapshots and log trimming.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from etcdserverpb import rpc_pb2, rpc_pb2_grpc
from tests.support.processes import ServerProcess

pytestmark = [pytest.mark.integration, pytest.mark.crash]

ROUNDS = 4
PUTS_PER_ROUND = 3000
WRITER = Path(__file__).with_name("crash_writer.py")
REPO = Path(__file__).resolve().parents[2]


def test_acknowledged_puts_survive_sigkill(tmp_path: Path) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    server = ServerProcess(tmp_path / "crash.etcd", extra_args=["--snapshot-count", "500"])
    acknowledged: dict[str, int] = {}
    try:
        for round_no in range(ROUNDS):
            server.start()
            kill_after = rng.randrange(50, PUTS_PER_ROUND - 200)
            writer = subprocess.Popen(
                [
                    sys.executable,
                    str(WRITER),
                    server.endpoint,
                    f"r{round_no}/",
                    str(PUTS_PER_ROUND),
                ],
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            assert writer.stdout is not None
            seen = 0
            deadline = time.monotonic() + 60
            for line in writer.stdout:
                key, rev = line.split()
                acknowledged[key] = int(rev)
                seen += 1
                if seen >= kill_after or time.monotonic() > deadline:
                    server.kill()
                    break
            # whatever the writer still reports was acknowledged before the kill
            rest, _ = writer.communicate(timeout=60)
            for line in rest.splitlines():
                key, rev = line.split()
                acknowledged[key] = int(rev)
            assert seen >= kill_after, f"writer stopped early (seed {seed})"

        server.start()
        with grpc.insecure_channel(server.endpoint) as ch:
            kv = rpc_pb2_grpc.KVStub(ch)
            resp = kv.Range(rpc_pb2.RangeRequest(key=b"r", range_end=b"s"), timeout=30)
        found = {kv.key.decode(): kv.mod_revision for kv in resp.kvs}
        missing = {k: r for k, r in acknowledged.items() if found.get(k) != r}
        assert not missing, (
            f"{len(missing)} acknowledged puts lost or changed (seed {seed}): {list(missing.items())[:5]}"
        )
        # revisions are dense: one per put that reached the log, none reused
        assert len(set(found.values())) == len(found)
        assert resp.header.revision == len(found) + 1
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.stop()
