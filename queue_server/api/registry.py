"""Registering servicers with the gRPC server as generic handlers only.

grpcio (1.6x and later) also offers "registered methods": for each of them the aio
server keeps a pending request-call task, and for every incoming RPC it waits on
all those tasks at once (`asyncio.wait(..., FIRST_COMPLETED)`), a cost linear in
the number of methods. With the ~33 methods of etcd's services that wait cost
more CPU per call than our whole Range; generic handlers keep one pending task.
Measured on the put path: see docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grpc import aio


class GenericHandlersOnly:
    """Stands in for the server in a generated `add_*Servicer_to_server` call:
    passes the generic handler on and drops the registered-method handlers."""

    def __init__(self, server: aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Not registered: see the module docstring."""
