"""The package map in `queue_server/__init__.py` holds: every import points down it.

The map lists the parts top first; names on one line are one layer and must not
import each other. This test reads the map from the docstring and every import
statement (type-only ones included) from the sources, so the map cannot drift
from the code without failing here. `raft/`, the Raft library beside the
package, imports nothing of the server at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import queue_server

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
ENTRY = re.compile(r"^- ((?:`[^`]+`,? ?)+)")


def layers() -> dict[str, int]:
    """Part name -> its line in the map (0 = top)."""
    out: dict[str, int] = {}
    doc = queue_server.__doc__ or ""
    for line in doc.splitlines():
        m = ENTRY.match(line)
        if m is None:
            continue
        level = len(set(out.values()))
        for name in re.findall(r"`([^`]+)`", m.group(1)):
            out[name.removesuffix("/").removesuffix(".py")] = level
    return out


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return rel.parts[1] if len(rel.parts) > 1 else "__init__"


def imported_parts(tree: ast.AST) -> set[str]:
    """The parts of queue_server a module imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == "queue_server":
                modules = [f"queue_server.{a.name}" for a in node.names]
            else:
                modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        for m in modules:
            parts = m.split(".")
            if parts[0] == "queue_server" and len(parts) > 1:
                out.add(parts[1])
    return out


def sources() -> list[Path]:
    return sorted((ROOT / "queue_server").rglob("*.py"))


def test_the_map_names_every_part() -> None:
    level = layers()
    missing = {part_of(p) for p in sources()} - set(level) - {"__init__"}
    assert not missing, f"parts missing from the map in queue_server/__init__.py: {missing}"


def test_imports_point_down_the_map() -> None:
    level = layers()
    wrong: list[str] = []
    for path in sources():
        me = part_of(path)
        if me == "__init__":
            continue
        for target in imported_parts(ast.parse(path.read_text(), str(path))):
            if target == me or target not in level:
                continue
            if level[target] <= level[me]:
                how = "sideways" if level[target] == level[me] else "up"
                wrong.append(f"{path.relative_to(ROOT)} imports {target} ({how})")
    assert not wrong, "imports against the package map:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import() -> None:
    """The checker itself: an import of a higher part is caught."""
    tree = ast.parse("from queue_server.server import Server\nfrom queue_server import api\n")
    assert imported_parts(tree) == {"server", "api"}
    level = layers()
    assert level["server"] < level["mvcc"] and level["mq"] == level["cqs"]


def test_raft_imports_nothing_of_the_server() -> None:
    """raft/ is a library of its own: the algorithm, with no I/O and no server."""
    wrong: list[str] = []
    for path in sorted((ROOT / "raft").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                top = name.split(".")[0]
                if top in ("queue_server", "etcdserverpb", "tests", "grpc", "asyncio"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "raft/ must stand alone:\n" + "\n".join(wrong)


def test_storage_is_a_leaf() -> None:
    """storage/ (backend, WAL, snapshot files, revision names) imports nothing of
    the server outside itself, so its formats can be read and tested alone."""
    wrong: list[str] = []
    for path in sorted((ROOT / "queue_server" / "storage").rglob("*.py")):
        for target in imported_parts(ast.parse(path.read_text(), str(path))):
            if target != "storage":
                wrong.append(f"{path.relative_to(ROOT)} imports {target}")
    assert not wrong, "storage/ must be a leaf:\n" + "\n".join(wrong)
