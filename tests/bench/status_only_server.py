"""A stand-in server for the harness tests: it serves Maintenance.Status and nothing
else, so every other call (Watch, Lease, ...) answers UNIMPLEMENTED, as a server
that has not implemented a feature yet does.

Run as ``python -m tests.bench.status_only_server --port P``; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc


class StatusOnly(rpc_pb2_grpc.MaintenanceServicer):
    async def Status(
        self, request: rpc_pb2.StatusRequest, context: aio.ServicerContext[object, object]
    ) -> rpc_pb2.StatusResponse:
        return rpc_pb2.StatusResponse(version="status-only")


async def serve(port: int) -> None:
    server = aio.server()
    rpc_pb2_grpc.add_MaintenanceServicer_to_server(StatusOnly(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
