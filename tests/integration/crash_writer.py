"""Writer for the crash test: puts keys with many in flight and prints one line
`key mod_revision` per acknowledged put, flushed at once, until the server dies
or `count` puts are done. Run as a script: crash_writer.py ENDPOINT PREFIX COUNT."""

from __future__ import annotations

import asyncio
import sys

import grpc
from grpc import aio

from etcdserverpb import rpc_pb2, rpc_pb2_grpc

IN_FLIGHT = 16


async def main(endpoint: str, prefix: str, count: int) -> None:
    async with aio.insecure_channel(endpoint) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        next_i = 0
        stop = False

        async def worker() -> None:
            nonlocal next_i, stop
            while not stop and next_i < count:
                i = next_i
                next_i += 1
                key = f"{prefix}{i:06d}"
                try:
                    resp = await kv.Put(
                        rpc_pb2.PutRequest(key=key.encode(), value=b"v" * 100), timeout=10
                    )
                except grpc.RpcError:
                    stop = True
                    return
                sys.stdout.write(f"{key} {resp.header.revision}\n")
                sys.stdout.flush()

        await asyncio.gather(*(worker() for _ in range(IN_FLIGHT)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
