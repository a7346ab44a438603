"""Stop conditions on token ids and text: EOS, stop token ids, max_tokens, max_model_len, stop strings."""
from shared.sampling_params import SamplingParams
from shared.incremental_detokenizer import find_stop_string
from services.engine.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, params: SamplingParams, eos_token_ids: list[int],
               max_model_len: int, new_text_len: int = 0) -> None:
    """Set `seq.status` (and `stop_reason`) if the token just appended ends the sequence."""
    num_out = seq.num_output_tokens
    token = seq.last_token_id
    if num_out >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
        if token in params.stop_token_ids:
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token
            return
        hit = find_stop_string(seq.output_text, new_text_len, params.stop,
                               params.include_stop_str_in_output)
        if hit is not None:
            seq.stop_reason, cut = hit
            seq.output_text = seq.output_text[:cut]
            seq.status = SequenceStatus.FINISHED_STOPPED
            return
    if params.max_tokens is not None and num_out >= params.max_tokens:
        seq.status = SequenceStatus.FINISHED_LENGTH
    elif seq.num_known_tokens >= max_model_len:
        seq.status = SequenceStatus.FINISHED_LENGTH
