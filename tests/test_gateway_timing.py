"""The gateway's waits, without a stack: a request's wait for its next item with one re-arming
timer (services/gateway/request_stream.py `RequestStream.next_item`), whether a request with no
output is queued or lost (`EngineReplica.waiting_its_turn`, services/gateway/replicas.py), and
`EngineStreams.next_ready`, the look at the merged outputs that never waits
(services/gateway/streaming.py)."""
import asyncio

import pytest

from shared.outputs import CompletionOutput, RequestOutput
from proto.requests import HealthResponse
from services.gateway.client import EngineRequestError
from services.gateway.replicas import EngineReplica
from services.gateway.request_stream import TIMED_OUT, RequestStream
from services.gateway.metrics import GatewayMetrics
from services.gateway.streaming import NOT_READY, EngineStreams
from shared.sampling_params import SamplingParams


def _stream() -> RequestStream:
    return RequestStream(asyncio.Queue(), 0, "prompt", SamplingParams(), 0.0)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _bounded(wait, timeout_s: float):
    """`wait`, failing the test if it runs well past `timeout_s` (a lost timer)."""
    try:
        return await asyncio.wait_for(wait, timeout_s + 2.0)
    except asyncio.TimeoutError:
        raise AssertionError(f"a {timeout_s} s wait did not time out") from None


async def _put_later(queue: asyncio.Queue, delays: list[float]) -> None:
    """Items 0, 1, ... each `delays[k]` seconds after the one before."""
    for k, delay in enumerate(delays):
        await asyncio.sleep(delay)
        queue.put_nowait(k)


# -- RequestStream.next_item -----------------------------------------------------------------------
def test_a_wait_times_out_after_its_timeout():
    async def go():
        stream, loop = _stream(), asyncio.get_running_loop()
        start = loop.time()
        assert await stream.next_item(0.2) is TIMED_OUT
        assert loop.time() - start >= 0.2
        assert stream.deadline is None  # not waiting any more
        # Again, after a timeout (a request waiting on an engine that is away does this).
        start = loop.time()
        assert await stream.next_item(0.2) is TIMED_OUT
        assert loop.time() - start >= 0.2
    _run(go())


def test_the_timeout_still_fires_after_items_pushed_the_deadline_forward():
    async def go():
        stream, loop = _stream(), asyncio.get_running_loop()
        timeout, gap, count = 0.6, 0.1, 3
        feeder = asyncio.create_task(_put_later(stream.queue, [gap] * count))
        start = loop.time()
        assert [await stream.next_item(timeout) for _ in range(count)] == list(range(count))
        await feeder
        last_item = loop.time()
        # The timer armed by the first wait comes due while this one still has time: it must
        # neither end this wait nor be lost (this wait would never end).
        assert await _bounded(stream.next_item(timeout), timeout) is TIMED_OUT
        now = loop.time()
        assert now - last_item >= timeout
        assert now - start >= count * gap + timeout
        assert now - last_item < timeout + 1.0  # the re-armed timer fired, not a much later one
    _run(go())


def test_the_ack_timeout_gives_way_to_the_longer_output_timeout_and_back():
    async def go():
        stream, loop = _stream(), asyncio.get_running_loop()
        ack, output = 0.2, 1.0
        feeder = asyncio.create_task(_put_later(stream.queue, [0.05]))
        assert await stream.next_item(ack) == 0  # the acknowledgement, within the ack timeout
        await feeder
        # The short wait's timer is still armed; the longer wait outlives it, and times out
        # after its own time, not the ack's.
        assert stream.timer is not None
        start = loop.time()
        assert await _bounded(stream.next_item(output), output) is TIMED_OUT
        assert loop.time() - start >= output
        # An item within the output timeout but past the ack's ends the wait as an item.
        feeder = asyncio.create_task(_put_later(stream.queue, [0.5]))
        start = loop.time()
        assert await stream.next_item(output) == 0
        assert loop.time() - start >= 0.5 - 0.05
        await feeder
        # And back to a short wait after a long one: its timer is not the long one's.
        feeder = asyncio.create_task(_put_later(stream.queue, [0.05]))
        assert await stream.next_item(5.0) == 0
        await feeder
        start = loop.time()
        assert await stream.next_item(ack) is TIMED_OUT
        elapsed = loop.time() - start
        assert ack <= elapsed < 2.5
    _run(go())


