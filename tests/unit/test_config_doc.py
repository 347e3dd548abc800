"""docs/configuration.md is generated from the CLI definition and must not be stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_matches_the_cli() -> None:
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_doc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_flag_is_on_the_page() -> None:
    from queue_server.config import build_parser

    page = (ROOT / "docs" / "configuration.md").read_text()
    for action in build_parser()._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                assert f"`{flag}`" in page, flag
