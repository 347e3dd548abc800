import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DtoChangeNotification(_message.Message):
    __slots__ = ("ack_token", "dto_type", "dto_id", "parent_id", "alias_name", "sla_timestamp", "tracking_id")
    ACK_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DTO_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTO_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ALIAS_NAME_FIELD_NUMBER: _ClassVar[int]
    SLA_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    TRACKING_ID_FIELD_NUMBER: _ClassVar[int]
    ack_token: str
    dto_type: str
    dto_id: str
    parent_id: str
    alias_name: str
    sla_timestamp: _timestamp_pb2.Timestamp
    tracking_id: str
    def __init__(self, ack_token: _Optional[str] = ..., dto_type: _Optional[str] = ..., dto_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., alias_name: _Optional[str] = ..., sla_timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., tracking_id: _Optional[str] = ...) -> None: ...

class CreateOrConfigureQueueRequest(_message.Message):
    __slots__ = ("queue_name", "subscriptions", "depth")
    QUEUE_NAME_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    queue_name: str
    subscriptions: _containers.RepeatedCompositeFieldContainer[DtoTypeSubscription]
    depth: int
    def __init__(self, queue_name: _Optional[str] = ..., subscriptions: _Optional[_Iterable[_Union[DtoTypeSubscription, _Mapping]]] = ..., depth: _Optional[int] = ...) -> None: ...

class DtoTypeSubscription(_message.Message):
    __slots__ = ("dto_type", "alias_name")
    DTO_TYPE_FIELD_NUMBER: _ClassVar[int]
    ALIAS_NAME_FIELD_NUMBER: _ClassVar[int]
    dto_type: str
    alias_name: str
    def __init__(self, dto_type: _Optional[str] = ..., alias_name: _Optional[str] = ...) -> None: ...

class CreateOrConfigureQueueResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchDequeueRequest(_message.Message):
    __slots__ = ("queue_name", "max_notifications", "prefix_depth", "wait_time_milliseconds")
    QUEUE_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WAIT_TIME_MILLISECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_name: str
    max_notifications: int
    prefix_depth: int
    wait_time_milliseconds: int
    def __init__(self, queue_name: _Optional[str] = ..., max_notifications: _Optional[int] = ..., prefix_depth: _Optional[int] = ..., wait_time_milliseconds: _Optional[int] = ...) -> None: ...

class BatchDequeueResponse(_message.Message):
    __slots__ = ("notifications",)
    NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    notifications: _containers.RepeatedCompositeFieldContainer[DtoChangeNotification]
    def __init__(self, notifications: _Optional[_Iterable[_Union[DtoChangeNotification, _Mapping]]] = ...) -> None: ...

class BatchAcknowledgeRequest(_message.Message):
    __slots__ = ("queue_name", "ack_tokens")
    QUEUE_NAME_FIELD_NUMBER: _ClassVar[int]
    ACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    queue_name: str
    ack_tokens: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, queue_name: _Optional[str] = ..., ack_tokens: _Optional[_Iterable[str]] = ...) -> None: ...

class BatchAcknowledgeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReEnqueueRequest(_message.Message):
    __slots__ = ("header", "item", "footer")
    class Header(_message.Message):
        __slots__ = ("queue_name", "ack_token")
        QUEUE_NAME_FIELD_NUMBER: _ClassVar[int]
        ACK_TOKEN_FIELD_NUMBER: _ClassVar[int]
        queue_name: str
        ack_token: str
        def __init__(self, queue_name: _Optional[str] = ..., ack_token: _Optional[str] = ...) -> None: ...
    class Footer(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    FOOTER_FIELD_NUMBER: _ClassVar[int]
    header: ReEnqueueRequest.Header
    item: SplitItem
    footer: ReEnqueueRequest.Footer
    def __init__(self, header: _Optional[_Union[ReEnqueueRequest.Header, _Mapping]] = ..., item: _Optional[_Union[SplitItem, _Mapping]] = ..., footer: _Optional[_Union[ReEnqueueRequest.Footer, _Mapping]] = ...) -> None: ...

class SplitItem(_message.Message):
    __slots__ = ("dto_type", "dto_id", "parent_id", "alias_name")
    DTO_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTO_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ALIAS_NAME_FIELD_NUMBER: _ClassVar[int]
    dto_type: str
    dto_id: str
    parent_id: str
    alias_name: str
    def __init__(self, dto_type: _Optional[str] = ..., dto_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., alias_name: _Optional[str] = ...) -> None: ...

class ReEnqueueResponse(_message.Message):
    __slots__ = ("acknowledged", "items_enqueued")
    ACKNOWLEDGED_FIELD_NUMBER: _ClassVar[int]
    ITEMS_ENQUEUED_FIELD_NUMBER: _ClassVar[int]
    acknowledged: bool
    items_enqueued: int
    def __init__(self, acknowledged: _Optional[bool] = ..., items_enqueued: _Optional[int] = ...) -> None: ...
