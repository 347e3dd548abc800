"""Where the third-party tool sources the tests and benchmarks build come from.

h2spec's library (`h2spec/upstream`, built into our driver `tools/h2spec-run` by
`scripts/build_h2spec.sh`) and etcd v3.4.23's benchmark tool (`etcd-benchmark/build.sh`) are not
copied into this repository. They are read from one folder, named by the environment variable
`QS_SHARED_TOOLS`, by default `../shared/tools`; a relative value is taken from the repository
root, whatever the current directory. `scripts/shared_tools.sh` is the same rule for the shell
scripts. Where a source is absent, `require` skips the test that needs it, naming the variable
and what is missing.

No pytest at import time: `benchmarks/` uses `shared_tools_dir` too, with only `.[bench]`.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "QS_SHARED_TOOLS"
DEFAULT = "../shared/tools"
REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_tools_dir() -> Path:
    """The folder `$QS_SHARED_TOOLS` names (default `../shared/tools`), absolute; it may not exist."""
    value = os.environ.get(ENV) or DEFAULT
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = REPO_ROOT / path
    return Path(os.path.normpath(path))


def describe() -> str:
    """`QS_SHARED_TOOLS=...` as set, or that it is unset and where the default points."""
    value = os.environ.get(ENV)
    if value:
        return f"{ENV}={value} ({shared_tools_dir()})"
    return f"{ENV} is unset, default {DEFAULT} ({shared_tools_dir()})"


def missing(relative: str, what: str) -> str | None:
    """Why `relative` under `$QS_SHARED_TOOLS` cannot be used, or None when it is there."""
    if (shared_tools_dir() / relative).exists():
        return None
    return (
        f"{what}: no {relative} in the third-party tool sources, {describe()}; "
        f"set {ENV} to the folder that holds {relative} (README, 'Third-party tools')"
    )


def require(relative: str, what: str) -> Path:
    """`relative` under `$QS_SHARED_TOOLS`, or skip the calling test saying what is missing."""
    reason = missing(relative, what)
    if reason is not None:
        import pytest

        pytest.skip(reason)
    return shared_tools_dir() / relative
