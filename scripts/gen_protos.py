"""Regenerate the Python protobuf/gRPC modules from ``etcdserverpb/*.proto``.

Runs ``grpc_tools.protoc`` with the repository root and grpc_tools' bundled
include directory as import paths, writing ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py`` next to the ``.proto`` files (the generated files are
committed). Every ``.proto`` in ``etcdserverpb/`` is compiled: the etcd protos,
``internal.proto`` and the Change Queue Service's ``cqs.proto``. Well-known
types (``google/protobuf/timestamp.proto``) resolve from grpc_tools' include
dir and are imported from ``google.protobuf`` at runtime, never generated here.

Usage::

    python scripts/gen_protos.py          # regenerate in place
    python scripts/gen_protos.py --check  # exit 1 if committed files are stale

Works from any working directory: the repository root is derived from the
location of this script.

The check compares the code, not the generator's release: generated modules
carry the version of grpcio-tools and protoc that made them (``GRPC_GENERATED_VERSION``,
``# Protobuf Python Version``, the numbers given to ``ValidateProtobufRuntimeVersion``),
and a patch release of grpcio-tools in the package registry changes those stamps
and nothing else. The stamps are the least grpcio and protobuf the committed code
runs on; ``tests/unit/test_protos_fresh.py`` checks that pyproject.toml asks for
at least those.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources, util
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT: Path = Path(__file__).resolve().parent.parent
PROTO_PACKAGE: str = "etcdserverpb"
GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
LOCAL_IMPORT_RE = re.compile(rf"^from {PROTO_PACKAGE} import (\w+) as ", re.MULTILINE)
VERSION_STAMPS: tuple[re.Pattern[bytes], ...] = (
    re.compile(rb"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", re.MULTILINE),
    re.compile(rb"^# Protobuf Python Version: ([0-9.]+)$", re.MULTILINE),
    re.compile(
        rb"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,"
        rb"((?:\s*\d+,){3})"
    ),
)
"""The generator's version, as each kind of generated module records it: group 1
is the version's text, its numbers in order."""


def proto_files() -> list[Path]:
    """Return the ``.proto`` sources, sorted, as absolute paths."""
    return sorted((REPO_ROOT / PROTO_PACKAGE).glob("*.proto"))


def grpc_tools_include() -> str:
    """Return grpc_tools' bundled include dir (well-known types)."""
    return str(resources.files("grpc_tools") / "_proto")


def is_generated(path: Path) -> bool:
    """True if ``path`` looks like an output of this script."""
    return path.name.endswith(GENERATED_SUFFIXES)


def generate(out_dir: Path) -> None:
    """Run protoc over all protos, writing outputs below ``out_dir``.

    Outputs land at ``out_dir/etcdserverpb/...`` because the protos are
    addressed relative to the repository root (``-I <root>``).
    """
    sources = proto_files()
    if not sources:
        raise SystemExit(f"no .proto files found in {REPO_ROOT / PROTO_PACKAGE}")
    args = [
        "grpc_tools.protoc",
        f"--proto_path={REPO_ROOT}",
        f"--proto_path={grpc_tools_include()}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in sources),
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    # Post-processing hook: nothing to rewrite with the pinned toolchain. The
    # generated modules already use package-qualified imports such as
    # ``from etcdserverpb import kv_pb2`` because of ``-I <root>``, and
    # ``from google.protobuf import timestamp_pb2`` for well-known types.
    check_local_imports(out_dir, {f"{p.stem}_pb2" for p in sources})


def check_local_imports(out_dir: Path, modules: set[str]) -> None:
    """Fail if generated code imports a bad module from ``etcdserverpb``.

    Bad means: not generated from one of our protos, or named like a
    well-known type (``timestamp_pb2``, ...), which must come from
    ``google.protobuf`` (grpc_tools' include dir), not from a local copy.
    """
    bad: list[str] = []
    for name, text in generated_files(out_dir).items():
        for imported in LOCAL_IMPORT_RE.findall(text.decode()):
            if imported not in modules or util.find_spec(f"google.protobuf.{imported}"):
                bad.append(f"{name}: from {PROTO_PACKAGE} import {imported}")
    if bad:
        raise SystemExit("generated code imports unknown local modules:\n  " + "\n  ".join(bad))


def generated_files(root: Path) -> dict[str, bytes]:
    """Map repo-relative path -> contents of generated files below ``root``."""
    pkg_dir = root / PROTO_PACKAGE
    if not pkg_dir.is_dir():
        return {}
    return {
        f"{PROTO_PACKAGE}/{p.name}": p.read_bytes()
        for p in sorted(pkg_dir.iterdir())
        if p.is_file() and is_generated(p)
    }


def without_version_stamps(text: bytes) -> bytes:
    """``text`` with the generator's version stamps blanked out."""
    for pattern in VERSION_STAMPS:
        text = pattern.sub(lambda m: m.group(0).replace(m.group(1), b"_"), text)
    return text


def version_stamps(text: bytes) -> list[tuple[int, ...]]:
    """The versions stamped into one generated module, as tuples of ints."""
    return [
        tuple(int(n) for n in re.findall(rb"\d+", m.group(1)))
        for pattern in VERSION_STAMPS
        for m in pattern.finditer(text)
    ]


def check() -> int:
    """Generate into a temp dir and compare with the committed files."""
    with tempfile.TemporaryDirectory(prefix="gen_protos_") as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
    committed = generated_files(REPO_ROOT)
    stale: list[str] = []
    for name in sorted(fresh.keys() | committed.keys()):
        if name not in committed:
            stale.append(f"{name} (missing)")
        elif name not in fresh:
            stale.append(f"{name} (no longer generated)")
        elif without_version_stamps(fresh[name]) != without_version_stamps(committed[name]):
            stale.append(f"{name} (differs)")
    if stale:
        print("Generated protobuf code is stale; run `python scripts/gen_protos.py`:")
        for entry in stale:
            print(f"  {entry}")
        return 1
    print(f"Generated protobuf code is up to date ({len(fresh)} files).")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not write; exit 1 if committed generated files are stale",
    )
    opts = parser.parse_args(argv)
    if opts.check:
        return check()
    generate(REPO_ROOT)
    print(f"Regenerated {len(generated_files(REPO_ROOT))} files in {PROTO_PACKAGE}/.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
