"""The committed generated protobuf code is fresh and matches etcd v3.5 wire facts."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # allow plain `pytest` without an install
    sys.path.insert(0, str(REPO_ROOT))

from etcdserverpb import (  # noqa: E402
    cqs_pb2,
    internal_pb2,
    kv_pb2,
    rpc_pb2,
    v3election_pb2,
    v3lock_pb2,
)


def _numbers(message: object) -> dict[str, int]:
    desc = message.DESCRIPTOR  # type: ignore[attr-defined]
    return {f.name: f.number for f in desc.fields}


@pytest.mark.unit
def test_generated_code_is_fresh() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


@pytest.mark.unit
def test_pyproject_asks_for_the_grpcio_and_protobuf_the_generated_code_runs_on() -> None:
    """The generated modules refuse to import on a grpcio or protobuf older than
    the generator that made them; pyproject.toml's floors must be at least that."""
    spec = importlib.util.spec_from_file_location(
        "gen_protos", REPO_ROOT / "scripts" / "gen_protos.py"
    )
    assert spec is not None and spec.loader is not None
    gen_protos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_protos)
    needed: dict[str, tuple[int, ...]] = {"grpcio": (0,), "protobuf": (0,)}
    for path in sorted((REPO_ROOT / "etcdserverpb").glob("*_pb2*.py")):
        package = "grpcio" if path.name.endswith("_grpc.py") else "protobuf"
        for stamp in gen_protos.version_stamps(path.read_bytes()):
            needed[package] = max(needed[package], stamp)
    assert needed["grpcio"] > (0,) and needed["protobuf"] > (0,), needed
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    floors = {
        m.group(1): _version(m.group(2))
        for dep in project["dependencies"]
        if (m := re.fullmatch(r"(grpcio|protobuf)>=([0-9.]+)", dep))
    }
    assert set(floors) == set(needed), project["dependencies"]
    for package, version in needed.items():
        assert floors[package] >= version, f"{package}>= must be at least {version}"


@pytest.mark.unit
def test_kv_wire_numbers() -> None:
    assert _numbers(rpc_pb2.RangeRequest) == {
        "key": 1,
        "range_end": 2,
        "limit": 3,
        "revision": 4,
        "sort_order": 5,
        "sort_target": 6,
        "serializable": 7,
        "keys_only": 8,
        "count_only": 9,
        "min_mod_revision": 10,
        "max_mod_revision": 11,
        "min_create_revision": 12,
        "max_create_revision": 13,
    }
    assert _numbers(rpc_pb2.PutRequest) == {
        "key": 1,
        "value": 2,
        "lease": 3,
        "prev_kv": 4,
        "ignore_value": 5,
        "ignore_lease": 6,
    }
    assert _numbers(rpc_pb2.TxnRequest) == {"compare": 1, "success": 2, "failure": 3}
    assert _numbers(rpc_pb2.RequestOp) == {
        "request_range": 1,
        "request_put": 2,
        "request_delete_range": 3,
        "request_txn": 4,
    }
    assert _numbers(kv_pb2.KeyValue) == {
        "key": 1,
        "create_revision": 2,
        "mod_revision": 3,
        "version": 4,
        "value": 5,
        "lease": 6,
    }
    assert _numbers(rpc_pb2.WatchResponse)["events"] == 11


@pytest.mark.unit
def test_compare_oneof_and_range_end() -> None:
    desc = rpc_pb2.Compare.DESCRIPTOR
    union = desc.oneofs_by_name["target_union"]
    assert {f.name: f.number for f in union.fields} == {
        "version": 4,
        "create_revision": 5,
        "mod_revision": 6,
        "value": 7,
        "lease": 8,
    }
    assert desc.fields_by_name["range_end"].number == 64
    assert rpc_pb2.Compare.CompareTarget.Value("LEASE") == 4
    assert rpc_pb2.Compare.CompareResult.Value("NOT_EQUAL") == 3


@pytest.mark.unit
def test_services_and_methods() -> None:
    kv = rpc_pb2.DESCRIPTOR.services_by_name["KV"]
    assert kv.full_name == "etcdserverpb.KV"
    assert [m.name for m in kv.methods] == ["Range", "Put", "DeleteRange", "Txn", "Compact"]
    watch = rpc_pb2.DESCRIPTOR.services_by_name["Watch"].methods_by_name["Watch"]
    assert watch.client_streaming and watch.server_streaming
    lock = v3lock_pb2.DESCRIPTOR.services_by_name["Lock"]
    assert lock.full_name == "v3lockpb.Lock"
    observe = v3election_pb2.DESCRIPTOR.services_by_name["Election"].methods_by_name["Observe"]
    assert observe.server_streaming and not observe.client_streaming


