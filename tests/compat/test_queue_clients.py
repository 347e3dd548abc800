"""The queue's happy path through real etcd clients, unchanged: etcdctl 3.4 and the
PyPI `etcd3` client (python-etcd3 0.12.0). No client knows it talks to a queue:
a watch on the consumer key, a put on the producer key, a delete of the key the
watch delivered, and a plain get shows the queue's state.

Against our server only: real etcd has no queue, so there is nothing to compare.
etcd3 runs in a child process (its generated protos clash with ours, and it needs
the pure-Python protobuf runtime), from the script `ETCD3_SCENARIO` below.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest

from tests.support.processes import ServerProcess

pytestmark = pytest.mark.compat

CTL_TIMEOUT = 20.0
WAIT = 10.0


def ctl(server: ServerProcess, *args: str) -> str:
    """stdout of an etcdctl command that must succeed."""
    p = subprocess.run(
        ["etcdctl", f"--endpoints={server.endpoint}", *args],
        capture_output=True,
        text=True,
        timeout=CTL_TIMEOUT,
        env={**os.environ, "ETCDCTL_API": "3"},
        check=False,
    )
    assert p.returncode == 0, f"etcdctl {' '.join(args)} failed: {p.stderr}"
    return p.stdout


def lines(*items: str) -> str:
    return "".join(f"{i}\n" for i in items)


class BackgroundCtl:
    """A long-running etcdctl (a watch) whose output lines are read by a thread
    and taken with a timeout; stopped by its own pid."""

    def __init__(self, server: ServerProcess, *args: str) -> None:
        self.proc = subprocess.Popen(
            ["etcdctl", f"--endpoints={server.endpoint}", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def read(self, n: int) -> list[str]:
        out: list[str] = []
        for _ in range(n):
            try:
                line = self._lines.get(timeout=WAIT)
            except queue.Empty:
                raise AssertionError(
                    f"etcdctl printed {out} and then nothing for {WAIT}s"
                ) from None
            assert line is not None, f"etcdctl exited after {out}"
            out.append(line)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=WAIT)


@pytest.mark.skipif(shutil.which("etcdctl") is None, reason="etcdctl is not installed")
def test_etcdctl_happy_path(server: ServerProcess) -> None:
    node = server.data_dir.name
    consumer = str(uuid.uuid4())
    message = "/q/ctlq/0000000000000001/job-1"  # the queue's first idx

    assert ctl(server, "put", "/q/ctlq/p/job-1", "hello") == "OK\n"
    # the message waits for a consumer, visible to a plain get, counted by -w json
    assert ctl(server, "get", "--prefix", "/q/ctlq/") == lines(message, "hello")
    assert json.loads(ctl(server, "get", "/q/ctlq/0", "/q/ctlq/:", "-w", "json"))["count"] == 1

    watch = BackgroundCtl(server, "watch", f"/q/ctlq/c/{consumer}")
    observer: BackgroundCtl | None = None
    try:
        assert watch.read(3) == ["PUT", message, "hello"]
        assert ctl(server, "del", message) == "1\n"  # the ack
        assert ctl(server, "del", message) == "0\n"  # acked already: nothing changes
        # what is left: the registry keys the server maintains
        assert ctl(server, "get", "--prefix", "/q/ctlq") == lines(
            "/q/ctlq", node, f"/q/ctlq/c/{consumer}", node
        )
        assert "count" not in json.loads(ctl(server, "get", "/q/ctlq/0", "/q/ctlq/:", "-w", "json"))

        # a prefix watch is an ordinary watch: it sees the consumer leave. It
        # starts at the next revision, so the marker put below reaches it however
        # late the background etcdctl connects.
        now = json.loads(ctl(server, "get", "/q/ctlq", "-w", "json"))["header"]["revision"]
        observer = BackgroundCtl(
            server, "watch", "--prefix", "/q/ctlq/c/", "--rev", str(int(now) + 1)
        )
        assert ctl(server, "put", "/q/ctlq/c/ready-marker/x", "1") == "OK\n"
        assert observer.read(3) == ["PUT", "/q/ctlq/c/ready-marker/x", "1"]
        watch.stop()
        assert observer.read(2) == ["DELETE", f"/q/ctlq/c/{consumer}"]
    finally:
        watch.stop()
        if observer is not None:
            observer.stop()


ETCD3_SCENARIO = r"""
import json, queue, sys, uuid
import etcd3

host, port = sys.argv[1].rsplit(":", 1)
client = etcd3.client(host=host, port=int(port), timeout=10)
me = str(uuid.uuid4())
deliveries = queue.Queue()
watch_id = client.add_watch_callback(f"/q/py3/c/{me}", deliveries.put)
put = client.put("/q/py3/p/job-1", "payload")
response = deliveries.get(timeout=10)
(event,) = response.events
acked = client.delete(event.key)
acked_again = client.delete(event.key)
client.cancel_watch(watch_id)
left = sorted((m.key.decode(), v.decode()) for v, m in client.get_prefix("/q/py3"))
print(json.dumps({
    "consumer": me,
    "type": type(event).__name__,
    "key": event.key.decode(),
    "value": event.value.decode(),
    "put_revision": put.header.revision,
    "mod_revision": event.mod_revision,
    "acked": acked,
    "acked_again": acked_again,
    "left": left,
}))
sys.stdout.flush()
"""


def test_etcd3_client_happy_path(server: ServerProcess, tmp_path: Any) -> None:
    env = {**os.environ, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": "python"}
    env.pop("PYTHONPATH", None)  # the child must not import our etcdserverpb
    proc = subprocess.run(
        [sys.executable, "-c", ETCD3_SCENARIO, server.endpoint],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[0])
    node = server.data_dir.name
    assert out["type"] == "PutEvent"
    assert out["key"] == "/q/py3/0000000000000001/job-1"
    assert out["value"] == "payload"
    assert out["mod_revision"] == out["put_revision"]
    assert (out["acked"], out["acked_again"]) == (True, False)
    # the registry key stays; the consumer's may still be there (its delete is
    # proposed when the watch is cancelled), the message is gone
    assert ["/q/py3", node] in out["left"]
    assert all(key in ("/q/py3", f"/q/py3/c/{out['consumer']}") for key, _ in out["left"])
