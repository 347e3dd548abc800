"""Run the h2spec HTTP/2 conformance tester against several servers and compare them case by case.

The servers are real etcd (Debian's ``etcd``), queue-server with its grpcio transport, and
queue-server with its native transport (``--grpc-transport native``). Each one is started
fresh (temporary data dir, free ports on 127.0.0.1), waited for until it answers a gRPC
``KV/Range``, tested, and stopped by its pid (SIGTERM, then SIGKILL after a bounded wait).

h2spec runs one section at a time (a section is one group of cases, such as ``http2/6.5``;
its sub-groups, such as ``http2/6.5.2``, are sections of their own), with a per-case
timeout (``-o``) and a subprocess timeout, and writes a JUnit report that is parsed for
the results. When a section does not finish in time (``http2/5.1.2`` opens streams up to
the advertised limit, which is 2^31 or more for a gRPC server, so it never ends) or ends
without a report, its cases are run one by one; a case that still does not finish is
recorded as ``timeout``. If the server exits during a section, the exit is noted, a fresh
server is started, and the section is run once more.

A server that cannot be started is reported as unavailable instead of failing the run. In
particular, when queue-server rejects ``--grpc-transport`` (a build without the flag, or
without the ``native`` choice), the ``native`` column is unavailable and ``grpcio`` runs
without the flag (grpcio being the only transport such a build has).

Many h2spec cases send a plain ``GET /`` or ``POST /`` and expect a response with a DATA
frame; a pure gRPC server (etcd included) fails some of them by design, which is why the
comparison with etcd on the same run matters more than the absolute numbers.

Usage (from the repository root; h2spec is built by
``scripts/build_h2spec.sh /tmp/tools/h2spec-run``, our driver over the h2spec library in
``$QS_SHARED_TOOLS/h2spec``, default ../shared/tools/h2spec)::

    python scripts/h2spec_compare.py [--h2spec PATH] [--servers etcd,grpcio,native]
                                     [--out FILE.md] [--json FILE]

The Markdown report goes to ``--out`` (or stdout); progress goes to stderr. The exit
status is 0 when the run completed (whatever the test results), 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The checkout this script is in: queue-server runs from here unless --queue-server-dir."""
SPECS = ("generic", "http2", "hpack")
ALL_SERVERS = ("etcd", "grpcio", "native")
DEFAULT_H2SPEC_PATHS = ("/tmp/tools/h2spec-run", "/tmp/tools/h2spec")

PASSED = "passed"
FAILED = "failed"
SKIPPED = "skipped"
TIMEOUT = "timeout"
"""h2spec itself did not finish the case within the subprocess timeout and was killed."""
ERROR = "error"
"""h2spec could not run the case (e.g. it could not connect); counted as failed."""
NOT_RUN = "not run"
"""The case was never attempted (server could not be restarted)."""
FAILING = frozenset({FAILED, TIMEOUT, ERROR})

_GROUP_LINE = re.compile(r"^\s*(\d+(?:\.\d+)*)\. (.+)$")
_CASE_LINE = re.compile(r"^\s*(\d+): (.+)$")