@pytest.mark.unit
def test_internal_command_oneof() -> None:
    desc = internal_pb2.Command.DESCRIPTOR
    assert desc.full_name == "queue_server.internal.Command"
    assert {f.name: f.number for f in desc.oneofs_by_name["op"].fields} == {
        "put": 1,
        "delete_range": 2,
        "txn": 3,
        "compaction": 4,
        "lease_grant": 5,
        "lease_revoke": 6,
        "alarm": 7,
        "queue_requeue": 8,
        "cqs_dequeue": 9,
        "cqs_settle": 10,
        "cqs_enqueue": 11,
        "member_attributes": 12,
        "auth": 13,
    }


@pytest.mark.unit
def test_change_queue_service() -> None:
    assert cqs_pb2.DESCRIPTOR.package == "dtoflow.changequeue.v1"
    deps = [d.name for d in cqs_pb2.DESCRIPTOR.dependencies]
    assert deps == ["google/protobuf/timestamp.proto"]
    service = cqs_pb2.DESCRIPTOR.services_by_name["DtoChangeQueueService"]
    assert service.full_name == "dtoflow.changequeue.v1.DtoChangeQueueService"
    assert [m.name for m in service.methods] == [
        "CreateOrConfigureQueue",
        "BatchDequeue",
        "BatchAcknowledge",
        "ReEnqueue",
    ]
    streaming = {m.name: (m.client_streaming, m.server_streaming) for m in service.methods}
    assert streaming == {
        "CreateOrConfigureQueue": (False, False),
        "BatchDequeue": (False, False),
        "BatchAcknowledge": (False, False),
        "ReEnqueue": (True, False),
    }
    io = {m.name: (m.input_type.name, m.output_type.name) for m in service.methods}
    assert io["ReEnqueue"] == ("ReEnqueueRequest", "ReEnqueueResponse")
    assert io["BatchDequeue"] == ("BatchDequeueRequest", "BatchDequeueResponse")


@pytest.mark.unit
def test_change_queue_wire_numbers() -> None:
    note = cqs_pb2.DtoChangeNotification.DESCRIPTOR
    assert _numbers(cqs_pb2.DtoChangeNotification) == {
        "ack_token": 1,
        "dto_type": 2,
        "dto_id": 3,
        "sla_timestamp": 4,
        "tracking_id": 5,
        "parent_id": 6,
        "alias_name": 7,
    }
    assert [f.name for f in note.oneofs_by_name["urn"].fields] == ["dto_id", "parent_id"]
    sla_timestamp = note.fields_by_name["sla_timestamp"].message_type
    assert sla_timestamp is not None
    assert sla_timestamp.full_name == "google.protobuf.Timestamp"
    assert note.fields_by_name["alias_name"].containing_oneof is None

    request = cqs_pb2.ReEnqueueRequest.DESCRIPTOR
    payload = {f.name: f.number for f in request.oneofs_by_name["payload"].fields}
    assert payload == {"header": 1, "item": 2, "footer": 3}
    item = request.fields_by_name["item"].message_type
    assert item is not None
    assert item.full_name == "dtoflow.changequeue.v1.SplitItem"
    assert _numbers(cqs_pb2.ReEnqueueRequest.Header) == {"queue_name": 1, "ack_token": 2}
    assert _numbers(cqs_pb2.ReEnqueueRequest.Footer) == {}

    assert _numbers(cqs_pb2.SplitItem) == {
        "dto_type": 1,
        "dto_id": 2,
        "parent_id": 3,
        "alias_name": 4,
    }
    split_urn = cqs_pb2.SplitItem.DESCRIPTOR.oneofs_by_name["urn"]
    assert [f.name for f in split_urn.fields] == ["dto_id", "parent_id"]
    assert _numbers(cqs_pb2.ReEnqueueResponse) == {"acknowledged": 1, "items_enqueued": 2}

    assert _numbers(cqs_pb2.BatchDequeueRequest) == {
        "queue_name": 1,
        "max_notifications": 2,
        "prefix_depth": 3,
        "wait_time_milliseconds": 4,
    }
    assert _numbers(cqs_pb2.BatchDequeueResponse) == {"notifications": 1}
    assert _numbers(cqs_pb2.BatchAcknowledgeRequest) == {"queue_name": 1, "ack_tokens": 2}
    assert _numbers(cqs_pb2.CreateOrConfigureQueueRequest) == {
        "queue_name": 1,
        "subscriptions": 2,
        "depth": 3,
    }
    assert _numbers(cqs_pb2.DtoTypeSubscription) == {"dto_type": 1, "alias_name": 2}
    assert _numbers(cqs_pb2.CreateOrConfigureQueueResponse) == {}
    assert _numbers(cqs_pb2.BatchAcknowledgeResponse) == {}
