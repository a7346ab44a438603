"""A scanner for tool calls written as JSON objects, complete or cut off mid-stream.

Models write calls as `{"name": ..., "arguments": {...}}` objects, alone, in a JSON array, or
separated by `;`. `scan_calls` reads as much of such text as is there and reports, per call, its
name (once its string is closed) and its arguments' JSON text as written so far. The arguments are
kept as the model wrote them (not re-serialised), so the text a stream has sent is always a prefix
of the final arguments, and the streamed and whole-text calls are the same.
"""
import json
from dataclasses import dataclass

_WS = " \t\r\n"


class NotCalls(ValueError):
    """The text is not (the start of) JSON tool calls."""


@dataclass
class PartialCall:
    name: str | None = None  # once its JSON string is complete
    arguments: str | None = None  # the arguments' JSON text so far; None before it starts
    arguments_done: bool = False
    closed: bool = False  # the call's object is complete


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Past the JSON string that opens at s[i] ('"'); None when s ends inside it."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def value_end(s: str, i: int) -> int | None:
    """Past the JSON value that starts at s[i]; None when s ends inside it. (Only its extent is
    found here; whether it is valid JSON is for json.loads.)"""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            ch = s[j]
            if ch == '"':
                end = _string_end(s, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: it may go on while the text ends right after it
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def _scan_object(s: str, i: int, keys: tuple[str, ...], call: PartialCall) -> int | None:
    """Reads the call object at s[i] ('{') into `call`; its end, or None when s ends first."""
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return None
        if s[i] == "}":
            call.closed = True
            return i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            raise NotCalls(f"expected a key at {i}")
        key_end = _string_end(s, i)
        if key_end is None:
            return None
        key = json.loads(s[i:key_end])
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return None
        if s[i] != ":":
            raise NotCalls(f"expected ':' at {i}")
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return None
        end = value_end(s, i)
        if key == "name":
            if end is None:
                return None
            name = json.loads(s[i:end])
            if not isinstance(name, str):
                raise NotCalls("a call's name must be a string")
            call.name = name
        elif key in keys and call.arguments is None:
            if s[i] == '"':  # arguments written as a JSON string of JSON: whole, once closed
                if end is None:
                    return None
                call.arguments = json.loads(s[i:end])
                if not isinstance(call.arguments, str):
                    raise NotCalls("arguments")
            else:
                call.arguments = s[i:end] if end is not None else s[i:]
            call.arguments_done = end is not None
        if end is None:
            return None
        i = end


def scan_calls(s: str, keys: tuple[str, ...] = ("arguments", "parameters")
               ) -> tuple[list[PartialCall], bool]:
    """The calls in `s` so far, and whether all of `s` read as calls (False: it stopped at text
    that is not JSON calls; the calls before it are still returned). `keys`: the names under
    which a call's arguments may come."""
    calls: list[PartialCall] = []
    i = _skip_ws(s, 0)
    in_list = i < len(s) and s[i] == "["
    if in_list:
        i += 1
    try:
        while True:
            i = _skip_ws(s, i)
            if i >= len(s):
                return calls, True
            c = s[i]
            if c in ",;":
                i += 1
                continue
            if c == "]" and in_list:
                return calls, not s[i + 1:].strip()
            if c != "{":
                return calls, False
            call = PartialCall()
            calls.append(call)
            end = _scan_object(s, i, keys, call)
            if end is None:
                return calls, True
            i = end
    except (NotCalls, ValueError):
        return calls, False
