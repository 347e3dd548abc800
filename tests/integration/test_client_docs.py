"""Every Python example in docs/client.md runs, in order, against a real server.

Each ```python block of the page is a complete program written for a server on
127.0.0.1:2379; the test points it at its own server and runs it in a process
of its own (bounded), as a reader would.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.integration

PAGE = REPO_ROOT / "docs" / "client.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
EXAMPLE_TIMEOUT = 60.0


def examples() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("client-docs") / "node1.etcd").start()
    yield srv
    srv.stop()


def test_the_page_has_examples() -> None:
    assert len(examples()) >= 7


def test_every_example_runs(server: ServerProcess, tmp_path: Path) -> None:
    outputs = []
    for i, code in enumerate(examples()):
        script = tmp_path / f"example_{i}.py"
        script.write_text(code.replace("127.0.0.1:2379", server.endpoint))
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=EXAMPLE_TIMEOUT,
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        assert done.returncode == 0, f"example {i} failed:\n{code}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    text = "".join(outputs)
    # what the examples print shows they did what the page says
    assert "b'job-17' b'resize photo 17'" in text
    assert "thumbnail for b'photo 2'" in text
    assert "deadline 60 s" in text and "delivery 2 of b'r2'" in text
    assert "will come back ['t/fm/s/oslo/esls/busy']" in text
    assert "parked t/fm/s/oslo/esls/bad" in text
    assert "split into 2 acknowledged True" in text