def log(message: str) -> None:
    """One progress line on stderr."""
    print(f"[h2spec-compare {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- catalogue


@dataclasses.dataclass(frozen=True)
class Case:
    """One h2spec test case, e.g. ``http2/6.5/1``."""

    id: str
    section: str
    seq: int
    desc: str


@dataclasses.dataclass(frozen=True)
class Section:
    """The cases of one h2spec group, without those of its sub-groups."""

    id: str
    title: str
    cases: tuple[Case, ...]


def load_catalogue(h2spec: str, specs: Sequence[str]) -> list[Section]:
    """The sections and cases h2spec would run (non-strict), from its ``--dryrun`` listing."""
    sections: list[Section] = []
    for spec in specs:
        proc = subprocess.run(
            [h2spec, "--dryrun", spec], capture_output=True, text=True, timeout=60, check=False
        )
        if proc.returncode != 0:
            raise RuntimeError(f"h2spec --dryrun {spec} failed: {proc.stdout}{proc.stderr}")
        sections += parse_dryrun(spec, proc.stdout)
    return sections


def parse_dryrun(spec: str, text: str) -> list[Section]:
    """``N. Title`` lines open a group, ``N: desc`` lines are cases of the latest group."""
    sections: list[Section] = []
    current: tuple[str, str] | None = None
    cases: list[Case] = []
    for line in [*text.splitlines(), "0. end"]:
        if m := _GROUP_LINE.match(line):
            if current is not None and cases:
                sections.append(Section(current[0], current[1], tuple(cases)))
            current = (f"{spec}/{m.group(1)}", m.group(2).strip())
            cases = []
        elif (m := _CASE_LINE.match(line)) and current is not None:
            seq = int(m.group(1))
            cases.append(Case(f"{current[0]}/{seq}", current[0], seq, m.group(2).strip()))
    return sections


def h2spec_version(h2spec: str) -> str:
    proc = subprocess.run(
        [h2spec, "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    return (proc.stdout + proc.stderr).strip() or "unknown"


# --------------------------------------------------------------------------- servers


@dataclasses.dataclass
class CaseResult:
    status: str
    message: str = ""
    seconds: float = 0.0


@dataclasses.dataclass
class ServerRun:
    """Everything measured for one server column."""

    name: str
    available: bool = True
    reason: str = ""
    command: list[str] = dataclasses.field(default_factory=list)
    version: str = ""
    notes: list[str] = dataclasses.field(default_factory=list)
    results: dict[str, CaseResult] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    """Wall time of the whole column: starts, all sections, stops."""
    test_seconds: float = 0.0
    """Wall time spent in h2spec only."""

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in (PASSED, FAILED, SKIPPED, TIMEOUT, ERROR, NOT_RUN)}
        for r in self.results.values():
            out[r.status] += 1
        return out


class ServerStartError(Exception):
    """The server exited or never became ready."""


class FlagRejected(ServerStartError):
    """queue-server refused ``--grpc-transport`` (unknown flag or unknown choice)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def child_env(source: Path) -> dict[str, str]:
    """The environment without ETCD_* variables (both etcd and queue-server read them as
    flags), with ``source`` first on PYTHONPATH so that queue-server runs from there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(source), env.get("PYTHONPATH")) if p)
    return env


def tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


_RANGE_REQUEST = b"\x0a\x0ch2spec-probe"
"""A serialized etcdserverpb.RangeRequest{key: "h2spec-probe"} (field 1, length 12)."""


def _identity(b: bytes) -> bytes:
    return b


