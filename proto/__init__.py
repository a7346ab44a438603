"""pagoda's wire contract: the messages that cross process boundaries, and their codec.

Every service imports this package; it imports nothing of theirs.
"""
from proto.codec import (CodecError, FrameTooLarge, MalformedMessage, UnexpectedMessageType,
                         UnknownMessageType, UnsupportedVersion, decode, encode)
from proto.messages import (ExecuteModelRequest, PromptLogprobs, SamplerOutput,
                            SequenceData, SequenceGroupMetadata)
from proto.requests import (AbortRequest, ChatMessage, EngineRequest, ErrorResponse,
                            FinishRequest, GenerateRequest, HealthRequest, HealthResponse,
                            RequestTextDelta, RequestTokenDelta, SequenceTextDelta,
                            SequenceTokenDelta, TextDeltas, TokenDeltas, Usage)

__all__ = ["ExecuteModelRequest", "PromptLogprobs", "SamplerOutput", "SequenceData",
           "SequenceGroupMetadata",
           "AbortRequest", "ChatMessage", "EngineRequest", "ErrorResponse", "FinishRequest",
           "GenerateRequest", "HealthRequest", "HealthResponse", "RequestTextDelta",
           "RequestTokenDelta", "SequenceTextDelta", "SequenceTokenDelta", "TextDeltas",
           "TokenDeltas", "Usage",
           "CodecError", "FrameTooLarge", "MalformedMessage", "UnexpectedMessageType",
           "UnknownMessageType", "UnsupportedVersion", "decode", "encode"]