def test_time_spent_outside_a_wait_does_not_count_against_the_next_one():
    async def go():
        stream, loop = _stream(), asyncio.get_running_loop()
        feeder = asyncio.create_task(_put_later(stream.queue, [0.05]))
        assert await stream.next_item(0.2) == 0
        await feeder
        assert stream.timer is not None
        await asyncio.sleep(0.4)  # the caller busy past the timer's time: it puts nothing
        assert stream.queue.empty() and stream.timer is None
        feeder = asyncio.create_task(_put_later(stream.queue, [0.1]))
        assert await stream.next_item(0.5) == 0
        await feeder
        start = loop.time()
        assert await stream.next_item(0.2) is TIMED_OUT
        assert loop.time() - start >= 0.2
    _run(go())


def test_a_stale_timeout_left_in_the_queue_is_dropped():
    async def go():
        stream, loop = _stream(), asyncio.get_running_loop()
        # Put as an item came: the item is returned, the marker skipped.
        stream.queue.put_nowait(TIMED_OUT)
        stream.queue.put_nowait("item")
        assert await stream.next_item(0.5) == "item"
        # Left behind alone: the next wait starts afresh and gets the next item.
        stream.queue.put_nowait(TIMED_OUT)
        feeder = asyncio.create_task(_put_later(stream.queue, [0.1]))
        assert await stream.next_item(0.5) == 0
        await feeder
        # Arriving while a wait still has time: skipped, and the wait goes on to its item.
        waiter = asyncio.create_task(stream.next_item(2.0))
        await asyncio.sleep(0.05)
        stream.queue.put_nowait(TIMED_OUT)
        await asyncio.sleep(0.05)
        assert not waiter.done()
        stream.queue.put_nowait("later")
        assert await waiter == "later"
        # A marker that is due does end the wait.
        start = loop.time()
        assert await stream.next_item(0.2) is TIMED_OUT
        assert loop.time() - start >= 0.2
    _run(go())


def test_a_stopped_timer_puts_nothing():
    async def go():
        stream = _stream()
        waiter = asyncio.create_task(stream.next_item(0.1))
        await asyncio.sleep(0)
        assert stream.timer is not None
        stream.stop_timer()  # as generate() does when its request ends
        await asyncio.sleep(0.3)
        assert stream.queue.empty() and stream.timer is None and not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert stream.deadline is None
    _run(go())


# -- EngineReplica.waiting_its_turn: a request queued behind others, or one the engine lost ----
def _answer(replica: EngineReplica, sent_at: float, steps: int, running: int = 0,
            waiting: int = 0, swapped: int = 0) -> None:
    replica.observe(HealthResponse("engine", "ok", {
        "steps": steps, "running": running, "waiting": waiting, "swapped": swapped}), sent_at)


def test_a_request_waits_while_its_engine_runs_steps_for_others():
    r = EngineReplica(0, "ipc://engine")
    for t in range(10):  # a busy engine: a step or more between probes, a queue behind
        _answer(r, float(t), steps=3 * t, running=16, waiting=4)
    assert r.waiting_its_turn(5.0, 0.0)
    assert r.waiting_its_turn(8.0, 0.0)  # the probe sent at 8 saw a step that ran after it
    assert not r.waiting_its_turn(9.0, 0.0)  # no step is known to have run after 9


def test_a_request_with_no_output_fails_when_the_engine_stopped_stepping():
    r = EngineReplica(0, "ipc://engine")
    for t in range(4):
        _answer(r, float(t), steps=t, running=1)
    for t in range(4, 10):  # it still answers, with requests, but its steps stopped
        _answer(r, float(t), steps=3, running=1)
    assert r.waiting_its_turn(2.0, 0.0)  # it ran a step after 2 (seen by the probe sent at 3)
    assert not r.waiting_its_turn(3.5, 0.0)


def test_a_request_fails_when_its_engine_steps_but_was_seen_holding_no_request():
    r = EngineReplica(0, "ipc://engine")
    for t in range(10):
        _answer(r, float(t), steps=t, running=0 if t == 6 else 2)
    assert r.waiting_its_turn(5.0, 6.5)  # the idle answer was sent before its last output
    assert not r.waiting_its_turn(5.0, 5.0)  # an answer sent after that found no request


