from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Record(_message.Message):
    __slots__ = ("header", "mvcc", "keys", "leases", "alarms", "queue", "cqs_queue", "cqs_chunk", "members", "auth", "queue_chunk", "revisions")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MVCC_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ALARMS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    CQS_QUEUE_FIELD_NUMBER: _ClassVar[int]
    CQS_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    REVISIONS_FIELD_NUMBER: _ClassVar[int]
    header: Header
    mvcc: Mvcc
    keys: KeyChunk
    leases: LeaseChunk
    alarms: AlarmChunk
    queue: Queue
    cqs_queue: CqsQueue
    cqs_chunk: CqsChunk
    members: MemberChunk
    auth: Auth
    queue_chunk: QueueChunk
    revisions: RevisionChunk
    def __init__(self, header: _Optional[_Union[Header, _Mapping]] = ..., mvcc: _Optional[_Union[Mvcc, _Mapping]] = ..., keys: _Optional[_Union[KeyChunk, _Mapping]] = ..., leases: _Optional[_Union[LeaseChunk, _Mapping]] = ..., alarms: _Optional[_Union[AlarmChunk, _Mapping]] = ..., queue: _Optional[_Union[Queue, _Mapping]] = ..., cqs_queue: _Optional[_Union[CqsQueue, _Mapping]] = ..., cqs_chunk: _Optional[_Union[CqsChunk, _Mapping]] = ..., members: _Optional[_Union[MemberChunk, _Mapping]] = ..., auth: _Optional[_Union[Auth, _Mapping]] = ..., queue_chunk: _Optional[_Union[QueueChunk, _Mapping]] = ..., revisions: _Optional[_Union[RevisionChunk, _Mapping]] = ...) -> None: ...

class Header(_message.Message):
    __slots__ = ("format_version", "applied_index", "raft_term", "voters", "key_count", "lease_count", "alarm_count", "queue_count", "cqs_queue_count", "member_count")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_INDEX_FIELD_NUMBER: _ClassVar[int]
    RAFT_TERM_FIELD_NUMBER: _ClassVar[int]
    VOTERS_FIELD_NUMBER: _ClassVar[int]
    KEY_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_COUNT_FIELD_NUMBER: _ClassVar[int]
    ALARM_COUNT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_COUNT_FIELD_NUMBER: _ClassVar[int]
    CQS_QUEUE_COUNT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_COUNT_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    applied_index: int
    raft_term: int
    voters: _containers.RepeatedScalarFieldContainer[int]
    key_count: int
    lease_count: int
    alarm_count: int
    queue_count: int
    cqs_queue_count: int
    member_count: int
    def __init__(self, format_version: _Optional[int] = ..., applied_index: _Optional[int] = ..., raft_term: _Optional[int] = ..., voters: _Optional[_Iterable[int]] = ..., key_count: _Optional[int] = ..., lease_count: _Optional[int] = ..., alarm_count: _Optional[int] = ..., queue_count: _Optional[int] = ..., cqs_queue_count: _Optional[int] = ..., member_count: _Optional[int] = ...) -> None: ...

