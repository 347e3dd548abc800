"""Helpers of the storage tests: local logs opened, fed and killed, and data
dirs as the server before the LMDB backend left them.

A "crash" here is a process that stops (`die`): its event loop never runs
again, the threads finish the disk call they are in (as the kernel finishes a
write the process made), its files are closed (as the kernel closes them),
and nothing else of it runs: no close(), no checkpoint, no callback. A new
`StateMachine` and `LocalLog` then open the same data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from etcdserverpb import internal_pb2, rpc_pb2
from queue_server.apply import Applier, StateMachine
from queue_server.local_log import LocalLog
from queue_server.proposals import ApplyResult
from queue_server.storage.snapshot import SnapshotStore
from queue_server.storage.wal import WriteAheadLog

WAIT = 30.0
"""Seconds any one wait in these tests may take before it counts as a hang."""

Command = internal_pb2.Command


def put(key: bytes, value: bytes = b"v", lease: int = 0) -> Command:
    return Command(put=rpc_pb2.PutRequest(key=key, value=value, lease=lease))


def replayed(commands: list[Command]) -> StateMachine:
    """A state machine in memory that applied `commands` at indexes 1, 2, ..."""
    sm = StateMachine()
    for index, command in enumerate(commands, 1):
        sm.apply(index, command)
    return sm


def same_state(got: StateMachine, want: StateMachine) -> None:
    assert got.applied_index == want.applied_index
    assert got.store.revision == want.store.revision
    assert got.export_state() == want.export_state()
    assert got.store.hash_kv() == want.store.hash_kv()


class RecordingApplier(Applier):
    """The real applier, noting which indexes it applied (what recovery replayed)."""

    def __init__(self, state: StateMachine) -> None:
        super().__init__(state)
        self.indexes: list[int] = []

    def apply(self, index: int, command: Command) -> ApplyResult:
        self.indexes.append(index)
        return super().apply(index, command)


def open_log(data_dir: Path, **options: Any) -> tuple[StateMachine, LocalLog, RecordingApplier]:
    sm = StateMachine()
    applier = RecordingApplier(sm)
    log = LocalLog(str(data_dir), applier, **options)
    log.recover()
    return sm, log, applier


async def propose_all(log: LocalLog, commands: list[Command]) -> list[ApplyResult]:
    """Propose `commands` together (group commit) and return their results."""
    return list(await asyncio.wait_for(asyncio.gather(*map(log.propose, commands)), WAIT))


async def settled(log: LocalLog) -> None:
    """Wait for the checkpoint in flight, if any (bounded)."""
    while log._checkpoint is not None:
        await asyncio.wait_for(asyncio.shield(log._checkpoint), WAIT)


def stop_threads(*executors: ThreadPoolExecutor) -> None:
    """Let each executor's thread finish the call it is in (bounded), then let
    the threads end: what a dying process's disk calls amount to."""
    for executor in executors:
        executor.submit(int).result(timeout=WAIT)  # one worker: runs after what it holds
        executor.shutdown(wait=False)


def files(directory: str) -> dict[str, bytes]:
    """Every file under `directory` and its bytes (LMDB's lock file aside: its
    reader table changes with every read)."""
    found = {}
    for root, _dirs, names in os.walk(directory):
        for name in names:
            if name != "lock.mdb":
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    found[os.path.relpath(path, directory)] = f.read()
    return found


def die(log: LocalLog, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """The process running `log` (and `loop`, if it is not the test's) dies:
    the disk calls its threads are in finish, as the kernel finishes a write
    the process made; its files are closed, as the kernel closes them; and
    nothing of it runs again: no close(), no checkpoint, no callback.

    In this process the dead loop's coroutines are still objects, and dropping
    them would run their except/finally clauses whenever the collector gets to
    them: they are closed here instead, once the files are, and the data dir
    is checked to be exactly as the death left it."""
    stop_threads(log._writer, log._backend_thread)
    log.wal.close()
    log.backend.env.close()
    if loop is None:
        return
    on_disk = files(log.data_dir)
    for task in asyncio.all_tasks(loop):
        with contextlib.suppress(RuntimeError):  # a finally that awaits: nothing can run now
            task.get_coro().close()
    loop.close()
    assert files(log.data_dir) == on_disk


def legacy_data_dir(
    directory: Path, commands: list[Command], snapshots: list[int], trim: bool = True
) -> None:
    """A data dir as the server before the backend left it: snapshot files
    (`SnapshotStore.save` of an in-memory state machine's `export_state()`)
    at `snapshots`, the WAL rotated at each, and with `trim` the segments each
    covers deleted (without: as if every trim were cut short by a crash)."""
    sm = StateMachine()
    snaps = SnapshotStore(str(directory / "snap"))
    wal = WriteAheadLog(str(directory / "wal"))
    list(wal.replay(0))
    wal.open_for_append()
    for index, command in enumerate(commands, 1):
        sm.apply(index, command)
        wal.append([(index, command.SerializeToString())])
        if index in snapshots:
            snaps.save(index, sm.export_state())
            wal.rotate()
            if trim:
                wal.remove_covered(index)
    wal.close()
