"""The engine service's output: each request's new tokens, as TokenDeltas, to a detokenizer.

A request's detokenizer is picked when the request first produces output and kept for its
lifetime; the request's first delta carries its header (sampling parameters, the prompt's last
tokens, ...). While no detokenizer is alive, output waits in `undelivered`. A finished
request's last deltas are kept a while (`delivered`): when a detokenizer is lost (a send to it
fails, or its heartbeats stop), its requests, and the finished ones it may not have read, start
over on another one.
"""
import time
import zlib
from collections import deque

import zmq

from proto.codec import encode
from proto.requests import (ErrorResponse, PromptDelta, RequestTokenDelta, SequenceTokenDelta,
                            TokenDeltas)
from shared.logging import get_logger
from shared.sockets import PushRoutes

log = get_logger("engine")

_DETOK_CONTEXT = 5  # prompt tokens the detokenizer decodes before the first output token


class OutputDelivery:
    """Sends the engine's output to the detokenizers over the service's ROUTER socket."""

    def __init__(self, sock: zmq.Socket, routes: PushRoutes, detokenizers: dict[bytes, float],
                 liveness_timeout_s: float, engine, on_finished):
        self.sock = sock  # the detokenizers' ROUTER, ROUTER_MANDATORY
        self.routes = routes  # to the clients: a request's error goes straight back
        self.detokenizers = detokenizers  # the service's peer table: identity -> last heartbeat
        self.liveness_timeout_s = liveness_timeout_s
        self.engine = engine  # an LLMEngine: its groups are looked up when a detokenizer is lost
        self.on_finished = on_finished  # called with each finished request it delivers
        self.gateway_of: dict[str, str] = {}  # request id -> the client's return address
        self.detok_of: dict[str, bytes] = {}  # request id -> its detokenizer (sticky)
        # Requests whose output waits for a live detokenizer (theirs died, none is left).
        self.undelivered: dict[str, object] = {}
        # Finished requests' last deltas, kept a while by detokenizer: if that one dies with
        # them unread, they are replayed to another. (monotonic time, detok, group, gateway)
        self.delivered: deque[tuple[float, bytes, object, str]] = deque()
        self.losses = 0  # detokenizers lost

    def send_deltas(self, groups, step_id: int) -> None:
        """The groups' new tokens to their detokenizers, one TokenDeltas per detokenizer
        (`step_id` -1: not a step's output); a request that failed gets an ErrorResponse instead."""
        by_detok: dict[bytes, list[RequestTokenDelta]] = {}
        now = time.monotonic()
        for group in groups:
            request_id = group.request_id
            gateway = self.gateway_of.get(request_id)
            if gateway is None:
                continue
            if group.is_finished():
                self.on_finished(group)
            if group.error is not None:
                self.routes.send(gateway, encode(ErrorResponse(request_id, 400, group.error)))
                self.gateway_of.pop(request_id, None)
                continue
            detok = self._detokenizer_for(request_id)
            if detok is None:
                self.undelivered[request_id] = group  # sent once a detokenizer is back
                continue
            self.undelivered.pop(request_id, None)
            by_detok.setdefault(detok, []).append(self._token_delta(group, gateway))
            if group.is_finished():
                self.gateway_of.pop(request_id, None)
                self.detok_of.pop(request_id, None)
                self.delivered.append((now, detok, group, gateway))
        for detok, deltas in by_detok.items():
            try:
                self.sock.send_multipart([detok, encode(TokenDeltas(step_id, deltas))])
            except zmq.ZMQError as e:
                self.detokenizer_lost(detok, f"unreachable: {e}")

    def _token_delta(self, group, gateway: str) -> RequestTokenDelta:
        first = not group.header_sent
        params = group.sampling_params
        seqs = []
        for seq in group.seqs:
            end = seq.num_known_tokens
            start = seq.prompt_len + seq.num_emitted
            new = seq.token_ids[start:end]
            if not new and not seq.is_finished():
                continue
            delta = SequenceTokenDelta(seq.sample_index, new, num_output_tokens=end - seq.prompt_len,
                                       finish_reason=seq.status.finish_reason,
                                       stop_reason=seq.stop_reason)
            if params.logprobs is not None:
                lps = seq.output_logprobs[seq.num_emitted:seq.num_emitted + len(new)]
                delta.logprobs = [d[t] for d, t in zip(lps, new)]
                delta.top_token_ids = [list(d) for d in lps]
                delta.top_logprobs = [list(d.values()) for d in lps]
            seq.num_emitted += len(new)
            seqs.append(delta)
        group.header_sent = True
        if not first:
            return RequestTokenDelta(group.request_id, gateway, group.prompt_len, seqs)
        return RequestTokenDelta(
            group.request_id, gateway, group.prompt_len, seqs, sampling_params=params,
            prompt_tail_token_ids=group.prompt_token_ids[-_DETOK_CONTEXT:],
            prompt=_prompt_delta(group), queue_time_s=group.metrics.time_in_queue,
            num_cached_tokens=group.num_cached_tokens)

    def _detokenizer_for(self, request_id: str) -> bytes | None:
        detok = self.detok_of.get(request_id)
        if detok is not None:
            return detok
        # Prefer those that beat recently; a slow one (a loaded machine) is still better than
        # none. A dead one is dropped when a send to it fails (ROUTER_MANDATORY).
        now = time.monotonic()
        known = self.detokenizers
        live = sorted(k for k, t in known.items() if now - t < self.liveness_timeout_s)
        candidates = live or sorted(known)
        if not candidates:
            return None
        detok = candidates[zlib.crc32(request_id.encode()) % len(candidates)]
        self.detok_of[request_id] = detok
        return detok

    def deliver_held(self) -> None:
        """Send the output that waited for a detokenizer, once one is known again."""
        if self._any_detokenizer():
            groups = list(self.undelivered.values())
            self.undelivered.clear()
            self.send_deltas(groups, -1)

    def _any_detokenizer(self) -> bool:
        return bool(self.detokenizers)

    def forget(self, request_id: str) -> None:
        """A request that ended early: nothing more goes out for it."""
        self.gateway_of.pop(request_id, None)
        self.detok_of.pop(request_id, None)
        self.undelivered.pop(request_id, None)

    # -- lost detokenizers ---------------------------------------------------------------------
    def check_detokenizers(self, now: float) -> None:
        """Forget finished requests' deltas kept for twice the liveness timeout; a detokenizer
        whose heartbeats stopped while it holds requests is lost."""
        timeout = self.liveness_timeout_s
        while self.delivered and now - self.delivered[0][0] > 2 * timeout:
            self.delivered.popleft()
        stale = [d for d, seen in self.detokenizers.items() if now - seen > timeout]
        if stale:
            busy = set(self.detok_of.values()) | {entry[1] for entry in self.delivered}
            for detok in stale:
                if detok in busy:
                    self.detokenizer_lost(detok, f"no heartbeat for {timeout:.0f} s")

    def detokenizer_lost(self, detok: bytes, reason: str) -> None:
        """Its requests start over on another detokenizer: parameters and every output token
        again (clients drop the text they already have by its offset)."""
        self.detokenizers.pop(detok, None)
        self.losses += 1
        moved = []
        for request_id, d in list(self.detok_of.items()):
            if d == detok:
                del self.detok_of[request_id]
                group = self.engine.groups.get(request_id)
                if group is not None and request_id in self.gateway_of:
                    moved.append(group)
        kept: deque = deque()
        for entry in self.delivered:
            if entry[1] == detok:
                self.gateway_of[entry[2].request_id] = entry[3]
                moved.append(entry[2])
            else:
                kept.append(entry)
        self.delivered = kept
        for group in moved:
            group.header_sent = False
            for seq in group.seqs:
                seq.num_emitted = 0
            self.undelivered[group.request_id] = group
        log.warning("detokenizer lost; its requests move to another", reason=reason,
                    requests=len(moved))


def _prompt_delta(group) -> PromptDelta | None:
    """The prompt's token ids and logprobs for a request's header, when it asked for them."""
    if not group.return_prompt_token_ids and group.prompt_logprobs is None:
        return None
    prompt = group.prompt_token_ids
    delta = PromptDelta(list(prompt))
    for pos, entry in enumerate(group.prompt_logprobs or []):
        if entry is not None:  # position 0 has none
            delta.logprobs.append(entry[prompt[pos]])
            delta.top_token_ids.append(list(entry))
            delta.top_logprobs.append(list(entry.values()))
    return delta
