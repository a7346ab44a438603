"""Resuming a request on a new engine: the engine that ran it died, and its client sends it
again with the output it already has (`ResumedOutput`, docs/architecture.md)."""
from collections.abc import Callable

from proto.requests import ResumedOutput
from services.engine.sequence import Sequence, SequenceGroup, SequenceStatus


def resume_outputs(group: SequenceGroup, resumed: list[ResumedOutput], vocab_size: int,
                   max_model_len: int, new_seq_id: Callable[[], int]) -> None:
    """Set up `group` (just added, not yet scheduled) to go on from `resumed`: each sample
    starts from its tokens (recomputed with the prompt, counted as output), and a sample the
    client saw finish is not run again. Raises ValueError for output that does not fit the
    request. `new_seq_id` numbers the sequences of samples after the first."""
    params = group.sampling_params
    by_index: dict[int, ResumedOutput] = {}
    for r in resumed:
        if not 0 <= r.index < params.n or r.index in by_index:
            raise ValueError(f"resumed output: sample index {r.index} repeated or not in "
                             f"[0, n={params.n})")
        by_index[r.index] = r
    vocab, max_len = vocab_size, max_model_len
    for r in by_index.values():
        if any(not 0 <= t < vocab for t in r.token_ids):
            raise ValueError(f"resumed output: token ids out of range [0, {vocab})")
        if not r.finished and (group.prompt_len + len(r.token_ids) >= max_len or (
                params.max_tokens is not None and len(r.token_ids) >= params.max_tokens)):
            raise ValueError(f"resumed output: sample {r.index} has {len(r.token_ids)} "
                             f"tokens and is not finished, but has no room to go on")
    if all(j in by_index and by_index[j].finished for j in range(params.n)):
        raise ValueError("resumed output: every sample is finished; nothing is left to run")
    # The samples of a group run in lockstep. A client holds them so (a step's output of a
    # request is one message); should one be ahead, it goes back to the others, and the
    # client drops its recomputed tokens by their offset.
    num_tokens = min((len(by_index[j].token_ids) if j in by_index else 0
                      for j in range(params.n)
                      if j not in by_index or not by_index[j].finished), default=0)
    if num_tokens == 0:
        # Nothing to go on from (a sample the client saw finish runs again, and the client
        # ignores it): it starts as a new request, with its prompt's fan-out.
        return
    # Every sample is a sequence of its own from here (the prompt was sampled already, so
    # there is no fan-out to fork), recomputed from its tokens like a preempted one.
    seqs = [group.first_seq] + [
        Sequence(new_seq_id(), group.prompt_token_ids, sample_index=j,
                 cache_salt=group.cache_salt) for j in range(1, params.n)]
    for seq in seqs:
        r = by_index.get(seq.sample_index)
        if r is None:
            continue
        token_ids = r.token_ids if r.finished else r.token_ids[:num_tokens]
        seq.token_ids.extend(token_ids)
        if params.logprobs is not None:
            # Placeholders, so later logprobs line up with their tokens; the client drops
            # this part of the output by its offset, having had the real values.
            seq.output_logprobs = [{t: 0.0} for t in token_ids]
        if r.finished:
            seq.status = SequenceStatus.FINISHED_STOPPED
    group.seqs = seqs
