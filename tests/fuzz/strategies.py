"""Hypothesis strategies for any protobuf message, built from its descriptor.

One generic builder (`message_strategy`) walks a message's fields by type: scalars
get bounded values that favour edges (0, -1, the type's extremes), bytes and
strings get short values from a small pool (so requests meet each other's keys)
or random ones, enums any declared number and sometimes an undeclared one (proto3
enums are open, so a server must cope with them), repeated fields a short list,
oneofs one member or none, nested messages the same walk to a bounded depth.
No per-message code: every request type of every service comes from here.

The pools below name the server's special key spaces (the etcd-key queue's
`/q/{name}/p|c/...` and CQS's `/q/dto:{type}/...`) so that fuzzing reaches the
queue paths too. This module imports no server code.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

MAX_DEPTH = 3
"""Nested messages beyond this depth are left empty (a TxnRequest in a TxnRequest
in a TxnRequest is deep enough to reach every branch of nested-txn handling)."""
MAX_REPEATED = 4
"""Repeated fields get at most this many elements: enough for duplicates and
ordering, small enough that one example stays a few milliseconds."""
MAX_BYTES = 24
"""Random bytes and strings stay short: size limits are tested on their own."""

KEY_POOL: tuple[bytes, ...] = (
    b"a",
    b"",
    b"\x00",
    b"b",
    b"foo",
    b"foo/",
    b"foo/bar",
    b"\xff",
    b"\xff\xff",
    b"/q/fz/p/k1",
    b"/q/fz/c/u1",
    b"/q/fz/",
    b"/q/dto:fz/p/d1",
    b"/q/dto:fz/",
    b"/q/",
    b"lk",
    b"lk/",
    b"el",
)
TEXT_POOL: tuple[str, ...] = ("fz", "", "dto:fz", "q1", "a/b/c", "\x00", "é", "fz/1")

_INT_EDGES = {
    32: (0, 1, -1, 2, 3, 2**31 - 1, -(2**31)),
    64: (0, 1, -1, 2, 3, 5, 10, 2**31, 2**53, 2**63 - 1, -(2**63)),
}
_UINT_EDGES = {32: (0, 1, 2, 2**32 - 1), 64: (0, 1, 2, 2**63, 2**64 - 1)}

_SIGNED_32 = {
    FieldDescriptor.TYPE_INT32,
    FieldDescriptor.TYPE_SINT32,
    FieldDescriptor.TYPE_SFIXED32,
}
_SIGNED_64 = {
    FieldDescriptor.TYPE_INT64,
    FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_SFIXED64,
}
_UNSIGNED_32 = {FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32}
_UNSIGNED_64 = {FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64}


def _signed(bits: int) -> st.SearchStrategy[int]:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return st.one_of(
        st.sampled_from(_INT_EDGES[bits]),
        st.integers(min_value=-3, max_value=40),
        st.integers(min_value=lo, max_value=hi),
    )


def _unsigned(bits: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from(_UINT_EDGES[bits]),
        st.integers(min_value=0, max_value=40),
        st.integers(min_value=0, max_value=2**bits - 1),
    )


def _bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from(KEY_POOL), st.binary(max_size=MAX_BYTES))


def _text() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(TEXT_POOL), st.text(max_size=MAX_BYTES))


def _enum(field: FieldDescriptor) -> st.SearchStrategy[int]:
    assert field.enum_type is not None
    declared = [v.number for v in field.enum_type.values]
    return st.one_of(st.sampled_from(declared), st.integers(min_value=-5, max_value=100))


def scalar_strategy(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values for one scalar (non-message) field."""
    t = field.type
    if t in _SIGNED_32:
        return _signed(32)
    if t in _SIGNED_64:
        return _signed(64)
    if t in _UNSIGNED_32:
        return _unsigned(32)
    if t in _UNSIGNED_64:
        return _unsigned(64)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_BYTES:
        return _bytes()
    if t == FieldDescriptor.TYPE_STRING:
        return _text()
    if t == FieldDescriptor.TYPE_ENUM:
        return _enum(field)
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=False, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64)
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(field.message_type, depth + 1)
    return scalar_strategy(field)


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


@functools.cache
def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Well-typed messages of `descriptor`'s class: fields set or left at default,
    at most one member per oneof, nesting cut at MAX_DEPTH."""
    cls = _message_class(descriptor)
    if depth > MAX_DEPTH:
        return st.just(cls())
    plain = [f for f in descriptor.fields if f.containing_oneof is None]
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in plain:
        value = _field_value(field, depth)
        if _is_repeated(field):
            parts[field.name] = st.lists(value, max_size=MAX_REPEATED)
        elif field.type in (FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_STRING):
            parts[field.name] = value  # keys and names: always drawn (the pools hold "")
        else:
            parts[field.name] = st.one_of(st.none(), st.none(), value)  # mostly unset
    oneofs = {
        o.name: st.one_of(
            st.none(), *[st.tuples(st.just(f.name), _field_value(f, depth)) for f in o.fields]
        )
        for o in descriptor.oneofs
    }

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        msg = cls()
        for name, strategy in parts.items():
            value = draw(strategy)
            if value is None:
                continue
            _assign(msg, descriptor.fields_by_name[name], value)
        for strategy in oneofs.values():
            chosen = draw(strategy)
            if chosen is not None:
                name, value = chosen
                _assign(msg, descriptor.fields_by_name[name], value)
        return msg

    return build()


def _assign(msg: Any, field: FieldDescriptor, value: Any) -> None:
    if _is_repeated(field):
        getattr(msg, field.name).extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(msg, field.name).CopyFrom(value)
    else:
        setattr(msg, field.name, value)


def _message_class(descriptor: Descriptor) -> Any:
    return message_factory.GetMessageClass(descriptor)
