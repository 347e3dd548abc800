"""Independent HTTP/2 clients against the native transport: h2spec's
conformance cases (every case must pass) and nghttp2's `nghttp` and `h2load`.

h2spec-run is our driver over the h2spec library (`tools/h2spec-run`), built by
`scripts/build_h2spec.sh` from the library's sources in `$QS_SHARED_TOOLS/h2spec/upstream`
(`tests/support/shared_tools.py`; .ci/run builds it when they are there and sets H2SPEC).
Without H2SPEC and without those sources, the h2spec test is skipped, naming the variable.
nghttp and h2load come from Debian's nghttp2-client, which .ci/run installs.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from etcdserverpb import rpc_pb2
from tests.support import shared_tools
from tests.support.processes import ServerProcess

pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(
        os.environ.get("ETCD_GRPC_TRANSPORT") == "grpcio",
        reason="these check the native transport; the grpcio fallback is grpcio's HTTP/2",
    ),
]

ROOT = Path(__file__).resolve().parents[2]


def _need(tool: str, how: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing, but .ci/run installs it ({how})")
        pytest.skip(f"{tool} is not installed ({how})")
    return path


@pytest.fixture(scope="module")
def h2spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    given = os.environ.get("H2SPEC")
    if given:
        return given
    shared_tools.require("h2spec/upstream", "h2spec's library, which h2spec-run is built on")
    _need("go", "apt-get install golang-go; scripts/build_h2spec.sh builds h2spec-run")
    out = tmp_path_factory.mktemp("h2spec") / "h2spec-run"
    built = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_h2spec.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert built.returncode == 0, f"scripts/build_h2spec.sh failed:\n{built.stderr[-4000:]}"
    return str(out)


def _port(server: ServerProcess) -> int:
    return int(server.endpoint.rpartition(":")[2])


def test_every_h2spec_case_passes(server: ServerProcess, h2spec: str, tmp_path: Path) -> None:
    report = tmp_path / "h2spec.xml"
    run = subprocess.run(
        [h2spec, "-h", "127.0.0.1", "-p", str(_port(server)), "-o", "2", "-j", str(report)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    cases = ET.parse(report).getroot().iter("testcase")
    results = {
        f"{c.get('package')}/{c.get('classname')}: {c.get('name')}": [x.tag for x in c]
        for c in cases
    }
    failed = [name for name, tags in results.items() if "failure" in tags or "error" in tags]
    assert len(results) >= 146, run.stdout[-2000:]
    assert not failed, "\n".join(failed)
    assert run.returncode == 0, run.stdout[-2000:]


def _framed_range(key: bytes) -> bytes:
    message = rpc_pb2.RangeRequest(key=key).SerializeToString()
    return b"\x00" + struct.pack(">I", len(message)) + message


def _grpc_range(server: ServerProcess, body: Path) -> list[str]:
    """nghttp2's flags for a gRPC KV/Range call whose framed request is `body`."""
    return [
        "-d",
        str(body),
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        f"http://{server.endpoint}/etcdserverpb.KV/Range",
    ]


def test_nghttp_makes_a_grpc_call(server: ServerProcess, tmp_path: Path) -> None:
    nghttp = _need("nghttp", "apt-get install nghttp2-client")
    body = tmp_path / "range.bin"
    body.write_bytes(_framed_range(b"nghttp-key"))
    run = subprocess.run(
        [nghttp, "-v", *_grpc_range(server, body)],
        capture_output=True,
        timeout=30,
    )
    out = run.stdout.decode("latin-1")
    assert run.returncode == 0, out
    assert ":status: 200" in out
    assert "grpc-status: 0" in out
    assert "recv DATA frame" in out


def test_nghttp_plain_request_gets_415_with_a_body(server: ServerProcess) -> None:
    nghttp = _need("nghttp", "apt-get install nghttp2-client")
    run = subprocess.run(
        [nghttp, "-v", f"http://{server.endpoint}/"], capture_output=True, timeout=30
    )
    out = run.stdout.decode("latin-1")
    assert ":status: 415" in out
    assert "serves gRPC" in out


def test_h2load_drives_grpc_calls(server: ServerProcess, tmp_path: Path) -> None:
    h2load = _need("h2load", "apt-get install nghttp2-client")
    body = tmp_path / "range.bin"
    body.write_bytes(_framed_range(b"h2load-key"))
    run = subprocess.run(
        [h2load, "-n", "2000", "-c", "4", "-m", "8", *_grpc_range(server, body)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout
    assert "2000 succeeded, 0 failed, 0 errored" in run.stdout, run.stdout
    assert "2000 2xx" in run.stdout, run.stdout
