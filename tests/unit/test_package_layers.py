"""The package map in `queue_server/__init__.py` holds.

The map lists the layers top first, each with its parts; one side package,
`client/`, stands beside them. This test reads the map from the docstring and
every import statement (type-only ones included) from the sources, so the map
cannot drift from the code without failing here:

- every part is in the map, once, and every name in the map is a part;
- every import of a layered part points to a strictly lower layer (none
  sideways within a layer, none up);
- the map has no more layers than the longest chain of imports needs, and the
  chain it names is a real one;
- `client/` imports nothing of the package outside itself, nothing imports it,
  and importing it loads no other module of the package;
- `raft/`, the Raft library beside the package, imports nothing of the server.
"""

from __future__ import annotations

import ast
import functools
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import queue_server

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
LAYER = re.compile(r"^- layer (\d+): ")
SIDE = re.compile(r"^- beside the layers: ")
ENTRY = re.compile(r"^  - (`[^`]+`(?:, `[^`]+`)*)")
"""A part's entry: its name, or names joined by commas, first on a sub-bullet."""
CHAIN = re.compile(r"\(((?:[\w./]+ -> )+[\w./]+)\)")
CLIENT = "client"


@dataclass
class Map:
    level: dict[str, int]
    """Layered part -> its layer's number (0 = the bottom)."""
    side: set[str]
    """The parts beside the layers."""
    numbers: list[int]
    """The layers' numbers, in the order the map lists them."""
    repeated: list[str]
    """Names the map lists more than once."""


def name_of(entry: str) -> str:
    return entry.removesuffix("/").removesuffix(".py")


def read_map(doc: str | None = None) -> Map:
    """The map in `doc` (by default the package docstring)."""
    out = Map({}, set(), [], [])
    current: int | None = None  # None: beside the layers (or before the first)
    seen: set[str] = set()
    for line in (queue_server.__doc__ if doc is None else doc).splitlines():
        if m := LAYER.match(line):
            current = int(m.group(1))
            out.numbers.append(current)
            continue
        if SIDE.match(line):
            current = None
            continue
        m = ENTRY.match(line)
        if m is None:
            continue
        for entry in re.findall(r"`([^`]+)`", m.group(1)):
            name = name_of(entry)
            if name in seen:
                out.repeated.append(name)
            seen.add(name)
            if current is None:
                out.side.add(name)
            else:
                out.level[name] = current
    return out


def part_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    return rel.parts[1]  # a folder, a module, or "__init__" for the package's own


def imported_modules(tree: ast.AST) -> set[str]:
    """The modules of queue_server a module imports (`from queue_server import x`
    as `queue_server.x`)."""
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
        out.update(m for m in modules if m.split(".")[0] == "queue_server")
    return out


def imported_parts(tree: ast.AST) -> set[str]:
    """The parts of queue_server a module imports."""
    return {m.split(".")[1] for m in imported_modules(tree) if "." in m}


def sources() -> list[Path]:
    return sorted((ROOT / "queue_server").rglob("*.py"))


@functools.cache
def imports() -> dict[str, dict[str, list[str]]]:
    """Part -> each other part it imports -> the files that do."""
    out: dict[str, dict[str, list[str]]] = {}
    for path in sources():
        me = part_of(path)
        mine = out.setdefault(me, {})
        for target in imported_parts(ast.parse(path.read_text(), str(path))):
            if target != me:
                mine.setdefault(target, []).append(str(path.relative_to(ROOT)))
    return out


def longest_chain() -> list[str]:
    """The longest chain of imports between parts, importer first."""
    graph = imports()

    @functools.cache
    def chain(part: str) -> tuple[str, ...]:
        below = [chain(t) for t in graph.get(part, {})]
        return (part, *(max(below, key=len) if below else ()))

    return list(max((len(chain(p)), chain(p)) for p in graph)[1])


def test_the_map_reads() -> None:
    layout = read_map()
    assert not layout.repeated, f"listed more than once: {layout.repeated}"
    top = len(layout.numbers) - 1
    assert layout.numbers == list(range(top, -1, -1)), (
        f"layers must be numbered top first down to 0: {layout.numbers}"
    )
    empty = set(layout.numbers) - set(layout.level.values())
    assert not empty, f"layers with no part: {sorted(empty)}"
    assert layout.side == {CLIENT}


def test_the_map_names_every_part_and_only_parts() -> None:
    layout = read_map()
    parts = {part_of(p) for p in sources()} - {"__init__"}
    named = set(layout.level) | layout.side
    assert not parts - named, f"parts missing from the map: {sorted(parts - named)}"
    assert not named - parts, f"the map names parts that do not exist: {sorted(named - parts)}"


