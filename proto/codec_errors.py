"""The codec's errors: everything a bad frame (or a message that cannot be encoded) raises is a
`CodecError`, so a receiver catches one type, logs and drops."""


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
