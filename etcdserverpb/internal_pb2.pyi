from etcdserverpb import rpc_pb2 as _rpc_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Command(_message.Message):
    __slots__ = ("put", "delete_range", "txn", "compaction", "lease_grant", "lease_revoke", "alarm")
    PUT_FIELD_NUMBER: _ClassVar[int]
    DELETE_RANGE_FIELD_NUMBER: _ClassVar[int]
    TXN_FIELD_NUMBER: _ClassVar[int]
    COMPACTION_FIELD_NUMBER: _ClassVar[int]
    LEASE_GRANT_FIELD_NUMBER: _ClassVar[int]
    LEASE_REVOKE_FIELD_NUMBER: _ClassVar[int]
    ALARM_FIELD_NUMBER: _ClassVar[int]
    put: _rpc_pb2.PutRequest
    delete_range: _rpc_pb2.DeleteRangeRequest
    txn: _rpc_pb2.TxnRequest
    compaction: _rpc_pb2.CompactionRequest
    lease_grant: _rpc_pb2.LeaseGrantRequest
    lease_revoke: _rpc_pb2.LeaseRevokeRequest
    alarm: _rpc_pb2.AlarmRequest
    def __init__(self, put: _Optional[_Union[_rpc_pb2.PutRequest, _Mapping]] = ..., delete_range: _Optional[_Union[_rpc_pb2.DeleteRangeRequest, _Mapping]] = ..., txn: _Optional[_Union[_rpc_pb2.TxnRequest, _Mapping]] = ..., compaction: _Optional[_Union[_rpc_pb2.CompactionRequest, _Mapping]] = ..., lease_grant: _Optional[_Union[_rpc_pb2.LeaseGrantRequest, _Mapping]] = ..., lease_revoke: _Optional[_Union[_rpc_pb2.LeaseRevokeRequest, _Mapping]] = ..., alarm: _Optional[_Union[_rpc_pb2.AlarmRequest, _Mapping]] = ...) -> None: ...
