"""Raft consensus as an I/O-free library (etcd-`raft` style: step, tick, propose,
ready, advance): it reads no clock, touches no disk or socket, and imports nothing
of the server. `raft.core`'s docstring is the driver's contract (the Ready
contract); `raft.messages` owns the versioned binary encodings of entries, hard
state, snapshots and messages. Its deterministic simulator lives with its tests
(`tests/support/raft_sim.py`); the server's driver is
`queue_server/replication/driver.py`."""

from raft.core import (
    TRANSFER_CONTEXT,
    ConfChangePending,
    NotLeader,
    ProposalDropped,
    RaftCore,
    RaftError,
    ReadState,
    Ready,
    Role,
)
from raft.log import LogSafetyError
from raft.messages import (
    FORMAT_VERSION,
    ConfChange,
    ConfChangeOp,
    DecodeError,
    Entry,
    EntryKind,
    HardState,
    Message,
    MessageType,
    Snapshot,
    SnapshotMeta,
)
from raft.progress import Progress, ProgressState

__all__ = [
    "FORMAT_VERSION",
    "TRANSFER_CONTEXT",
    "ConfChange",
    "ConfChangeOp",
    "ConfChangePending",
    "DecodeError",
    "Entry",
    "EntryKind",
    "HardState",
    "LogSafetyError",
    "Message",
    "MessageType",
    "NotLeader",
    "Progress",
    "ProgressState",
    "ProposalDropped",
    "RaftCore",
    "RaftError",
    "ReadState",
    "Ready",
    "Role",
    "Snapshot",
    "SnapshotMeta",
]
