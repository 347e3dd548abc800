"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A three-member cluster of real processes, started and led; stopped after."""
    c = Cluster(tmp_path).start()
    try:
        yield c
    finally:
        c.stop()
