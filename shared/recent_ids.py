"""RecentIds: a set of ids that forgets each one `ttl_s` after it was added, and holds at most
`max_size` (the oldest go first).

Used for aborts that overtake their requests: a client's AbortRequest goes straight to the
engine while the request itself may still wait in a tokenizer's queue, so the abort is kept a
while and the request dropped when it arrives.
"""
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable


class RecentIds:
    def __init__(self, ttl_s: float, max_size: int,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_size <= 0:
            raise ValueError("ttl_s and max_size must be positive")
        self.ttl_s = ttl_s
        self.max_size = max_size
        self.clock = clock
        self._added: OrderedDict[str, float] = OrderedDict()  # id -> when, oldest first

    def add(self, ids: str | Iterable[str]) -> None:
        now = self.clock()
        for i in [ids] if isinstance(ids, str) else ids:
            self._added.pop(i, None)  # added again: its time starts over
            self._added[i] = now
        self._expire(now)
        while len(self._added) > self.max_size:
            self._added.popitem(last=False)

    def discard(self, i: str) -> None:
        self._added.pop(i, None)

    def __contains__(self, i: str) -> bool:
        added = self._added.get(i)
        return added is not None and self.clock() - added < self.ttl_s

    def __len__(self) -> int:
        self._expire(self.clock())
        return len(self._added)

    def _expire(self, now: float) -> None:
        while self._added:
            oldest, added = next(iter(self._added.items()))
            if now - added < self.ttl_s:
                return
            del self._added[oldest]
