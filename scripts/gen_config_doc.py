"""Write docs/configuration.md from the server's CLI definition.

    python scripts/gen_config_doc.py          # rewrite the page
    python scripts/gen_config_doc.py --check  # exit 1 if the page is stale

The page is generated so that it cannot drift from `queue_server/config.py`:
tests/unit/test_config_doc.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from queue_server.config import build_parser  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"

HEADER = """# Configuration

Generated from `queue_server/config.py` by `python scripts/gen_config_doc.py`; do not
edit by hand (a test fails when this page is stale).

Every flag can also be set by an environment variable: `ETCD_` and the flag's name in
upper case with dashes as underscores (`--data-dir` is `ETCD_DATA_DIR`). A flag given
on the command line wins over the variable. Durations are Go-style (`500ms`, `5s`,
`1m30s`, `1.5h`: the text a queue's `ack_deadline` takes too); lists are comma-separated.

| flag | variable | default | what it does |
|---|---|---|---|
"""


def render() -> str:
    rows = []
    for action in build_parser()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        var = "ETCD_" + action.dest.upper()
        blank = action.default in (None, "", argparse.SUPPRESS)
        default = "" if blank else f"`{action.default}`"
        text = (action.help or "").replace("|", "\\|")
        if action.choices:
            text += " (one of " + ", ".join(f"`{c}`" for c in action.choices) + ")"
        rows.append(f"| `{flag}` | `{var}` | {default} | {text} |")
    return HEADER + "\n".join(rows) + "\n"


def main() -> int:
    page = render()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python scripts/gen_config_doc.py")
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
