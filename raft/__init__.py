"""Raft consensus as an I/O-free core (etcd-`raft` style: step, tick, propose, ready,
advance) plus a deterministic simulator to test it. See `raft.core` for the
driver's contract."""

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
