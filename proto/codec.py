"""msgpack codec for pagoda's messages (design §2).

A message is one msgpack array, `[type_tag, version, field1, field2, ...]`, fields in dataclass
declaration order; a nested dataclass is an array of its fields, without tag or version. Each
field's wire form (its "kind") follows from its type annotation, so a field added to a message
needs no codec change unless it wants a form other than the default:

    int, float, str, bool      msgpack scalars, type-checked both ways
    list[int]                  packed little-endian int32 `bin` (token ids, block ids)
    list[float]                packed float32 `bin` (logprobs; values are rounded to float32)
    list[list[int|float]]      [packed int32 lengths, packed flat values], or [] when empty
    list[tuple[int, int]]      packed int32 pairs (block swaps and copies)
    list[X]                    an array of X
    a dataclass                the array of its fields
    X | None                   X or nil
    X | Y                      X or Y, told apart by their msgpack types (str, bin, array, ...)
    dict[str, scalars]         a map of flat values
    dict[int, float]           [packed int32 keys, packed float64 values] (logit biases)

Packed fields also take 1-d numpy arrays (2-d for lists of lists) when encoding, so a worker can
send its tensors without going through Python lists; decoding always gives lists.

`_FIELD_KINDS` overrides that per field: seq ids are int64, and the counts that grow with a
sequence's length are fixed-width, so that a decode step's bytes do not depend on it.

Decoding never trusts the frame: any input either gives a message or raises a `CodecError`.
"""
import dataclasses
import operator
import sys
import types
import typing
from array import array

import msgpack

from proto.messages import (ExecuteModelRequest, PromptLogprobs, SamplerOutput, SequenceData,
                            SequenceGroupMetadata)
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            GenerateRequest, HealthRequest, HealthResponse, RequestAccepted,
                            TextDeltas, TokenDeltas)
from shared.sampling_params import SamplingParamsError
from proto.control import Register, WorkerCall, WorkerReply

MAX_FRAME_BYTES = 64 * 1024 * 1024


class CodecError(Exception):
    """A frame that is not a valid pagoda message, or a message that cannot be encoded."""


class UnknownMessageType(CodecError):
    pass


class UnexpectedMessageType(CodecError):
    """A valid message, but not one of the types the receiver asked for."""


class UnsupportedVersion(CodecError):
    pass


class FrameTooLarge(CodecError):
    pass


class MalformedMessage(CodecError):
    """Bad structure or values; `field` is the path to the bad one, e.g. `seq_data[0].block_ids`."""

    def __init__(self, reason: str, path: list | None = None):
        super().__init__(reason)
        self.reason = reason
        self.path: list[str | int] = path or []

    @property
    def field(self) -> str:
        return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in self.path).lstrip(".")

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}" if self.path else self.reason


# ---- field kinds: how one field's value looks on the wire ----------------------------------------

_NATIVE_IS_LITTLE = sys.byteorder == "little"


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


class _FixedInt32:
    """An int as a 4-byte `bin`: its size on the wire does not depend on its value."""
    wire_types = (bytes,)

    def accepts(self, value) -> bool:
        return type(value) is int

    def encode(self, value):
        if type(value) is not int:
            raise MalformedMessage(f"expected int, got {type(value).__name__}")
        try:
            return value.to_bytes(4, "little", signed=True)
        except OverflowError:
            raise MalformedMessage(f"{value} does not fit in int32") from None

    def decode(self, obj):
        if type(obj) is not bytes or len(obj) != 4:
            raise MalformedMessage("expected a 4-byte int32")
        return int.from_bytes(obj, "little", signed=True)


class _Packed:
    """A list of numbers as one little-endian `bin`; also takes a numpy array when encoding."""
    wire_types = (bytes,)

    def __init__(self, typecode: str, label: str, element: type):
        self.typecode = typecode
        self.label = label
        self.element = element
        self.itemsize = array(typecode).itemsize
        self.numpy_dtype = "<" + {"i": "i4", "q": "i8", "f": "f4", "d": "f8"}[typecode]

    def accepts(self, value) -> bool:
        return (type(value) is list or type(value) is tuple) and (
            not value or type(value[0]) is self.element)

    def encode(self, value):
        if type(value) is list or type(value) is tuple:
            if not value:
                return b""
            try:
                packed = array(self.typecode, value)
            except (TypeError, OverflowError) as e:
                raise MalformedMessage(f"not a list of {self.label}: {e}") from None
            if not _NATIVE_IS_LITTLE:
                packed.byteswap()
            return packed.tobytes()
        if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
            return self._encode_numpy(value)
        raise MalformedMessage(f"expected a list of {self.label}, got {type(value).__name__}")

    def _encode_numpy(self, value):
        import numpy as np
        if value.ndim != 1 or value.dtype.kind not in ("iuf" if self.element is float else "iu"):
            raise MalformedMessage(f"expected a 1-d array of {self.label}, got {value.dtype}"
                                   f"{list(value.shape)}")
        if self.element is int and value.size:
            info = np.iinfo(self.numpy_dtype)
            if value.min() < info.min or value.max() > info.max:
                raise MalformedMessage(f"values out of the {self.label} range")
        return value.astype(self.numpy_dtype, copy=False).tobytes()

    def decode(self, obj):
        if obj == b"":
            return []
        if type(obj) is not bytes:
            raise MalformedMessage(f"expected packed {self.label} (bin), got {type(obj).__name__}")
        if len(obj) % self.itemsize:
            raise MalformedMessage(f"packed {self.label}: {len(obj)} bytes is not a multiple "
                                   f"of {self.itemsize}")
        values = array(self.typecode)
        values.frombytes(obj)
        if not _NATIVE_IS_LITTLE:
            values.byteswap()
        return values.tolist()


