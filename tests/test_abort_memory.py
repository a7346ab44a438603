"""The pure parts of cancellation: remembered aborts (expiring, bounded) and the tokenizer's
read-ahead backlog that aborts drop requests from."""
import pytest

from proto.requests import AbortRequest, GenerateRequest
from shared.recent_ids import RecentIds
from shared.sampling_params import SamplingParams
from services.tokenizer.backlog import Backlog


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_ids_forget_each_id_after_its_ttl():
    clock = Clock()
    ids = RecentIds(ttl_s=10.0, max_size=100, clock=clock)
    ids.add("a")
    clock.now += 6
    ids.add(["b", "c"])
    assert "a" in ids and "b" in ids and "x" not in ids
    clock.now += 5  # a: 11 s old, b and c: 5 s
    assert "a" not in ids and "b" in ids
    assert len(ids) == 2
    clock.now += 5
    assert "b" not in ids and len(ids) == 0


def test_recent_ids_added_again_start_over_and_hold_at_most_max_size():
    clock = Clock()
    ids = RecentIds(ttl_s=10.0, max_size=3, clock=clock)
    ids.add(["a", "b", "c"])
    clock.now += 8
    ids.add("a")  # its time starts over; it is the newest now
    ids.add("d")  # one too many: the oldest (b) goes
    assert "b" not in ids and {"a", "c", "d"} == {i for i in "abcd" if i in ids}
    clock.now += 5  # c: 13 s, a and d: 5 s
    assert "c" not in ids and "a" in ids and len(ids) == 2
    ids.discard("a")
    assert "a" not in ids
    with pytest.raises(ValueError):
        RecentIds(ttl_s=0, max_size=1)


def _request(request_id: str) -> GenerateRequest:
    return GenerateRequest(request_id, "ipc:///tmp/nowhere.sock", "hello",
                           SamplingParams(max_tokens=4), 0.0)


def test_backlog_drops_queued_requests_an_abort_names_and_later_copies():
    clock = Clock()
    backlog = Backlog(max_size=4, aborted=RecentIds(60.0, 100, clock=clock))
    for r in ("r1", "r2", "r3"):
        backlog.add(_request(r))
    backlog.add(AbortRequest(["r2", "never-seen"], "client gone"))
    assert len(backlog) == 2 and backlog.num_dropped == 1
    backlog.add(_request("r2"))  # a resent copy behind the abort
    backlog.add(_request("never-seen"))  # the abort overtook it
    assert backlog.num_dropped == 3
    assert [backlog.pop().request_id, backlog.pop().request_id] == ["r1", "r3"]
    assert backlog.pop() is None
    clock.now += 61  # forgotten: a request of that id runs again
    backlog.add(_request("r2"))
    assert backlog.pop().request_id == "r2"


def test_backlog_is_bounded():
    backlog = Backlog(max_size=2, aborted=RecentIds(60.0, 100))
    backlog.add(_request("a"))
    assert not backlog.full
    backlog.add(_request("b"))
    assert backlog.full
