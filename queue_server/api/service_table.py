"""The table of every method the client port serves, built from the servicers.

What belongs here: reading each service's methods (name, streaming shape,
request and response types) from the generated proto descriptors, and binding
them to a servicer instance's methods, so both transports route the same table.
A method the servicer leaves to its generated base class (MoveLeader,
Downgrade) answers UNIMPLEMENTED "Method not implemented!", as grpcio's
generated servicer does, without raising through the transport.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass

from queue_server.transport.methods import Call, Method
from queue_server.transport.status import Status

NOT_IMPLEMENTED = "Method not implemented!"
"""What grpcio's generated servicer says of a method it does not implement."""


async def _not_implemented(request: Any, call: Call) -> Any:
    await call.abort(Status.UNIMPLEMENTED, NOT_IMPLEMENTED)


def _implemented(servicer: object, name: str) -> bool:
    """Whether the servicer's own class (not a generated `*_pb2_grpc` base) defines `name`."""
    for cls in type(servicer).__mro__:
        if name in cls.__dict__:
            return not cls.__module__.endswith("_pb2_grpc")
    return False


def service_methods(service: ServiceDescriptor, servicer: object) -> list[Method]:
    """The methods of `service`, served by `servicer`; those the servicer names in
    its `waiting_methods` are marked `Method.waits` (a stop ends them at once)."""
    waiting: frozenset[str] = getattr(servicer, "waiting_methods", frozenset())
    methods = []
    for m in service.methods:
        request = GetMessageClass(m.input_type)
        response = GetMessageClass(m.output_type)
        handler = getattr(servicer, m.name) if _implemented(servicer, m.name) else _not_implemented
        methods.append(
            Method(
                service=service.full_name,
                name=m.name,
                request_streaming=m.client_streaming,
                response_streaming=m.server_streaming,
                parse=request.FromString,
                handler=handler,
                serialize=response.SerializeToString,
                request_class=request,
                response_class=response,
                waits=m.name in waiting,
            )
        )
    return methods
