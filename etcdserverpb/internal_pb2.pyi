from etcdserverpb import rpc_pb2 as _rpc_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Command(_message.Message):
    __slots__ = ("put", "delete_range", "txn", "compaction", "lease_grant", "lease_revoke", "alarm", "queue_requeue")
    PUT_FIELD_NUMBER: _ClassVar[int]
    DELETE_RANGE_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANT_FIELD_NUMBER: _ClassVar[int]
    LEASE_REVOKE_FIELD_NUMBER: _ClassVar[int]
    ALARM_FIELD_NUMBER: _ClassVar[int]
    QUEUE_REQUEUE_FIELD_NUMBER: _ClassVar[int]
    put: _rpc_pb2.PutRequest
    delete_range: _rpc_pb2.DeleteRangeRequest
    txn: _rpc_pb2.TxnRequest
    compaction: _rpc_pb2.CompactionRequest
    lease_grant: _rpc_pb2.LeaseGrantRequest
    lease_revoke: _rpc_pb2.LeaseRevokeRequest
    alarm: _rpc_pb2.AlarmRequest
    queue_requeue: QueueRequeue
    def __init__(self, put: _Optional[_Union[_rpc_pb2.PutRequest, _Mapping]] = ..., delete_range: _Optional[_Union[_rpc_pb2.DeleteRangeRequest, _Mapping]] = ..., txn: _Optional[_Union[_rpc_pb2.TxnRequest, _Mapping]] = ..., compaction: _Optional[_Union[_rpc_pb2.CompactionRequest, _Mapping]] = ..., lease_grant: _Optional[_Union[_rpc_pb2.LeaseGrantRequest, _Mapping]] = ..., lease_revoke: _Optional[_Union[_rpc_pb2.LeaseRevokeRequest, _Mapping]] = ..., alarm: _Optional[_Union[_rpc_pb2.AlarmRequest, _Mapping]] = ..., queue_requeue: _Optional[_Union[QueueRequeue, _Mapping]] = ...) -> None: ...

class QueueRequeue(_message.Message):
    __slots__ = ("queue", "idx")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    IDX_FIELD_NUMBER: _ClassVar[int]
    queue: bytes
    idx: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, queue: _Optional[bytes] = ..., idx: _Optional[_Iterable[int]] = ...) -> None: ...

class QueueRequeueResponse(_message.Message):
    __slots__ = ("dead_lettered",)
    DEAD_LETTERED_FIELD_NUMBER: _ClassVar[int]
    dead_lettered: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dead_lettered: _Optional[_Iterable[int]] = ...) -> None: ...