def test_imports_point_strictly_down() -> None:
    level = read_map().level
    wrong: list[str] = []
    for me, targets in imports().items():
        if me not in level:
            continue
        for target, files in sorted(targets.items()):
            if target in level and level[target] >= level[me]:
                how = "sideways" if level[target] == level[me] else "up"
                wrong += [
                    f"{f} imports {target} ({how}: {level[me]} -> {level[target]})" for f in files
                ]
    assert not wrong, "imports against the package map:\n" + "\n".join(wrong)


def test_the_map_is_as_shallow_as_the_imports() -> None:
    """As many layers as the longest import chain has parts: every layer is
    needed. (Fewer cannot be: imports point strictly down.)"""
    layout = read_map()
    chain = longest_chain()
    print(f"{len(layout.numbers)} layers; longest chain: {' -> '.join(chain)}")
    assert len(chain) == len(layout.numbers), (
        f"the longest import chain has {len(chain)} parts ({' -> '.join(chain)}) but the "
        f"map has {len(layout.numbers)} layers: merge layers so they match"
    )
    named = CHAIN.search(" ".join((queue_server.__doc__ or "").split()))
    assert named is not None, "the map names its longest chain as (a -> b -> ...)"
    steps = [name_of(s) for s in named.group(1).split(" -> ")]
    graph = imports()
    broken = [f"{a} -> {b}" for a, b in itertools.pairwise(steps) if b not in graph[a]]
    assert not broken, f"the chain the map names is not an import chain: {broken}"
    assert len(steps) == len(chain), f"the map names a chain of {len(steps)}, not {len(chain)}"


def test_the_architecture_page_shows_the_same_layers() -> None:
    """docs/architecture.md draws the map as a table: it must match the docstring."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    section = page.split("## The package map", 1)[1].split("\n## ", 1)[0]
    drawn: dict[str, int] = {}
    for line in section.splitlines():
        if m := re.match(r"^(\d+)  (.+)$", line):
            drawn |= {name_of(n): int(m.group(1)) for n in m.group(2).split()}
    assert drawn == read_map().level, "docs/architecture.md, The package map, is out of date"


def test_the_check_sees_a_wrong_import() -> None:
    """The checker itself: imports are found, and layers read as numbered."""
    tree = ast.parse("from queue_server.server import Server\nfrom queue_server import api\n")
    assert imported_parts(tree) == {"server", "api"}
    doc = "- layer 1: top\n  - `a.py` x\n- layer 0: bottom\n  - `b/`, `c.py` y\n"
    doc += "- beside the layers: z\n  - `d/` w\n"
    layout = read_map(doc)
    assert layout.level == {"a": 1, "b": 0, "c": 0} and layout.side == {"d"}
    level = read_map().level
    assert level["server"] > level["api"] > level["mvcc"] and level["mq"] == level["cqs"]


def test_the_client_is_a_side_package() -> None:
    """client/ imports nothing of the package outside itself, and nothing in the
    package imports it: it could ship without the server."""
    wrong: list[str] = []
    for target, files in sorted(imports().get(CLIENT, {}).items()):
        wrong += [f"{f} imports {target}" for f in files]
    for _, targets in sorted(imports().items()):
        wrong += [f"{f} imports {CLIENT}" for f in targets.get(CLIENT, [])]
    init = ROOT / "queue_server" / "__init__.py"
    wrong += [
        f"queue_server/__init__.py imports {m}"
        for m in imported_modules(ast.parse(init.read_text()))
    ]
    assert not wrong, "client/ must stand beside the server:\n" + "\n".join(wrong)


def test_importing_the_client_loads_nothing_of_the_server() -> None:
    """`import queue_server.client` in a fresh interpreter loads, beyond the
    standard library, only grpc, protobuf, etcdserverpb and the client: what a
    client-only install would need."""
    probe = (
        "import sys, grpc, grpc.aio\n"
        "before = set(sys.modules)\n"
        "import queue_server.client\n"
        "print('\\n'.join(sorted(set(sys.modules) - before)))\n"
    )
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()

    def allowed(module: str) -> bool:
        top = module.split(".")[0]
        if top == "queue_server":
            return module == top or module.split(".")[1] == CLIENT
        if top == "google":  # protobuf's modules, and its C extension
            return module == top or module.split(".")[1] in ("protobuf", "_upb")
        return top in sys.stdlib_module_names or top in ("grpc", "etcdserverpb")

    assert "queue_server.client" in loaded
    extra = [m for m in loaded if not allowed(m)]
    assert not extra, f"import queue_server.client loads more than the client needs: {extra}"


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
    wrong = [f"{f} imports {t}" for t, fs in sorted(imports()["storage"].items()) for f in fs]
    assert not wrong, "storage/ must be a leaf:\n" + "\n".join(wrong)