class ServerProcess:
    """One started server: its process, ports, data dir and log."""

    def __init__(
        self, name: str, command: list[str], port: int, workdir: Path, source: Path
    ) -> None:
        self.name = name
        self.source = source
        self.command = command
        self.port = port
        self.workdir = workdir
        self.log_path = workdir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout: float) -> None:
        with self.log_path.open("wb") as logf:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=self.source,
                env=child_env(self.source),
                start_new_session=True,  # Ctrl-C reaches only us; we stop it ourselves
            )
        self._wait_ready(ready_timeout)

    def _wait_ready(self, ready_timeout: float) -> None:
        """Until a linearizable KV/Range answers: listening, and for etcd, a leader elected."""
        assert self.proc is not None
        deadline = time.monotonic() + ready_timeout
        last_error = "no attempt"
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            call = channel.unary_unary(
                "/etcdserverpb.KV/Range",
                request_serializer=_identity,
                response_deserializer=_identity,
            )
            while time.monotonic() < deadline:
                code = self.proc.poll()
                if code is not None:
                    text = tail(self.log_path, 30)
                    if "--grpc-transport" in text and (
                        "unrecognized arguments" in text or "invalid choice" in text
                    ):
                        errors = [ln for ln in text.splitlines() if "error:" in ln]
                        raise FlagRejected(errors[-1].strip() if errors else text)
                    raise ServerStartError(f"exited with status {code} before ready:\n{text}")
                try:
                    call(_RANGE_REQUEST, timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                    return
                except grpc.RpcError as e:
                    last_error = str(e.code()) if isinstance(e, grpc.Call) else repr(e)
                time.sleep(0.2)
        raise ServerStartError(
            f"not ready within {ready_timeout:.0f}s (last probe: {last_error}):\n"
            + tail(self.log_path)
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, stop_timeout: float) -> None:
        """SIGTERM to our pid, then SIGKILL to our pid after ``stop_timeout``; reaps it."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            log(f"[{self.name}] pid {proc.pid} ignored SIGTERM for {stop_timeout:.0f}s; SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@dataclasses.dataclass
class Options:
    h2spec: str
    etcd: str
    python: str
    case_timeout: int
    ready_timeout: float
    stop_timeout: float
    max_restarts: int
    workdir: Path
    source: Path
    """The queue-server source tree (holds queue_server/ and etcdserverpb/)."""


def server_command(
    name: str, opts: Options, workdir: Path, port: int, with_flag: bool
) -> list[str]:
    peer = free_port()
    client_url = f"http://127.0.0.1:{port}"
    peer_url = f"http://127.0.0.1:{peer}"
    data_dir = str(workdir / "data")
    if name == "etcd":
        return [
            opts.etcd,
            "--name=h2spec",
            f"--data-dir={data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=h2spec={peer_url}",
            "--initial-cluster-state=new",
        ]
    command = [
        opts.python,
        "-m",
        "queue_server.cli",
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        # a free peer port too: the default (localhost:2380) may be taken by anything else
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
    ]
    if with_flag:
        command += ["--grpc-transport", name]
    return command


class Column:
    """Starts (and restarts) the server of one column; keeps its ServerRun up to date."""

    def __init__(self, run: ServerRun, opts: Options) -> None:
        self.run = run
        self.opts = opts
        self.with_flag = run.name != "etcd"
        self.server: ServerProcess | None = None
        self.starts = 0

    def start(self) -> ServerProcess:
        self.starts += 1
        workdir = Path(
            tempfile.mkdtemp(prefix=f"{self.run.name}-{self.starts}-", dir=self.opts.workdir)
        )
        port = free_port()
        command = server_command(self.run.name, self.opts, workdir, port, self.with_flag)
        server = ServerProcess(self.run.name, command, port, workdir, self.opts.source)
        try:
            server.start(self.opts.ready_timeout)
        except BaseException as e:
            server.stop(self.opts.stop_timeout)
            if not isinstance(e, FlagRejected):
                raise
            if self.run.name != "grpcio" or not self.with_flag:
                raise
            self.run.notes.append(
                "this queue-server rejects `--grpc-transport` "
                f"({one_line(str(e))}); ran it without the flag (its only transport is grpcio)"
            )
            self.with_flag = False
            return self.start()
        self.run.command = command
        log(
            f"[{self.run.name}] ready on port {port} (pid {server.proc.pid if server.proc else '?'})"
        )
        self.server = server
        return server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(self.opts.stop_timeout)
            self.server = None


# --------------------------------------------------------------------------- h2spec runs


def one_line(text: str, limit: int = 300) -> str:
    s = " ".join(text.split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


def failure_message(content: str) -> str:
    """h2spec's ``Expected...\\nActual`` error text as one line."""
    lines = [ln.strip() for ln in content.strip().splitlines() if ln.strip()]
    if len(lines) >= 2:
        return one_line(f"expected {' / '.join(lines[:-1])}; actual {lines[-1]}")
    return one_line(content) or "failed"


def parse_junit(path: Path, wanted: Sequence[Case]) -> dict[str, CaseResult]:
    """Results by case id. h2spec's report has no case numbers: test cases come in sequence
    order, only for the cases that ran, and carry the description (checked against ours)."""
    by_section: dict[str, list[Case]] = {}
    for case in sorted(wanted, key=lambda c: (c.section, c.seq)):
        by_section.setdefault(case.section, []).append(case)
    out: dict[str, CaseResult] = {}
    root = ET.parse(path).getroot()
    for suite in root.iter("testsuite"):
        expected = by_section.get(suite.get("package", ""), [])
        testcases = suite.findall("testcase")
        if len(testcases) != len(expected):
            continue  # cannot map safely; the caller reruns what is missing
        for case, tc in zip(expected, testcases, strict=True):
            if tc.get("classname", "") != case.desc:
                break
            seconds = float(tc.get("time", "0") or 0)
            failure = tc.find("failure")
            if failure is None:
                failure = tc.find("error")
            if tc.find("skipped") is not None:
                out[case.id] = CaseResult(SKIPPED, "", seconds)
            elif failure is not None:
                out[case.id] = CaseResult(FAILED, failure_message(failure.text or ""), seconds)
            else:
                out[case.id] = CaseResult(PASSED, "", seconds)
    return out


def run_h2spec(
    opts: Options, port: int, cases: Sequence[Case], timeout: float
) -> tuple[dict[str, CaseResult], str | None]:
    """One h2spec process for ``cases``. Returns the parsed results and, when h2spec did
    not produce a report, why (``"timeout"`` or its last output line)."""
    fd, name = tempfile.mkstemp(prefix="junit-", suffix=".xml", dir=opts.workdir)
    os.close(fd)
    report = Path(name)
    report.unlink()
    command = [
        opts.h2spec,
        "-h",
        "127.0.0.1",
        "-p",
        str(port),
        "-o",
        str(opts.case_timeout),
        "-j",
        str(report),
        *(c.id for c in cases),
    ]
    try:
        proc = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        report.unlink(missing_ok=True)
        return {}, TIMEOUT
    try:
        if report.exists():
            return parse_junit(report, cases), None
    finally:
        report.unlink(missing_ok=True)
    output = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return {}, one_line(output[-1] if output else f"h2spec exited {proc.returncode}, no report")


def case_budget(opts: Options) -> float:
    """Longest a single case may legitimately take: a few waits of ``-o`` plus start-up."""
    return 3.0 * opts.case_timeout + 3.0


def run_section(opts: Options, port: int, section: Section) -> dict[str, CaseResult]:
    """The section in one h2spec process; what that leaves unknown, case by case."""
    results, problem = run_h2spec(
        opts, port, section.cases, 5.0 + case_budget(opts) * len(section.cases)
    )
    missing = [c for c in section.cases if c.id not in results]
    if not missing:
        return results
    if len(section.cases) > 1:
        log(f"  {section.id}: {problem or 'incomplete report'}; running its cases one by one")
        for case in missing:
            one, problem = run_h2spec(opts, port, [case], 5.0 + case_budget(opts))
            results.update(one)
            if case.id not in results:
                results[case.id] = problem_result(problem, 5.0 + case_budget(opts))
    else:
        results[missing[0].id] = problem_result(problem, 5.0 + case_budget(opts))
    return results


def problem_result(problem: str | None, timeout: float) -> CaseResult:
    if problem == TIMEOUT:
        return CaseResult(TIMEOUT, f"h2spec did not finish within {timeout:.0f}s (killed)", timeout)
    return CaseResult(ERROR, problem or "h2spec wrote no result for this case")


def run_column(name: str, sections: Sequence[Section], opts: Options) -> ServerRun:
    run = ServerRun(name)
    column = Column(run, opts)
    started = time.monotonic()
    try:
        try:
            server = column.start()
        except ServerStartError as e:
            run.available = False
            if isinstance(e, FlagRejected):
                run.reason = f"queue-server rejects `--grpc-transport {name}`: {one_line(str(e))}"
            else:
                run.reason = f"could not start: {one_line(str(e), 600)}"
            log(f"[{name}] unavailable: {run.reason}")
            return run
        run.version = server_version(name, opts)
        for section in sections:
            attempt = 0
            while True:
                t0 = time.monotonic()
                results = run_section(opts, server.port, section)
                run.test_seconds += time.monotonic() - t0
                if server.alive():
                    break
                attempt += 1
                note = f"server exited (status {server.exit_code()}) during {section.id}"
                log(f"[{name}] {note}:\n{tail(server.log_path)}")
                column.stop()
                if column.starts > opts.max_restarts:
                    run.notes.append(note + "; restart limit reached, later sections not run")
                    run.results.update(results)
                    for later in sections[sections.index(section) + 1 :]:
                        for c in later.cases:
                            run.results[c.id] = CaseResult(NOT_RUN, "server restart limit reached")
                    return run
                try:
                    server = column.start()
                except ServerStartError as e:
                    run.notes.append(note + f"; restart failed: {one_line(str(e))}")
                    run.results.update(results)
                    return run
                if attempt >= 2:
                    run.notes.append(note + " again on a fresh server; kept the second results")
                    break
                run.notes.append(note + "; section rerun on a fresh server")
            run.results.update(results)
            n = {s: sum(1 for r in results.values() if r.status == s) for s in (PASSED, SKIPPED)}
            bad = sum(1 for r in results.values() if r.status in FAILING)
            log(
                f"[{name}] {section.id}: {n[PASSED]} passed, {bad} failed, {n[SKIPPED]} skipped"
                f" ({time.monotonic() - t0:.1f}s)"
            )
    finally:
        column.stop()
        run.seconds = time.monotonic() - started
    return run


def server_version(name: str, opts: Options) -> str:
    try:
        if name == "etcd":
            proc = subprocess.run(
                [opts.etcd, "--version"], capture_output=True, text=True, timeout=30, check=False
            )
            return proc.stdout.splitlines()[0] if proc.stdout else ""
        head = subprocess.run(
            ["git", "-C", str(opts.source), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(opts.source), "status", "--porcelain", "--", "queue_server"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        ).stdout.strip()
        if not head:
            return f"queue-server from {opts.source} (not a git checkout)"
        return f"queue-server at {head}" + (
            " + uncommitted changes in queue_server/" if dirty else ""
        )
    except (OSError, subprocess.SubprocessError, IndexError):
        return ""


# --------------------------------------------------------------------------- reports


def cell(text: str) -> str:
    return one_line(text, 400).replace("|", "\\|")


def shown(result: CaseResult | None) -> str:
    if result is None:
        return "n/a"
    return {PASSED: "pass", FAILED: "FAIL", SKIPPED: "skip", TIMEOUT: "FAIL (timeout)"}.get(
        result.status, result.status.upper()
    )


def differing_cases(cases: Sequence[Case], runs: Sequence[ServerRun]) -> list[Case]:
    """Cases on which the available servers do not all have the same status."""
    avail = [r for r in runs if r.available]
    out = []
    for case in cases:
        statuses = {r.results[case.id].status if case.id in r.results else NOT_RUN for r in avail}
        if len(statuses) > 1:
            out.append(case)
    return out


def render_markdown(
    report: dict[str, Any], cases: Sequence[Case], runs: Sequence[ServerRun]
) -> str:
    names = [r.name for r in runs]
    lines = [
        "# h2spec conformance: " + " vs ".join(names),
        "",
        f"- date: {report['date']}",
        f"- h2spec: `{report['h2spec']}` ({report['h2spec_version']}), per-case timeout "
        f"`-o {report['case_timeout']}`, non-strict, specs: {', '.join(report['specs'])}",
        f"- host: {report['host']}",
        f"- cases: {len(cases)}",
        "",
    ]
    for r in runs:
        if r.available:
            lines.append(
                f"- **{r.name}**: {r.version or '?'}; `{' '.join(r.command)}`; "
                f"{r.seconds:.0f}s in all, {r.test_seconds:.0f}s of it in h2spec"
            )
        else:
            lines.append(f"- **{r.name}**: unavailable: {cell(r.reason)}")
        lines.extend(f"  - note: {cell(n)}" for n in r.notes)
    lines += [
        "",
        "## Summary",
        "",
        "Failed includes cases h2spec could not finish (timeout) or run (error).",
        "",
        "| server | passed | failed | skipped | time |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in runs:
        if not r.available:
            lines.append(f"| {r.name} | unavailable | | | |")
            continue
        n = r.counts()
        failed = n[FAILED] + n[TIMEOUT] + n[ERROR]
        extra = [f"{n[TIMEOUT]} timed out"] if n[TIMEOUT] else []
        extra += [f"{n[ERROR]} errors"] if n[ERROR] else []
        failed_cell = f"{failed} ({', '.join(extra)})" if extra else str(failed)
        skipped_cell = f"{n[SKIPPED]}" + (f" (+{n[NOT_RUN]} not run)" if n[NOT_RUN] else "")
        lines.append(
            f"| {r.name} | {n[PASSED]} | {failed_cell} | {skipped_cell} | {r.seconds:.0f}s |"
        )
    diffs = differing_cases(cases, runs)
    lines += ["", "## Cases where the servers differ", ""]
    if sum(1 for r in runs if r.available) < 2:
        lines.append("Fewer than two servers available: nothing to compare.")
    elif not diffs:
        lines.append("None: every case has the same result on every available server.")
    else:
        lines += [
            "| case | description | " + " | ".join(names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for case in diffs:
            row = [shown(r.results.get(case.id)) if r.available else "n/a" for r in runs]
            lines.append(f"| {case.id} | {cell(case.desc)} | " + " | ".join(row) + " |")
    lines += ["", "## Failures per server", ""]
    for r in runs:
        if not r.available:
            continue
        bad = [c for c in cases if c.id in r.results and r.results[c.id].status in FAILING]
        lines += [f"### {r.name}: {len(bad)} failing", ""]
        if bad:
            lines += ["| case | description | reason |", "|---|---|---|"]
            for c in bad:
                res = r.results[c.id]
                reason = res.message if res.status != TIMEOUT else f"timeout: {res.message}"
                lines.append(f"| {c.id} | {cell(c.desc)} | {cell(reason)} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def build_report(
    opts: Options, specs: Sequence[str], cases: Sequence[Case], runs: Sequence[ServerRun]
) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "h2spec": opts.h2spec,
        "h2spec_version": h2spec_version(opts.h2spec),
        "case_timeout": opts.case_timeout,
        "specs": list(specs),
        "host": f"{platform.node()} {platform.platform()}, {os.cpu_count()} CPUs",
        "cases": [dataclasses.asdict(c) for c in cases],
        "servers": {
            r.name: {
                "available": r.available,
                "reason": r.reason,
                "version": r.version,
                "command": r.command,
                "notes": r.notes,
                "seconds": round(r.seconds, 2),
                "test_seconds": round(r.test_seconds, 2),
                "counts": r.counts(),
                "results": {k: dataclasses.asdict(v) for k, v in r.results.items()},
            }
            for r in runs
        },
        "differences": [c.id for c in differing_cases(cases, runs)],
    }


# --------------------------------------------------------------------------- main


def find_h2spec(given: str | None) -> str | None:
    candidates = [given] if given else [os.environ.get("H2SPEC", ""), "h2spec"]
    candidates += [] if given else list(DEFAULT_H2SPEC_PATHS)
    for c in candidates:
        if c and (found := shutil.which(c)):
            return found
    return None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run h2spec against etcd and queue-server (grpcio, native) and compare.",
    )
    p.add_argument(
        "--h2spec",
        help="h2spec binary (default: $H2SPEC, PATH, /tmp/tools/h2spec-run, /tmp/tools/h2spec)",
    )
    p.add_argument(
        "--servers",
        default=",".join(ALL_SERVERS),
        help="comma-separated columns, from etcd,grpcio,native (default: all three)",
    )
    p.add_argument("--out", type=Path, help="write the Markdown report here (default: stdout)")
    p.add_argument("--json", type=Path, help="also write the results as JSON here")
    p.add_argument(
        "--specs", default=",".join(SPECS), help="h2spec specs to run (default: all three)"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PREFIX",
        help="run only cases whose id starts with PREFIX, e.g. http2/6.5 (repeatable)",
    )
    p.add_argument("-o", "--case-timeout", type=int, default=2, help="h2spec -o, seconds (2)")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for a start")
    p.add_argument("--stop-timeout", type=float, default=10.0, help="seconds from SIGTERM to KILL")
    p.add_argument("--max-restarts", type=int, default=5, help="server restarts per column (5)")
    p.add_argument("--etcd", default="etcd", help="etcd binary (default: etcd on PATH)")
    p.add_argument("--python", default=sys.executable, help="Python that runs queue-server")
    p.add_argument(
        "--queue-server-dir",
        type=Path,
        default=REPO_ROOT,
        help="queue-server source tree to run (default: this checkout), e.g. an export of a "
        "commit made with `git archive HEAD | tar -x -C DIR`",
    )
    p.add_argument("--keep-dir", type=Path, help="keep data dirs and logs here (default: temp)")
    args = p.parse_args(argv)
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    bad = [s for s in args.server_list if s not in ALL_SERVERS]
    if bad or not args.server_list:
        p.error(f"--servers: unknown {bad}; choose from {','.join(ALL_SERVERS)}")
    args.spec_list = [s.strip() for s in args.specs.split(",") if s.strip()]
    if not args.spec_list or any(s not in SPECS for s in args.spec_list):
        p.error(f"--specs: choose from {','.join(SPECS)}")
    if args.case_timeout < 1:
        p.error("--case-timeout must be at least 1")
    return args


@contextlib.contextmanager
def work_directory(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="h2spec-compare-") as d:
        yield Path(d)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    h2spec = find_h2spec(args.h2spec)
    if h2spec is None:
        print(
            "h2spec not found: build it with `scripts/build_h2spec.sh "
            "/tmp/tools/h2spec-run` and/or pass --h2spec",
            file=sys.stderr,
        )
        return 2
    sections = load_catalogue(h2spec, args.spec_list)
    if args.only:
        sections = [
            Section(s.id, s.title, tuple(c for c in s.cases if c.id.startswith(tuple(args.only))))
            for s in sections
        ]
        sections = [s for s in sections if s.cases]
    cases = [c for s in sections for c in s.cases]
    log(f"{len(cases)} cases in {len(sections)} sections; servers: {', '.join(args.server_list)}")
    with work_directory(args.keep_dir) as workdir:
        opts = Options(
            h2spec=h2spec,
            etcd=args.etcd,
            python=args.python,
            case_timeout=args.case_timeout,
            ready_timeout=args.ready_timeout,
            stop_timeout=args.stop_timeout,
            max_restarts=args.max_restarts,
            workdir=workdir,
            source=args.queue_server_dir.resolve(),
        )
        runs = []
        for name in args.server_list:
            log(f"[{name}] starting")
            runs.append(run_column(name, sections, opts))
            log(f"[{name}] done in {runs[-1].seconds:.0f}s: {runs[-1].counts()}")
        report = build_report(opts, args.spec_list, cases, runs)
    markdown = render_markdown(report, cases, runs)
    if args.out:
        args.out.write_text(markdown)
        log(f"wrote {args.out}")
    else:
        sys.stdout.write(markdown)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
