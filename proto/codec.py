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

`_FIELD_KINDS` (proto/field_kinds.py) overrides that per field: seq ids are int64, and the counts
that grow with a sequence's length are fixed-width, so that a decode step's bytes do not depend
on it.

Decoding never trusts the frame: any input either gives a message or raises a `CodecError`.

This module holds the message registry and `encode` / `decode`; the field kinds are in
proto/field_kinds.py (those that pack numbers, in proto/packed.py), the errors in
proto/codec_errors.py.
"""
import dataclasses

import msgpack

from proto.codec_errors import (CodecError, FrameTooLarge, MalformedMessage,
                                UnexpectedMessageType, UnknownMessageType, UnsupportedVersion)
from proto.field_kinds import DATACLASS_KINDS, DataclassKind, dataclass_kind
from proto.messages import ExecuteModelRequest, PromptLogprobs, SamplerOutput
from proto.requests import (AbortRequest, EngineRequest, ErrorResponse, FinishRequest,
                            GenerateRequest, HealthRequest, HealthResponse, RequestAccepted,
                            TextDeltas, TokenDeltas)
from proto.control import Register, WorkerCall, WorkerReply

MAX_FRAME_BYTES = 64 * 1024 * 1024


# ---- the message registry ------------------------------------------------------------------------

# type → (tag, version). Tags are part of the wire contract: never reuse or renumber one.
_MESSAGES: dict[type, tuple[int, int]] = {}
_BY_TAG: dict[int, tuple[type, int, DataclassKind]] = {}


def register_message(cls: type, tag: int, version: int = 1) -> None:
    assert dataclasses.is_dataclass(cls), cls
    assert tag not in _BY_TAG and cls not in _MESSAGES, f"tag {tag} or {cls.__name__} taken"
    _MESSAGES[cls] = (tag, version)
    _BY_TAG[tag] = (cls, version, dataclass_kind(cls))


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
assert PromptLogprobs in DATACLASS_KINDS  # reached through SamplerOutput


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
