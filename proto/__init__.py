"""pagoda's wire contract: the messages that cross process boundaries, and their codec.

Every service imports this package; it imports nothing of theirs.
"""
from proto.messages import (ExecuteModelRequest, PromptLogprobs, SamplerOutput,
                            SequenceData, SequenceGroupMetadata)

__all__ = ["ExecuteModelRequest", "PromptLogprobs", "SamplerOutput", "SequenceData",
           "SequenceGroupMetadata"]
