"""What the parts that write through the log are handed: `Propose`, a log's
`propose` as a function, and `Spawn`, the node's way to start a task; and
`ApplyResult`, what a proposal answers.

The queue parts (`mq/`, `cqs/`) sit below `apply.py` and the node, so these
types live here, below all their users, and are defined once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from google.protobuf.message import Message

from etcdserverpb import internal_pb2
from queue_server.errors import EtcdError

ApplyResult = Message | EtcdError
"""A command's result: its response, or the error it failed with in apply."""

Propose = Callable[[internal_pb2.Command], Awaitable[ApplyResult]]
"""Append a command, wait until it is applied, answer its result."""

Spawn = Callable[[Coroutine[Any, Any, None]], object]
"""Run a background coroutine as a task the node keeps until it ends."""
