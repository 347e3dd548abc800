from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("wire_version", "from_member", "to_member")
    WIRE_VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_MEMBER_FIELD_NUMBER: _ClassVar[int]
    TO_MEMBER_FIELD_NUMBER: _ClassVar[int]
    wire_version: int
    from_member: int
    to_member: int
    def __init__(self, wire_version: _Optional[int] = ..., from_member: _Optional[int] = ..., to_member: _Optional[int] = ...) -> None: ...

class SnapshotStart(_message.Message):
    __slots__ = ("message", "size")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    message: bytes
    size: int
    def __init__(self, message: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class SnapshotChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class RaftBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, messages: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("command",)
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: bytes
    def __init__(self, command: _Optional[bytes] = ...) -> None: ...

class ConfChangeRequest(_message.Message):
    __slots__ = ("op", "member_id", "context")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ADD: _ClassVar[ConfChangeRequest.Op]
        REMOVE: _ClassVar[ConfChangeRequest.Op]
    ADD: ConfChangeRequest.Op
    REMOVE: ConfChangeRequest.Op
    OP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    op: ConfChangeRequest.Op
    member_id: int
    context: bytes
    def __init__(self, op: _Optional[_Union[ConfChangeRequest.Op, str]] = ..., member_id: _Optional[int] = ..., context: _Optional[bytes] = ...) -> None: ...

class LeaseKeepAlive(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class Request(_message.Message):
    __slots__ = ("id", "propose", "conf_change", "keep_alive")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_FIELD_NUMBER: _ClassVar[int]
    CONF_CHANGE_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    id: int
    propose: Proposal
    conf_change: ConfChangeRequest
    keep_alive: LeaseKeepAlive
    def __init__(self, id: _Optional[int] = ..., propose: _Optional[_Union[Proposal, _Mapping]] = ..., conf_change: _Optional[_Union[ConfChangeRequest, _Mapping]] = ..., keep_alive: _Optional[_Union[LeaseKeepAlive, _Mapping]] = ...) -> None: ...

class Placed(_message.Message):
    __slots__ = ("index", "term")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    index: int
    term: int
    def __init__(self, index: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("reason", "leader")
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    reason: str
    leader: int
    def __init__(self, reason: _Optional[str] = ..., leader: _Optional[int] = ...) -> None: ...

class KeepAliveAnswer(_message.Message):
    __slots__ = ("ttl",)
    TTL_FIELD_NUMBER: _ClassVar[int]
    ttl: int
    def __init__(self, ttl: _Optional[int] = ...) -> None: ...

class Answer(_message.Message):
    __slots__ = ("id", "placed", "refused", "keep_alive")
    ID_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    id: int
    placed: Placed
    refused: Refused
    keep_alive: KeepAliveAnswer
    def __init__(self, id: _Optional[int] = ..., placed: _Optional[_Union[Placed, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ..., keep_alive: _Optional[_Union[KeepAliveAnswer, _Mapping]] = ...) -> None: ...

class PeerFrame(_message.Message):
    __slots__ = ("hello", "raft", "request", "answer", "snapshot_start", "snapshot_chunk")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    RAFT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_START_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CHUNK_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    raft: RaftBatch
    request: Request
    answer: Answer
    snapshot_start: SnapshotStart
    snapshot_chunk: SnapshotChunk
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., raft: _Optional[_Union[RaftBatch, _Mapping]] = ..., request: _Optional[_Union[Request, _Mapping]] = ..., answer: _Optional[_Union[Answer, _Mapping]] = ..., snapshot_start: _Optional[_Union[SnapshotStart, _Mapping]] = ..., snapshot_chunk: _Optional[_Union[SnapshotChunk, _Mapping]] = ...) -> None: ...
