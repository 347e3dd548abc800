"""Raft consensus as an I/O-free core (etcd-`raft` style: step, tick, propose, ready,
advance) plus a deterministic simulator to test it. See `cluster.raft.core` for the
driver's contract."""

from cluster.raft.core import (
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
from cluster.raft.log import LogSafetyError
from cluster.raft.messages import (
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
from cluster.raft.progress import Progress, ProgressState

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
