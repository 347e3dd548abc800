"""queue_server.client: a client library for both queues, asyncio and blocking.

A client of the server, over grpcio and the generated stubs in etcdserverpb;
nothing in the server imports it. Guide and examples: docs/client.md.

- `client.py`     `Client`, the asyncio entry point: endpoints, consumers,
                  producers, settings, redrive, CQS consumers.
- `queue.py`      the etcd-key queue: `Consumer` (a watch on `/q/{name}/c/{uuid}`,
                  reconnecting), `Message` (`ack`, `nack`, `extend`, `ack_with`),
                  `Producer` (batched puts in Txns), `configure`, `redrive`.
- `cqs.py`        the Change Queue Service: `CqsConsumer` (BatchDequeue,
                  BatchAcknowledge, seed 000's per-notification error rule) and
                  `ReEnqueue` (the Footer only on a clean exit).
- `sync.py`       `SyncClient` and its objects: the same API, blocking.
- `connection.py` channels to the endpoints and unary calls retried across them.
- `errors.py`     the library's exceptions and the transient/permanent rule.
"""

from queue_server.client.client import Client
from queue_server.client.connection import Connection
from queue_server.client.cqs import BatchOutcome, CqsConsumer, ReEnqueue
from queue_server.client.errors import (
    ClientError,
    ConsumerClosed,
    DeliveryLost,
    NoDeliveryLease,
    is_transient,
)
from queue_server.client.queue import (
    Consumer,
    Message,
    Producer,
    WatchRefused,
    produce_op,
    redrive_request,
)
from queue_server.client.sync import (
    SyncClient,
    SyncConsumer,
    SyncCqsConsumer,
    SyncMessage,
    SyncProducer,
    SyncReEnqueue,
)

__all__ = [
    "BatchOutcome",
    "Client",
    "ClientError",
    "Connection",
    "Consumer",
    "ConsumerClosed",
    "CqsConsumer",
    "DeliveryLost",
    "Message",
    "NoDeliveryLease",
    "Producer",
    "ReEnqueue",
    "SyncClient",
    "SyncConsumer",
    "SyncCqsConsumer",
    "SyncMessage",
    "SyncProducer",
    "SyncReEnqueue",
    "WatchRefused",
    "is_transient",
    "produce_op",
    "redrive_request",
]
