"""What a request reports after a step: its RequestOutput, built from its sequence group."""
from shared.outputs import CompletionOutput, RequestOutput
from services.engine.sequence import SequenceGroup


def build_request_output(group: SequenceGroup, tokenizer) -> RequestOutput:
    """The group's RequestOutput now. Without stop strings the text is decoded once, at the
    end (`tokenizer` None: no text); with them the incremental text is already there."""
    finished = group.is_finished()
    params = group.sampling_params
    completions = []
    for seq in sorted(group.seqs, key=lambda s: s.sample_index):
        text = seq.output_text
        if not params.stop and finished and tokenizer is not None:
            text = tokenizer.decode(seq.output_token_ids,
                                    skip_special_tokens=params.skip_special_tokens)
        completions.append(CompletionOutput(
            index=seq.sample_index, text=text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.output_logprobs if params.logprobs is not None else None,
            finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
    return RequestOutput(
        request_id=group.request_id, prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids, prompt_logprobs=group.prompt_logprobs,
        outputs=completions, finished=finished, metrics=group.metrics,
        num_cached_tokens=group.num_cached_tokens or 0, error=group.error)
