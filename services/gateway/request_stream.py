"""One request of AsyncEngineClient (client.py): its stream's state, and each text delta as the
caller sees it, without what the caller already has (a detokenizer or engine that took the
request over sends its text again from the start)."""
import asyncio
from dataclasses import dataclass, field

from proto.requests import (ChatMessage, PromptDelta, PromptOptions, RequestTextDelta,
                            ResumedOutput, SequenceTextDelta)
from shared.logging import get_logger
from shared.outputs import CompletionOutput, RequestOutput
from shared.sampling_params import SamplingParams

log = get_logger("client")

ACCEPTED = object()  # put in a request's queue when the engine acknowledges it
RESUBMIT = object()  # put there when a new engine is up: send the request again, resumed
TIMED_OUT = object()  # put there by its timer when it has waited past its deadline


class EngineRequestError(RuntimeError):
    """The stack refused or failed a request; `code` is the HTTP status that fits."""

    def __init__(self, code: int, message: str, request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


@dataclass
class RequestStream:
    """One request: what it asked, its outputs as they arrive, and how much of each sequence
    the caller has."""
    queue: asyncio.Queue
    engine_epoch: int  # the engine process it was sent to: its replica's epoch then
    prompt: str | list[int] | list[ChatMessage]
    params: SamplingParams
    arrival_time: float
    cache_salt: str | None = None
    prompt_options: PromptOptions | None = None
    header_seen: bool = False  # the caller has had the first delta's extras (prompt, timing)
    num_chars: dict[int, int] = field(default_factory=dict)  # by sample index
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # what the caller has
    done: set[int] = field(default_factory=set)  # sample indices that finished
    failed: bool = False
    replica: int = 0  # the engine replica it is bound to
    # The wait for the next item: its deadline (loop time; None while not waiting) and the one
    # timer that checks it. Re-arming a timer per item (asyncio.timeout) cost more than the
    # rest of an output's path through the client.
    deadline: float | None = None
    timer: asyncio.TimerHandle | None = None

    async def next_item(self, timeout_s: float):
        """The queue's next item, or TIMED_OUT once it has waited `timeout_s` for one."""
        # A TIMED_OUT put as another item came is stale: its wait ended with that item.
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if item is not TIMED_OUT:
                return item
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + timeout_s
        if self.timer is not None and self.timer.when() > self.deadline:
            self.stop_timer()  # armed for a longer wait
        if self.timer is None:
            self.timer = loop.call_at(self.deadline, self._check_deadline)
        try:
            while True:
                item = await self.queue.get()
                if item is not TIMED_OUT or loop.time() >= self.deadline:
                    return item
        finally:
            self.deadline = None

    def _check_deadline(self) -> None:
        self.timer = None
        if self.deadline is None:
            return  # not waiting: the next wait arms a timer again
        loop = asyncio.get_running_loop()
        if loop.time() >= self.deadline:
            self.queue.put_nowait(TIMED_OUT)
        else:  # an item came in time; this is the next wait's deadline
            self.timer = loop.call_at(self.deadline, self._check_deadline)

    def stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def resumed(self) -> list[ResumedOutput]:
        return [ResumedOutput(i, list(ids), i in self.done)
                for i, ids in sorted(self.token_ids.items()) if ids or i in self.done]


def unseen(s: SequenceTextDelta, stream: RequestStream) -> SequenceTextDelta | None:
    """The part of a sequence's delta the caller has not had yet (all of it, but after a
    detokenizer took the request over); None when there is nothing new."""
    if s.index in stream.done:
        return None  # replayed after its end
    have_chars = stream.num_chars.get(s.index, 0)
    have = stream.token_ids.setdefault(s.index, [])
    have_tokens = len(have)
    if s.text_offset > have_chars or s.token_offset > have_tokens:
        log.warning("a gap in a stream", index=s.index, text_offset=s.text_offset,
                    have_chars=have_chars, token_offset=s.token_offset,
                    have_tokens=have_tokens)
    stream.num_chars[s.index] = max(have_chars, s.text_offset + len(s.text))
    skip_chars = max(0, have_chars - s.text_offset)
    skip_tokens = max(0, have_tokens - s.token_offset)
    have.extend(s.token_ids[skip_tokens:])
    if not skip_chars and not skip_tokens:
        return s
    if (skip_chars >= len(s.text) and skip_tokens >= len(s.token_ids)
            and s.finish_reason is None):
        return None

    def cut(values: list) -> list:
        return values[skip_tokens:] if values else values
    return SequenceTextDelta(
        s.index, s.text[skip_chars:], cut(s.token_ids), cut(s.token_texts), cut(s.logprobs),
        cut(s.top_token_ids), cut(s.top_token_texts), cut(s.top_logprobs), s.finish_reason,
        s.stop_reason, s.text_offset + skip_chars, s.token_offset + skip_tokens)


def request_output(delta: RequestTextDelta, stream: RequestStream,
                   n: int) -> RequestOutput | None:
    """The caller's view of a text delta; None when it holds nothing new."""
    completions = []
    for s in delta.sequences:
        s = unseen(s, stream)
        if s is None:
            continue
        logprobs = texts = None
        if s.logprobs:
            logprobs, texts = [], []
            for k, tok in enumerate(s.token_ids):
                lp = dict(zip(s.top_token_ids[k], s.top_logprobs[k]))
                lp[tok] = s.logprobs[k]
                tx = dict(zip(s.top_token_ids[k], s.top_token_texts[k]))
                tx[tok] = s.token_texts[k]
                logprobs.append(lp)
                texts.append(tx)
        completions.append(CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.token_ids), cumulative_logprob=None,
            logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            logprob_texts=texts))
        if s.finish_reason is not None:
            stream.done.add(s.index)
    if delta.sequences and not completions:
        return None
    out = RequestOutput(
        request_id=delta.request_id, prompt=None, prompt_token_ids=[], prompt_logprobs=None,
        outputs=completions, finished=len(stream.done) >= n,
        num_prompt_tokens=delta.usage.prompt_tokens,
        num_output_tokens=delta.usage.completion_tokens)
    if not stream.header_seen and (delta.prompt is not None
                                   or delta.queue_time_s is not None):
        # Once: a header sent again (a detokenizer or engine took the request over)
        # carries the prompt's part again.
        stream.header_seen = True
        out.queue_time_s = delta.queue_time_s
        out.num_cached_tokens = delta.num_cached_tokens or 0
        if delta.prompt is not None:
            _add_prompt(out, delta.prompt)
    return out


def _add_prompt(out: RequestOutput, prompt: PromptDelta) -> None:
    """The prompt's token ids, and its logprobs as RequestOutput holds them: None for the first
    token, then {token id: logprob} with the top alternatives."""
    out.prompt_token_ids = list(prompt.token_ids)
    if not prompt.logprobs:
        return
    # The first token has no logprob; its text is kept, for echo.
    out.prompt_logprobs = [None]
    out.prompt_logprob_texts = [{prompt.token_ids[0]: prompt.token_texts[0]}]
    for k in range(len(prompt.logprobs)):
        tok = prompt.token_ids[k + 1]
        lp = dict(zip(prompt.top_token_ids[k], prompt.top_logprobs[k]))
        lp[tok] = prompt.logprobs[k]
        tx = dict(zip(prompt.top_token_ids[k], prompt.top_token_texts[k]))
        tx[tok] = prompt.token_texts[k + 1]
        out.prompt_logprobs.append(lp)
        out.prompt_logprob_texts.append(tx)
