"""Fixtures: a fresh server process per test module, and real etcd where installed."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.processes import EtcdProcess, FrontProcess, ServerProcess

# Keep etcdctl on the v3 API whatever the caller's environment says.
os.environ["ETCDCTL_API"] = "3"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A running server with an empty data dir, shared by the tests of one module."""
    srv = ServerProcess(tmp_path_factory.mktemp("srv") / "node1.etcd").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.endpoint) as ch:
        yield ch


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdProcess]:
    """A real etcd server (Debian's etcd-server) for side-by-side comparison."""
    if not EtcdProcess.available():
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed, but .ci/run installs it: CI must not skip this")
        pytest.skip("etcd (Debian's etcd-server) is not installed; .ci/run installs it")
    proc = EtcdProcess(tmp_path_factory.mktemp("etcd") / "ref.etcd").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontProcess]:
    """Our server as a front (--backend-endpoints) over a real etcd of its own:
    the client suites run through it expecting what etcd itself answers."""
    if not EtcdProcess.available():
        if os.environ.get("CI"):
            pytest.fail("etcd is not installed, but .ci/run installs it: CI must not skip this")
        pytest.skip("etcd (Debian's etcd-server) is not installed; .ci/run installs it")
    workdir = tmp_path_factory.mktemp("front")
    backend = EtcdProcess(workdir / "backend.etcd").start()
    proc = FrontProcess(workdir / "front.etcd", [backend.endpoint])
    proc.backend_etcd = backend
    proc.start()
    yield proc
    proc.stop()
    backend.stop()