def test_an_engine_holding_only_swapped_out_requests_is_not_idle():
    r = EngineReplica(0, "ipc://engine")
    for t in range(10):
        _answer(r, float(t), steps=t, swapped=3)
    assert r.load == 0 and r.waiting_its_turn(5.0, 1.0)


def test_an_older_probes_answer_taken_in_late_does_not_move_the_bounds():
    r = EngineReplica(0, "ipc://engine")
    _answer(r, 1.0, steps=1, running=2)
    _answer(r, 5.0, steps=9, running=2)  # the step ran after 1
    _answer(r, 3.0, steps=4)  # sent before the one above: stale, and its "idle" too
    assert (r.stepped_after, r.probed_at, r.idle_at) == (1.0, 5.0, float("-inf"))
    _answer(r, 6.0, steps=10, running=2)
    assert r.stepped_after == 5.0


# -- EngineStreams.next_ready -------------------------------------------------------------------
class ScriptedClient:
    """Stands in for AsyncEngineClient: what each engine request yields is fed to it by the
    test (None ends the request; an exception is raised from it)."""

    def __init__(self):
        self.feeds: dict[str, asyncio.Queue] = {}

    def feed(self, request_id: str, item) -> None:
        self.feeds.setdefault(request_id, asyncio.Queue()).put_nowait(item)

    async def generate(self, prompt, params, request_id, cache_salt=None, prompt_options=None):
        feed = self.feeds.setdefault(request_id, asyncio.Queue())
        while (item := await feed.get()) is not None:
            if isinstance(item, Exception):
                raise item
            yield item


def _output(request_id: str, text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, None, [], None, [CompletionOutput(
        0, text, [7], None, None, "stop" if finished else None)], finished,
        num_prompt_tokens=3, num_output_tokens=1)


async def _until(predicate) -> None:
    """Let the pump tasks run until `predicate()` holds."""
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("the pumps did not get there")


def _streams(client: ScriptedClient, num_prompts: int) -> EngineStreams:
    return EngineStreams(client, [f"p{i}" for i in range(num_prompts)], SamplingParams(),
                         "req", GatewayMetrics("m"), 0.0)


def test_next_ready_returns_what_is_here_in_arrival_order_and_never_waits():
    async def go():
        client = ScriptedClient()
        streams = _streams(client, 2)
        try:
            assert streams.next_ready() is NOT_READY  # nothing has come yet
            second, first = _output("req-1", "b"), _output("req-0", "a")
            client.feed("req-1", second)  # prompt 1's output comes first
            await _until(lambda: streams.queue.qsize() == 1)
            client.feed("req-0", first)
            await _until(lambda: streams.queue.qsize() == 2)
            assert streams.next_ready() == (1, second)
            assert streams.next_ready() == (0, first)
            assert streams.next_ready() is NOT_READY
            # One prompt ends: its end is taken in passing, the other is still open.
            client.feed("req-0", None)
            await _until(lambda: streams.queue.qsize() == 1)
            assert streams.next_ready() is NOT_READY
            assert streams.num_open == 1
            # next() waits for what next_ready() could not give.
            last = _output("req-1", "c", finished=True)
            waiter = asyncio.create_task(streams.next())
            await asyncio.sleep(0)
            client.feed("req-1", last)
            assert await waiter == (1, last)
            client.feed("req-1", None)
            await _until(lambda: streams.queue.qsize() == 1)
            assert streams.next_ready() is None  # every prompt has finished
            assert streams.next_ready() is None
        finally:
            streams.close()
    _run(go())


@pytest.mark.parametrize("error, code", [(EngineRequestError(503, "engine away"), 503),
                                         (RuntimeError("a bug"), 500)])
def test_next_ready_raises_a_prompts_error(error, code):
    async def go():
        client = ScriptedClient()
        streams = _streams(client, 2)
        try:
            out = _output("req-0", "a")
            client.feed("req-0", out)
            client.feed("req-1", error)
            await _until(lambda: streams.queue.qsize() >= 3)  # output, error, end
            assert streams.next_ready() == (0, out)
            with pytest.raises(EngineRequestError) as raised:
                streams.next_ready()
            assert raised.value.code == code
            if code == 503:
                assert raised.value is error
        finally:
            streams.close()
    _run(go())
