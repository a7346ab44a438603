"""Field kinds: how one field's value looks on the wire (see proto/codec.py for the format).

Each kind has `wire_types` (the msgpack types it decodes from), `accepts(value)` (whether a
Python value is of its kind, for unions), `encode(value)` and `decode(obj)`; both raise
`MalformedMessage` naming the bad field. `_kind_for` picks a field's kind from its type
annotation and `_FIELD_KINDS` overrides it per field; `dataclass_kind(cls)` is a message's kind
(an array of its fields). The packed-number kinds are in proto/packed.py.
"""
import dataclasses
import operator
import types
import typing

from proto.codec_errors import MalformedMessage
from proto.messages import ExecuteModelRequest, SamplerOutput, SequenceData, SequenceGroupMetadata
from proto.packed import (FIXED_INT32, FLOAT32_ARRAY, INT32_ARRAY, INT64_ARRAY, Int32Pairs,
                          IntFloatMap, PackedLists)
from shared.sampling_params import SamplingParamsError


class _Scalar:
    def __init__(self, py_type: type):
        self.py_type = py_type
        self.wire_types = (py_type,)

    def accepts(self, value) -> bool:
        return type(value) is self.py_type

    def encode(self, value):
        if type(value) is not self.py_type:
            raise MalformedMessage(f"expected {self.py_type.__name__}, got {type(value).__name__}")
        return value

    decode = encode


class _Float:
    """float64 on the wire; an int is taken as a float (SamplingParams(temperature=0) is common)."""
    wire_types = (float, int)

    def accepts(self, value) -> bool:
        return type(value) is float or type(value) is int

    def encode(self, value):
        if type(value) is not float and type(value) is not int:
            raise MalformedMessage(f"expected float, got {type(value).__name__}")
        return float(value)

    decode = encode


class _ListOf:
    wire_types = (list,)

    def __init__(self, item):
        self.item = item

    def accepts(self, value) -> bool:
        return (type(value) is list or type(value) is tuple) and (
            not value or self.item.accepts(value[0]))

    def encode(self, value):
        if type(value) is not list and type(value) is not tuple:
            raise MalformedMessage(f"expected a list, got {type(value).__name__}")
        encode_item = self.item.encode
        try:
            return [encode_item(item) for item in value]
        except MalformedMessage as e:
            e.path.insert(0, _first_failing(encode_item, value))
            raise

    def decode(self, obj):
        if type(obj) is not list:
            raise MalformedMessage(f"expected an array, got {type(obj).__name__}")
        decode_item = self.item.decode
        try:
            return [decode_item(item) for item in obj]
        except MalformedMessage as e:
            e.path.insert(0, _first_failing(decode_item, obj))
            raise


def _first_failing(convert, items) -> int:
    """Index of the first item `convert` rejects (only run once an item was rejected)."""
    for i, item in enumerate(items):
        try:
            convert(item)
        except MalformedMessage:
            return i
    return -1


class _Optional:
    def __init__(self, inner):
        self.inner = inner
        self.wire_types = inner.wire_types + (type(None),)

    def accepts(self, value) -> bool:
        return value is None or self.inner.accepts(value)

    def encode(self, value):
        return None if value is None else self.inner.encode(value)

    def decode(self, obj):
        return None if obj is None else self.inner.decode(obj)


class _Union:
    """One of several kinds, told apart by the Python type when encoding and the wire type when
    decoding; the kinds' wire types must not overlap."""

    def __init__(self, kinds: list):
        wire = [t for k in kinds for t in k.wire_types]
        assert len(wire) == len(set(wire)), f"union members share a wire type: {wire}"
        self.kinds = kinds
        self.wire_types = tuple(wire)

    def accepts(self, value) -> bool:
        return any(k.accepts(value) for k in self.kinds)

    def encode(self, value):
        for kind in self.kinds:
            if kind.accepts(value):
                return kind.encode(value)
        raise MalformedMessage(f"{type(value).__name__} is none of the union's types")

    def decode(self, obj):
        for kind in self.kinds:
            if type(obj) in kind.wire_types:
                return kind.decode(obj)
        raise MalformedMessage(f"{type(obj).__name__} is none of the union's wire types")


class _FlatMap:
    """dict[str, flat value], e.g. health details."""
    wire_types = (dict,)

    def __init__(self, value_types: tuple[type, ...]):
        self.value_types = value_types

    def accepts(self, value) -> bool:
        return type(value) is dict

    def encode(self, value):
        if type(value) is not dict:
            raise MalformedMessage(f"expected a dict, got {type(value).__name__}")
        for key, item in value.items():
            if type(key) is not str or type(item) not in self.value_types:
                raise MalformedMessage(f"entry {key!r}: expected str → "
                                       f"{'|'.join(t.__name__ for t in self.value_types)}")
        return value

    decode = encode