INT32_ARRAY = _Packed("i", "int32", int)
INT64_ARRAY = _Packed("q", "int64", int)
FLOAT32_ARRAY = _Packed("f", "float32", float)
FLOAT64_ARRAY = _Packed("d", "float64", float)
FIXED_INT32 = _FixedInt32()
assert INT32_ARRAY.itemsize == 4 and INT64_ARRAY.itemsize == 8 and FLOAT32_ARRAY.itemsize == 4


class _PackedLists:
    """A list of lists of numbers as [packed int32 lengths, one packed flat array]; a 2-d numpy
    array is taken as its list of rows."""
    wire_types = (list,)

    def __init__(self, values: _Packed):
        self.values = values

    def accepts(self, value) -> bool:
        return type(value) is list or type(value) is tuple

    def encode(self, value):
        if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) == 2:
            rows, width = value.shape  # [rows, width]: e.g. top-k ids of each sample
            return [INT32_ARRAY.encode([width] * rows), self.values.encode(value.reshape(-1))]
        if type(value) is not list and type(value) is not tuple:
            raise MalformedMessage(f"expected a list of lists, got {type(value).__name__}")
        if not value:
            return []  # the common case (no logprobs asked): one byte
        flat = []
        for i, row in enumerate(value):
            if type(row) is not list and type(row) is not tuple:
                raise MalformedMessage(f"expected a list, got {type(row).__name__}", [i])
            flat.extend(row)
        return [INT32_ARRAY.encode([len(row) for row in value]), self.values.encode(flat)]

    def decode(self, obj):
        if obj == []:
            return []
        if type(obj) is not list or len(obj) != 2:
            raise MalformedMessage("expected [lengths, values] or []")
        lengths = INT32_ARRAY.decode(obj[0])
        flat = self.values.decode(obj[1])
        if any(n < 0 for n in lengths) or sum(lengths) != len(flat):
            raise MalformedMessage(f"row lengths sum to {sum(lengths)}, not to the "
                                   f"{len(flat)} values sent")
        rows, start = [], 0
        for n in lengths:
            rows.append(flat[start:start + n])
            start += n
        return rows


class _Int32Pairs:
    """list[tuple[int, int]] as one packed int32 array of 2 × len values."""
    wire_types = (bytes,)

    def accepts(self, value) -> bool:
        return type(value) is list or type(value) is tuple

    def encode(self, value):
        if type(value) is not list and type(value) is not tuple:
            raise MalformedMessage(f"expected a list of pairs, got {type(value).__name__}")
        flat = []
        for i, pair in enumerate(value):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise MalformedMessage("expected a pair of ints", [i])
            flat.extend(pair)
        return INT32_ARRAY.encode(flat)

    def decode(self, obj):
        flat = INT32_ARRAY.decode(obj)
        if len(flat) % 2:
            raise MalformedMessage(f"packed pairs: odd number of values ({len(flat)})")
        return list(zip(flat[0::2], flat[1::2]))


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


class _IntFloatMap:
    """dict[int, float] as [packed int32 keys, packed float64 values], e.g. logit biases."""
    wire_types = (list,)

    def accepts(self, value) -> bool:
        return type(value) is dict

    def encode(self, value):
        if type(value) is not dict:
            raise MalformedMessage(f"expected a dict, got {type(value).__name__}")
        if not all(type(k) is int for k in value):
            raise MalformedMessage("expected int keys")
        return [INT32_ARRAY.encode(list(value)), FLOAT64_ARRAY.encode(
            [float(v) if type(v) is int else v for v in value.values()])]

    def decode(self, obj):
        if type(obj) is not list or len(obj) != 2:
            raise MalformedMessage("expected [keys, values]")
        keys, values = INT32_ARRAY.decode(obj[0]), FLOAT64_ARRAY.decode(obj[1])
        if len(keys) != len(values):
            raise MalformedMessage(f"{len(keys)} keys but {len(values)} values")
        return dict(zip(keys, values))


class _Dataclass:
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


_DATACLASS_KINDS: dict[type, _Dataclass] = {}


def _dataclass_kind(cls: type) -> _Dataclass:
    kind = _DATACLASS_KINDS.get(cls)
    if kind is None:
        kind = _DATACLASS_KINDS[cls] = _Dataclass(cls)
        kind.resolve()
    return kind


_SCALAR_KINDS = {int: _Scalar(int), str: _Scalar(str), bool: _Scalar(bool), float: _Float()}


