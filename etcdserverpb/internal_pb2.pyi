from etcdserverpb import rpc_pb2 as _rpc_pb2
from etcdserverpb import cqs_pb2 as _cqs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Command(_message.Message):
    __slots__ = ("put", "delete_range", "txn", "compaction", "lease_grant", "lease_revoke", "alarm", "queue_requeue", "cqs_dequeue", "cqs_settle", "cqs_enqueue", "member_attributes", "auth", "now_ms")
    PUT_FIELD_NUMBER: _ClassVar[int]
    DELETE_RANGE_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANT_FIELD_NUMBER: _ClassVar[int]
    LEASE_REVOKE_FIELD_NUMBER: _ClassVar[int]
    ALARM_FIELD_NUMBER: _ClassVar[int]
    QUEUE_REQUEUE_FIELD_NUMBER: _ClassVar[int]
    CQS_DEQUEUE_FIELD_NUMBER: _ClassVar[int]
    CQS_SETTLE_FIELD_NUMBER: _ClassVar[int]
    CQS_ENQUEUE_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    AUTH_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    put: _rpc_pb2.PutRequest
    delete_range: _rpc_pb2.DeleteRangeRequest
    txn: _rpc_pb2.TxnRequest
    compaction: _rpc_pb2.CompactionRequest
    lease_grant: _rpc_pb2.LeaseGrantRequest
    lease_revoke: _rpc_pb2.LeaseRevokeRequest
    alarm: _rpc_pb2.AlarmRequest
    queue_requeue: QueueRequeue
    cqs_dequeue: CqsDequeue
    cqs_settle: CqsSettle
    cqs_enqueue: CqsEnqueue
    member_attributes: MemberAttributes
    auth: AuthCommand
    now_ms: int
    def __init__(self, put: _Optional[_Union[_rpc_pb2.PutRequest, _Mapping]] = ..., delete_range: _Optional[_Union[_rpc_pb2.DeleteRangeRequest, _Mapping]] = ..., txn: _Optional[_Union[_rpc_pb2.TxnRequest, _Mapping]] = ..., compaction: _Optional[_Union[_rpc_pb2.CompactionRequest, _Mapping]] = ..., lease_grant: _Optional[_Union[_rpc_pb2.LeaseGrantRequest, _Mapping]] = ..., lease_revoke: _Optional[_Union[_rpc_pb2.LeaseRevokeRequest, _Mapping]] = ..., alarm: _Optional[_Union[_rpc_pb2.AlarmRequest, _Mapping]] = ..., queue_requeue: _Optional[_Union[QueueRequeue, _Mapping]] = ..., cqs_dequeue: _Optional[_Union[CqsDequeue, _Mapping]] = ..., cqs_settle: _Optional[_Union[CqsSettle, _Mapping]] = ..., cqs_enqueue: _Optional[_Union[CqsEnqueue, _Mapping]] = ..., member_attributes: _Optional[_Union[MemberAttributes, _Mapping]] = ..., auth: _Optional[_Union[AuthCommand, _Mapping]] = ..., now_ms: _Optional[int] = ...) -> None: ...