class DataclassKind:
    """A dataclass as the array of its init fields, in declaration order.

    Hot path: plain scalar fields are type-checked together in one tuple comparison and only the
    other fields go through their kind; any mismatch falls back to the field-by-field path, which
    converts what it may (an int for a float) and names the bad field.
    """
    wire_types = (list,)

    def __init__(self, cls: type):
        self.cls = cls
        self.names: list[str] = []
        self.kinds: list = []

    def resolve(self):
        hints = typing.get_type_hints(self.cls)
        for f in dataclasses.fields(self.cls):
            if not f.init:
                continue
            # Fields travel by position, so the constructor must take them by position.
            assert not f.kw_only, f"{self.cls.__name__}.{f.name}: keyword-only fields unsupported"
            self.names.append(f.name)
            self.kinds.append(_FIELD_KINDS.get((self.cls, f.name))
                              or _kind_for(hints[f.name], f"{self.cls.__name__}.{f.name}"))
        scalar_index = [i for i, k in enumerate(self.kinds) if isinstance(k, (_Scalar, _Float))]
        self.scalar_types = tuple(float if isinstance(self.kinds[i], _Float) else
                                  self.kinds[i].py_type for i in scalar_index)
        self.get_scalars = _tuple_getter(operator.itemgetter, scalar_index)
        self.get_fields = _tuple_getter(operator.attrgetter, self.names)
        self.converted = [(i, k.encode, k.decode) for i, k in enumerate(self.kinds)
                          if i not in scalar_index]

    def accepts(self, value) -> bool:
        return isinstance(value, self.cls)

    def encode(self, value) -> list:
        if not isinstance(value, self.cls):
            raise MalformedMessage(f"expected {self.cls.__name__}, got {type(value).__name__}")
        out = list(self.get_fields(value))
        if tuple(map(type, self.get_scalars(out))) != self.scalar_types:
            return self.encode_slowly(value)
        i = 0
        try:
            for i, encode_field, _ in self.converted:
                out[i] = encode_field(out[i])
        except MalformedMessage as e:
            e.path.insert(0, self.names[i])
            raise
        return out

    def encode_slowly(self, value) -> list:
        out, name = [], ""
        try:
            for name, kind in zip(self.names, self.kinds):
                out.append(kind.encode(getattr(value, name)))
        except MalformedMessage as e:
            e.path.insert(0, name)
            raise
        return out

    def decode(self, values: list):
        if type(values) is not list:
            raise MalformedMessage(f"{self.cls.__name__}: expected an array, got "
                                   f"{type(values).__name__}")
        if len(values) != len(self.kinds):
            raise MalformedMessage(f"{self.cls.__name__} has {len(self.kinds)} fields, "
                                   f"got {len(values)}")
        if tuple(map(type, self.get_scalars(values))) != self.scalar_types:
            values = self.decode_slowly(values)
        else:
            # A copy: the frame's tree stays as it came, so an error can be located in it again.
            values, i = values[:], 0
            try:
                for i, _, decode_field in self.converted:
                    values[i] = decode_field(values[i])
            except MalformedMessage as e:
                e.path.insert(0, self.names[i])
                raise
        try:
            return self.cls(*values)
        except SamplingParamsError as e:
            raise MalformedMessage(str(e).removeprefix(f"{e.field}: "), [e.field]) from None
        except Exception as e:  # a __post_init__ check of the class itself
            raise MalformedMessage(f"{self.cls.__name__} rejected its fields: {e}") from None

    def decode_slowly(self, values: list) -> list:
        out, name = [], ""
        try:
            for name, kind, item in zip(self.names, self.kinds, values):
                out.append(kind.decode(item))
        except MalformedMessage as e:
            e.path.insert(0, name)
            raise
        return out


def _tuple_getter(getter, keys: list):
    """`getter(*keys)` that always returns a tuple, also for zero or one key."""
    if not keys:
        return lambda obj: ()
    if len(keys) == 1:
        get_one = getter(keys[0])
        return lambda obj: (get_one(obj),)
    return getter(*keys)


DATACLASS_KINDS: dict[type, DataclassKind] = {}


def dataclass_kind(cls: type) -> DataclassKind:
    """The kind of dataclass `cls`, made once (its fields' kinds resolved then)."""
    kind = DATACLASS_KINDS.get(cls)
    if kind is None:
        kind = DATACLASS_KINDS[cls] = DataclassKind(cls)
        kind.resolve()
    return kind


_SCALAR_KINDS = {int: _Scalar(int), str: _Scalar(str), bool: _Scalar(bool), float: _Float()}


def _kind_for(tp, where: str):
    """The default wire form of a field annotated `tp` (see proto/codec.py's docstring)."""
    if tp in _SCALAR_KINDS:
        return _SCALAR_KINDS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        inner = (_kind_for(members[0], where) if len(members) == 1
                 else _Union([_kind_for(m, where) for m in members]))
        return _Optional(inner) if len(members) < len(args) else inner
    if origin is list:
        (item,) = args
        if item is int:
            return INT32_ARRAY
        if item is float:
            return FLOAT32_ARRAY
        if typing.get_origin(item) is list and typing.get_args(item) in ((int,), (float,)):
            inner = typing.get_args(item)[0]
            return PackedLists(INT32_ARRAY if inner is int else FLOAT32_ARRAY)
        if typing.get_origin(item) is tuple and typing.get_args(item) == (int, int):
            return Int32Pairs()
        return _ListOf(_kind_for(item, where))
    if origin is dict and args == (int, float):
        return IntFloatMap()
    if origin is dict and args and args[0] is str:
        value_types = typing.get_args(args[1]) or (args[1],)
        assert all(t in (str, int, float, bool, type(None)) for t in value_types), where
        return _FlatMap(tuple(value_types))
    if dataclasses.is_dataclass(tp):
        return dataclass_kind(tp)
    raise TypeError(f"{where}: no wire form for {tp!r}; add one to proto/field_kinds.py")


# Per-field wire forms that differ from the annotation's default.
_FIELD_KINDS = {
    # Seq ids count up for the engine's lifetime; int64 never wraps.
    (SamplerOutput, "seq_ids"): INT64_ARRAY,
    (ExecuteModelRequest, "finished_seq_ids"): INT64_ARRAY,
    # Counts that grow with the sequence: fixed width, so a decode step's size is constant.
    (SequenceData, "num_computed_tokens"): FIXED_INT32,
    (SequenceGroupMetadata, "token_chunk_size"): FIXED_INT32,
    (SequenceGroupMetadata, "prompt_len"): FIXED_INT32,
}