class Mvcc(_message.Message):
    __slots__ = ("revision", "compact_revision")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    COMPACT_REVISION_FIELD_NUMBER: _ClassVar[int]
    revision: int
    compact_revision: int
    def __init__(self, revision: _Optional[int] = ..., compact_revision: _Optional[int] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("revision", "sub", "tombstone", "create_revision", "mod_revision", "version", "value", "lease")
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SUB_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONE_FIELD_NUMBER: _ClassVar[int]
    CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    MOD_REVISION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    revision: int
    sub: int
    tombstone: bool
    create_revision: int
    mod_revision: int
    version: int
    value: bytes
    lease: int
    def __init__(self, revision: _Optional[int] = ..., sub: _Optional[int] = ..., tombstone: _Optional[bool] = ..., create_revision: _Optional[int] = ..., mod_revision: _Optional[int] = ..., version: _Optional[int] = ..., value: _Optional[bytes] = ..., lease: _Optional[int] = ...) -> None: ...

class KeyHistory(_message.Message):
    __slots__ = ("key", "changes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    def __init__(self, key: _Optional[bytes] = ..., changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ...) -> None: ...

class KeyChunk(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[KeyHistory]
    def __init__(self, keys: _Optional[_Iterable[_Union[KeyHistory, _Mapping]]] = ...) -> None: ...

class RevisionChunk(_message.Message):
    __slots__ = ("revision_keys", "values")
    REVISION_KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    revision_keys: _containers.RepeatedScalarFieldContainer[bytes]
    values: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, revision_keys: _Optional[_Iterable[bytes]] = ..., values: _Optional[_Iterable[bytes]] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "ttl")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    ttl: int
    def __init__(self, lease_id: _Optional[int] = ..., ttl: _Optional[int] = ...) -> None: ...

class LeaseChunk(_message.Message):
    __slots__ = ("leases",)
    LEASES_FIELD_NUMBER: _ClassVar[int]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    def __init__(self, leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ...) -> None: ...

class Alarm(_message.Message):
    __slots__ = ("member_id", "alarm")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ALARM_FIELD_NUMBER: _ClassVar[int]
    member_id: int
    alarm: int
    def __init__(self, member_id: _Optional[int] = ..., alarm: _Optional[int] = ...) -> None: ...

class AlarmChunk(_message.Message):
    __slots__ = ("alarms",)
    ALARMS_FIELD_NUMBER: _ClassVar[int]
    alarms: _containers.RepeatedCompositeFieldContainer[Alarm]
    def __init__(self, alarms: _Optional[_Iterable[_Union[Alarm, _Mapping]]] = ...) -> None: ...

class Attempt(_message.Message):
    __slots__ = ("idx", "count")
    IDX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    idx: int
    count: int
    def __init__(self, idx: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class Consumer(_message.Message):
    __slots__ = ("consumer_id", "node", "held")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    consumer_id: bytes
    node: bytes
    held: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, consumer_id: _Optional[bytes] = ..., node: _Optional[bytes] = ..., held: _Optional[_Iterable[int]] = ...) -> None: ...

class Queue(_message.Message):
    __slots__ = ("name", "spelling", "next_idx", "attempts", "next_consumer", "consumers", "produced_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPELLING_FIELD_NUMBER: _ClassVar[int]
    NEXT_IDX_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_CONSUMER_FIELD_NUMBER: _ClassVar[int]
    CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: bytes
    spelling: bytes
    next_idx: int
    attempts: _containers.RepeatedCompositeFieldContainer[Attempt]
    next_consumer: int
    consumers: _containers.RepeatedCompositeFieldContainer[Consumer]
    produced_count: int
    def __init__(self, name: _Optional[bytes] = ..., spelling: _Optional[bytes] = ..., next_idx: _Optional[int] = ..., attempts: _Optional[_Iterable[_Union[Attempt, _Mapping]]] = ..., next_consumer: _Optional[int] = ..., consumers: _Optional[_Iterable[_Union[Consumer, _Mapping]]] = ..., produced_count: _Optional[int] = ...) -> None: ...

class QueueChunk(_message.Message):
    __slots__ = ("produced_idx_delta", "produced_ms_delta")
    PRODUCED_IDX_DELTA_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_MS_DELTA_FIELD_NUMBER: _ClassVar[int]
    produced_idx_delta: _containers.RepeatedScalarFieldContainer[int]
    produced_ms_delta: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, produced_idx_delta: _Optional[_Iterable[int]] = ..., produced_ms_delta: _Optional[_Iterable[int]] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("dto_type", "alias_name")
    DTO_TYPE_FIELD_NUMBER: _ClassVar[int]
    ALIAS_NAME_FIELD_NUMBER: _ClassVar[int]
    dto_type: str
    alias_name: str
    def __init__(self, dto_type: _Optional[str] = ..., alias_name: _Optional[str] = ...) -> None: ...

class CqsQueue(_message.Message):
    __slots__ = ("name", "subscriptions", "prefetch", "depth", "seq", "pending_count", "in_flight_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PENDING_COUNT_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    subscriptions: _containers.RepeatedCompositeFieldContainer[Subscription]
    prefetch: int
    depth: int
    seq: int
    pending_count: int
    in_flight_count: int
    def __init__(self, name: _Optional[str] = ..., subscriptions: _Optional[_Iterable[_Union[Subscription, _Mapping]]] = ..., prefetch: _Optional[int] = ..., depth: _Optional[int] = ..., seq: _Optional[int] = ..., pending_count: _Optional[int] = ..., in_flight_count: _Optional[int] = ...) -> None: ...

class Notification(_message.Message):
    __slots__ = ("dto_type", "dto_id", "is_parent", "alias", "sla_us", "tracking_id", "seq")
    DTO_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTO_ID_FIELD_NUMBER: _ClassVar[int]
    IS_PARENT_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    SLA_US_FIELD_NUMBER: _ClassVar[int]
    TRACKING_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    dto_type: str
    dto_id: str
    is_parent: bool
    alias: str
    sla_us: int
    tracking_id: str
    seq: int
    def __init__(self, dto_type: _Optional[str] = ..., dto_id: _Optional[str] = ..., is_parent: _Optional[bool] = ..., alias: _Optional[str] = ..., sla_us: _Optional[int] = ..., tracking_id: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("token", "visible_at", "notification")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_AT_FIELD_NUMBER: _ClassVar[int]
    NOTIFICATION_FIELD_NUMBER: _ClassVar[int]
    token: str
    visible_at: int
    notification: Notification
    def __init__(self, token: _Optional[str] = ..., visible_at: _Optional[int] = ..., notification: _Optional[_Union[Notification, _Mapping]] = ...) -> None: ...

class CqsChunk(_message.Message):
    __slots__ = ("pending", "in_flight")
    PENDING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    pending: _containers.RepeatedCompositeFieldContainer[Notification]
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    def __init__(self, pending: _Optional[_Iterable[_Union[Notification, _Mapping]]] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("id", "name", "peer_urls", "client_urls")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PEER_URLS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_URLS_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    peer_urls: _containers.RepeatedScalarFieldContainer[str]
    client_urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., peer_urls: _Optional[_Iterable[str]] = ..., client_urls: _Optional[_Iterable[str]] = ...) -> None: ...

class MemberChunk(_message.Message):
    __slots__ = ("members",)
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ...) -> None: ...

class Permission(_message.Message):
    __slots__ = ("key", "range_end", "perm_type")
    KEY_FIELD_NUMBER: _ClassVar[int]
    RANGE_END_FIELD_NUMBER: _ClassVar[int]
    PERM_TYPE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    range_end: bytes
    perm_type: int
    def __init__(self, key: _Optional[bytes] = ..., range_end: _Optional[bytes] = ..., perm_type: _Optional[int] = ...) -> None: ...

class Role(_message.Message):
    __slots__ = ("name", "permissions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    permissions: _containers.RepeatedCompositeFieldContainer[Permission]
    def __init__(self, name: _Optional[str] = ..., permissions: _Optional[_Iterable[_Union[Permission, _Mapping]]] = ...) -> None: ...

class User(_message.Message):
    __slots__ = ("name", "password", "roles", "no_password", "credential_revision")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PASSWORD_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    NO_PASSWORD_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_REVISION_FIELD_NUMBER: _ClassVar[int]
    name: str
    password: bytes
    roles: _containers.RepeatedScalarFieldContainer[str]
    no_password: bool
    credential_revision: int
    def __init__(self, name: _Optional[str] = ..., password: _Optional[bytes] = ..., roles: _Optional[_Iterable[str]] = ..., no_password: _Optional[bool] = ..., credential_revision: _Optional[int] = ...) -> None: ...

class Auth(_message.Message):
    __slots__ = ("enabled", "revision", "enable_revision", "users", "roles")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    ENABLE_REVISION_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    revision: int
    enable_revision: int
    users: _containers.RepeatedCompositeFieldContainer[User]
    roles: _containers.RepeatedCompositeFieldContainer[Role]
    def __init__(self, enabled: _Optional[bool] = ..., revision: _Optional[int] = ..., enable_revision: _Optional[int] = ..., users: _Optional[_Iterable[_Union[User, _Mapping]]] = ..., roles: _Optional[_Iterable[_Union[Role, _Mapping]]] = ...) -> None: ...
