"""Field kinds whose numbers travel packed in msgpack `bin`s (proto/codec.py has the wire format).

Token ids, block ids and logprobs go as little-endian int32 / int64 / float32 / float64 arrays,
not as msgpack arrays of numbers; a count that grows with a sequence goes as a fixed-width int32.
Encoding also takes numpy arrays; decoding checks each `bin`'s length before reading it.
"""
import sys
from array import array

from proto.codec_errors import MalformedMessage

_NATIVE_IS_LITTLE = sys.byteorder == "little"


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


class PackedLists:
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


class Int32Pairs:
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


class IntFloatMap:
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

