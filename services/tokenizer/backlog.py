"""Backlog: the requests a tokenizer has read off its socket but not tokenized yet.

Reading ahead lets an abort that came in behind a request drop it before any work is done on
it (a burst of requests whose clients left would otherwise all be tokenized and sent to the
engine). Aborts are also remembered a while, for copies of a request still in the socket.
"""
from collections import deque

from proto.requests import AbortRequest, GenerateRequest
from shared.recent_ids import RecentIds


class Backlog:
    def __init__(self, max_size: int, aborted: RecentIds):
        self.max_size = max_size
        self.aborted = aborted
        self.requests: deque[GenerateRequest] = deque()
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.max_size

    def add(self, msg: GenerateRequest | AbortRequest) -> None:
        if isinstance(msg, AbortRequest):
            self.aborted.add(msg.request_ids)
            ids = set(msg.request_ids)
            kept = deque(r for r in self.requests if r.request_id not in ids)
            self.num_dropped += len(self.requests) - len(kept)
            self.requests = kept
        elif msg.request_id in self.aborted:
            self.num_dropped += 1
        else:
            self.requests.append(msg)

    def pop(self) -> GenerateRequest | None:
        return self.requests.popleft() if self.requests else None