def _kind_for(tp, where: str):
    """The default wire form of a field annotated `tp` (see the module docstring)."""
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
            return _PackedLists(INT32_ARRAY if inner is int else FLOAT32_ARRAY)
        if typing.get_origin(item) is tuple and typing.get_args(item) == (int, int):
            return _Int32Pairs()
        return _ListOf(_kind_for(item, where))
    if origin is dict and args == (int, float):
        return _IntFloatMap()
    if origin is dict and args and args[0] is str:
        value_types = typing.get_args(args[1]) or (args[1],)
        assert all(t in (str, int, float, bool, type(None)) for t in value_types), where
        return _FlatMap(tuple(value_types))
    if dataclasses.is_dataclass(tp):
        return _dataclass_kind(tp)
    raise TypeError(f"{where}: no wire form for {tp!r}; add one to proto/codec.py")


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


# ---- the message registry ------------------------------------------------------------------------

# type → (tag, version). Tags are part of the wire contract: never reuse or renumber one.
_MESSAGES: dict[type, tuple[int, int]] = {}
_BY_TAG: dict[int, tuple[type, int, _Dataclass]] = {}


def register_message(cls: type, tag: int, version: int = 1) -> None:
    assert dataclasses.is_dataclass(cls), cls
    assert tag not in _BY_TAG and cls not in _MESSAGES, f"tag {tag} or {cls.__name__} taken"
    _MESSAGES[cls] = (tag, version)
    _BY_TAG[tag] = (cls, version, _dataclass_kind(cls))


# Version 2: cache_salt and resumed.
register_message(GenerateRequest, 1, version=3)
register_message(EngineRequest, 2, version=2)
register_message(AbortRequest, 3)
register_message(FinishRequest, 4)
register_message(TokenDeltas, 5)
register_message(TextDeltas, 6)
register_message(ErrorResponse, 7)
register_message(HealthRequest, 8)
register_message(HealthResponse, 9)
register_message(RequestAccepted, 10)
# Version 2 of both: speculative decoding's lookahead slots and extra tokens.
register_message(ExecuteModelRequest, 16, version=2)
register_message(SamplerOutput, 17, version=2)
register_message(Register, 32)
register_message(WorkerCall, 33)
register_message(WorkerReply, 34)
assert PromptLogprobs in _DATACLASS_KINDS  # reached through SamplerOutput


def message_tag(cls: type) -> int:
    return _MESSAGES[cls][0]


# ---- encode / decode -----------------------------------------------------------------------------

def encode(msg, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    entry = _MESSAGES.get(type(msg))
    if entry is None:
        raise UnknownMessageType(f"{type(msg).__name__} is not a registered message")
    tag, version = entry
    fields = _BY_TAG[tag][2].encode(msg)
    try:
        data = msgpack.packb([tag, version, *fields], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # e.g. an int beyond 64 bits
        raise MalformedMessage(f"{type(msg).__name__}: {e}") from None
    if len(data) > max_frame_bytes:
        # Refuse here: the receiver would drop it anyway.
        raise FrameTooLarge(f"{type(msg).__name__} is {len(data)} bytes, over {max_frame_bytes}")
    return data


def decode(data, expected: type | tuple[type, ...] | None = None,
           max_frame_bytes: int = MAX_FRAME_BYTES):
    """The message in `data`; with `expected`, it must be (one of) that type."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MalformedMessage(f"a frame is bytes, got {type(data).__name__}")
    size = memoryview(data).nbytes
    if size > max_frame_bytes:
        raise FrameTooLarge(f"frame of {size} bytes is over the {max_frame_bytes} limit")
    try:
        # Declared lengths are bounded by the frame itself: a tiny frame cannot ask for a huge
        # allocation. Ext types are not part of the contract.
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True,
                              max_str_len=size, max_bin_len=size, max_array_len=size,
                              max_map_len=size, max_ext_len=0)
    except Exception as e:  # truncated, trailing bytes, bad utf-8, nesting too deep, ...
        raise MalformedMessage(f"not a msgpack frame: {type(e).__name__}: {e}") from None
    if type(obj) is not list or len(obj) < 2:
        raise MalformedMessage("a message is an array [tag, version, fields...]")
    tag, version = obj[0], obj[1]
    if type(tag) is not int or type(version) is not int:
        raise MalformedMessage("tag and version must be ints")
    entry = _BY_TAG.get(tag)
    if entry is None:
        raise UnknownMessageType(f"unknown message tag {tag}")
    cls, supported, kind = entry
    if expected is not None and not issubclass(cls, expected):
        raise UnexpectedMessageType(f"got {cls.__name__}, expected {expected}")
    if version != supported:
        raise UnsupportedVersion(f"{cls.__name__} version {version}; this side speaks {supported}")
    try:
        return kind.decode(obj[2:])
    except CodecError:
        raise
    except Exception as e:  # the kinds check types first; this only keeps the contract airtight
        raise MalformedMessage(f"{cls.__name__}: {type(e).__name__}: {e}") from None