class AuthCommand(_message.Message):
    __slots__ = ("auth_enable", "auth_disable", "user_add", "user_delete", "user_change_password", "user_grant_role", "user_revoke_role", "role_add", "role_delete", "role_grant_permission", "role_revoke_permission")
    AUTH_ENABLE_FIELD_NUMBER: _ClassVar[int]
    AUTH_DISABLE_FIELD_NUMBER: _ClassVar[int]
    USER_ADD_FIELD_NUMBER: _ClassVar[int]
    USER_DELETE_FIELD_NUMBER: _ClassVar[int]
    USER_CHANGE_PASSWORD_FIELD_NUMBER: _ClassVar[int]
    USER_GRANT_ROLE_FIELD_NUMBER: _ClassVar[int]
    USER_REVOKE_ROLE_FIELD_NUMBER: _ClassVar[int]
    ROLE_ADD_FIELD_NUMBER: _ClassVar[int]
    ROLE_DELETE_FIELD_NUMBER: _ClassVar[int]
    ROLE_GRANT_PERMISSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_REVOKE_PERMISSION_FIELD_NUMBER: _ClassVar[int]
    auth_enable: _rpc_pb2.AuthEnableRequest
    auth_disable: _rpc_pb2.AuthDisableRequest
    user_add: _rpc_pb2.AuthUserAddRequest
    user_delete: _rpc_pb2.AuthUserDeleteRequest
    user_change_password: _rpc_pb2.AuthUserChangePasswordRequest
    user_grant_role: _rpc_pb2.AuthUserGrantRoleRequest
    user_revoke_role: _rpc_pb2.AuthUserRevokeRoleRequest
    role_add: _rpc_pb2.AuthRoleAddRequest
    role_delete: _rpc_pb2.AuthRoleDeleteRequest
    role_grant_permission: _rpc_pb2.AuthRoleGrantPermissionRequest
    role_revoke_permission: _rpc_pb2.AuthRoleRevokePermissionRequest
    def __init__(self, auth_enable: _Optional[_Union[_rpc_pb2.AuthEnableRequest, _Mapping]] = ..., auth_disable: _Optional[_Union[_rpc_pb2.AuthDisableRequest, _Mapping]] = ..., user_add: _Optional[_Union[_rpc_pb2.AuthUserAddRequest, _Mapping]] = ..., user_delete: _Optional[_Union[_rpc_pb2.AuthUserDeleteRequest, _Mapping]] = ..., user_change_password: _Optional[_Union[_rpc_pb2.AuthUserChangePasswordRequest, _Mapping]] = ..., user_grant_role: _Optional[_Union[_rpc_pb2.AuthUserGrantRoleRequest, _Mapping]] = ..., user_revoke_role: _Optional[_Union[_rpc_pb2.AuthUserRevokeRoleRequest, _Mapping]] = ..., role_add: _Optional[_Union[_rpc_pb2.AuthRoleAddRequest, _Mapping]] = ..., role_delete: _Optional[_Union[_rpc_pb2.AuthRoleDeleteRequest, _Mapping]] = ..., role_grant_permission: _Optional[_Union[_rpc_pb2.AuthRoleGrantPermissionRequest, _Mapping]] = ..., role_revoke_permission: _Optional[_Union[_rpc_pb2.AuthRoleRevokePermissionRequest, _Mapping]] = ...) -> None: ...

class QueueRequeue(_message.Message):
    __slots__ = ("queue", "idx", "consumer")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    IDX_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    queue: bytes
    idx: _containers.RepeatedScalarFieldContainer[int]
    consumer: bytes
    def __init__(self, queue: _Optional[bytes] = ..., idx: _Optional[_Iterable[int]] = ..., consumer: _Optional[bytes] = ...) -> None: ...

class QueueRequeueResponse(_message.Message):
    __slots__ = ("dead_lettered",)
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    dead_lettered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dead_lettered: _Optional[_Iterable[int]] = ...) -> None: ...

class CqsDequeue(_message.Message):
    __slots__ = ("queue", "max", "depth", "now_ms", "visible_until_ms", "token_base")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BASE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    max: int
    depth: int
    now_ms: int
    visible_until_ms: int
    token_base: str
    def __init__(self, queue: _Optional[str] = ..., max: _Optional[int] = ..., depth: _Optional[int] = ..., now_ms: _Optional[int] = ..., visible_until_ms: _Optional[int] = ..., token_base: _Optional[str] = ...) -> None: ...

class CqsDequeueResponse(_message.Message):
    __slots__ = ("notifications", "seq")
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    notifications: _containers.RepeatedCompositeFieldContainer[_cqs_pb2.DtoChangeNotification]
    seq: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, notifications: _Optional[_Iterable[_Union[_cqs_pb2.DtoChangeNotification, _Mapping]]] = ..., seq: _Optional[_Iterable[int]] = ...) -> None: ...

class CqsSettle(_message.Message):
    __slots__ = ("queue", "tokens", "now_ms", "release")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    queue: str
    tokens: _containers.RepeatedScalarFieldContainer[str]
    now_ms: int
    release: bool
    def __init__(self, queue: _Optional[str] = ..., tokens: _Optional[_Iterable[str]] = ..., now_ms: _Optional[int] = ..., release: _Optional[bool] = ...) -> None: ...

class CqsSettleResponse(_message.Message):
    __slots__ = ("settled",)
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    settled: int
    def __init__(self, settled: _Optional[int] = ...) -> None: ...

class CqsEnqueue(_message.Message):
    __slots__ = ("queue", "original", "items", "now_ms", "visible_until_ms", "commit")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_UNTIL_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    queue: str
    original: str
    items: _containers.RepeatedCompositeFieldContainer[_cqs_pb2.SplitItem]
    now_ms: int
    visible_until_ms: int
    commit: bool
    def __init__(self, queue: _Optional[str] = ..., original: _Optional[str] = ..., items: _Optional[_Iterable[_Union[_cqs_pb2.SplitItem, _Mapping]]] = ..., now_ms: _Optional[int] = ..., visible_until_ms: _Optional[int] = ..., commit: _Optional[bool] = ...) -> None: ...

class CqsEnqueueResponse(_message.Message):
    __slots__ = ("enqueued",)
    ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    enqueued: int
    def __init__(self, enqueued: _Optional[int] = ...) -> None: ...

class MemberAttributes(_message.Message):
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
