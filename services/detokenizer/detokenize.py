"""The detokenizer stage's work: per-request incremental text, stop strings, logprob texts.

A request's first delta carries its parameters (the header). The engine sends a header again,
with every output token from the first, when the request moves here from a detokenizer that
died: its state starts over, and each text delta says where it starts in the whole output
(`text_offset`, `token_offset`) so the client drops what it already got.
"""
import time
from dataclasses import dataclass, field

from proto.requests import (RequestTextDelta, RequestTokenDelta, SequenceTextDelta, Usage)
from shared.sampling_params import SamplingParams
from shared.incremental_detokenizer import IncrementalDetokenizer, find_stop_string


@dataclass
class _SeqText:
    detok: IncrementalDetokenizer
    text_len: int = 0  # characters of text already sent
    finished: bool = False
    stopped_by_string: bool = False  # finished here while the engine still computes it
    num_output_tokens: int = 0


@dataclass
class RequestText:
    request_id: str
    gateway_id: str
    params: SamplingParams
    prompt_tail: list[int]
    num_prompt_tokens: int
    seqs: dict[int, _SeqText] = field(default_factory=dict)
    last_delta_time: float = 0.0  # monotonic


class Detokenizer:
    """Holds the state of every request routed here; turns token deltas into text deltas."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestText] = {}

    def decode(self, delta: RequestTokenDelta) -> tuple[RequestTextDelta | None, bool]:
        """Returns the text delta for the client (None for a request never seen from its start)
        and whether the request ended here by stop strings while the engine still computes it,
        so the engine must be told to finish it."""
        req = self.requests.get(delta.request_id)
        if delta.sampling_params is not None:
            # A header: the request starts here, or starts over with all its tokens again.
            req = self.requests[delta.request_id] = RequestText(
                delta.request_id, delta.gateway_id, delta.sampling_params,
                delta.prompt_tail_token_ids, delta.num_prompt_tokens)
        elif req is None:
            return None, False  # a request we never saw the start of (we restarted)
        req.last_delta_time = time.monotonic()
        params = req.params
        out_seqs = []
        for sd in delta.sequences:
            st = req.seqs.get(sd.index)
            if st is None:
                st = req.seqs[sd.index] = _SeqText(IncrementalDetokenizer(
                    self.tokenizer, req.prompt_tail, params.skip_special_tokens,
                    params.spaces_between_special_tokens))
            if st.finished:
                continue  # tokens computed after a stop string: dropped
            new_text = st.detok.decode_incremental(sd.token_ids)
            st.num_output_tokens = sd.num_output_tokens
            finish_reason, stop_reason = sd.finish_reason, sd.stop_reason
            text = st.detok.text
            if sd.num_output_tokens >= params.min_tokens:
                hit = find_stop_string(text, len(new_text), params.stop,
                                       params.include_stop_str_in_output)
                if hit is not None:
                    stop_reason, cut = hit
                    finish_reason = "stop"
                    text = text[:cut]
                    st.stopped_by_string = sd.finish_reason is None  # the engine still runs it
            if finish_reason is not None:
                st.finished = True
            # While running, hold back what could be the start of a stop string.
            hold = 0 if st.finished or not params.stop else max(map(len, params.stop)) - 1
            visible = max(st.text_len, len(text) - hold)
            piece = text[st.text_len:visible]
            tsd = SequenceTextDelta(sd.index, piece, list(sd.token_ids),
                                    finish_reason=finish_reason, stop_reason=stop_reason,
                                    text_offset=st.text_len,
                                    token_offset=sd.num_output_tokens - len(sd.token_ids))
            st.text_len = visible
            if params.logprobs is not None:
                tsd.token_texts = [self._token_text(t) for t in sd.token_ids]
                tsd.logprobs = list(sd.logprobs)
                tsd.top_token_ids = [list(x) for x in sd.top_token_ids]
                tsd.top_token_texts = [[self._token_text(t) for t in x] for x in sd.top_token_ids]
                tsd.top_logprobs = [list(x) for x in sd.top_logprobs]
            out_seqs.append(tsd)
        prompt = delta.prompt
        if prompt is not None and prompt.logprobs:
            prompt.token_texts = [self._token_text(t) for t in prompt.token_ids]
            prompt.top_token_texts = [[self._token_text(t) for t in x]
                                      for x in prompt.top_token_ids]
        usage = Usage(req.num_prompt_tokens, sum(s.num_output_tokens for s in req.seqs.values()))
        done = len(req.seqs) >= params.n and all(s.finished for s in req.seqs.values())
        tell_engine = False
        if done:
            del self.requests[delta.request_id]
            tell_engine = any(s.stopped_by_string for s in req.seqs.values())
        return RequestTextDelta(req.request_id, out_seqs, usage, prompt,
                                queue_time_s=delta.queue_time_s,
                                num_cached_tokens=delta.num_cached_tokens), tell_engine

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def end_aborted(self, delta: RequestTokenDelta) -> RequestTextDelta | None:
        """The last delta of an aborted request: its state is dropped and its last tokens are
        not decoded (its client left, or asked for no more); the client gets only the finish."""
        req = self.requests.pop(delta.request_id, None)
        if req is None:
            return None
        seqs = []
        for sd in delta.sequences:
            st = req.seqs.get(sd.index)
            if st is not None and st.finished:
                continue
            seqs.append(SequenceTextDelta(
                sd.index, "", [], finish_reason=sd.finish_reason, stop_reason=sd.stop_reason,
                text_offset=st.text_len if st else 0,
                token_offset=st.num_output_tokens if st else 0))
        usage = Usage(req.num_prompt_tokens, sum(s.num_output_tokens for s in req.seqs.values()))
        return RequestTextDelta(req.request_id, seqs, usage)

    def forget_idle(self, idle_s: float) -> int:
        """Drop requests without a delta for `idle_s` (moved to another detokenizer, or ended
        in an engine that is gone); returns how many."""
        cutoff = time.monotonic() - idle_s
        idle = [rid for rid, req in self.requests.items() if req.last_delta_time < cutoff]
        for rid in idle:
            del self.requests[rid]
        return len(idle)
