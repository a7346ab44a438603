"""vLLM's request extensions, and the OpenAI fields that need more than a sampling parameter:
their checks, and how their results are laid out in responses.

- `prompt_logprobs`: the prompt's logprobs, as vLLM returns them (`{token id: {logprob, rank,
  decoded_token}}` per position, None for the first).
- `return_token_ids`: the prompt's and each choice's token ids.
- `echo` with `logprobs` (completions): the prompt's tokens head the choice's logprobs.
- `best_of` (completions): `best_of` samples are drawn; the `n` with the highest cumulative
  logprob are returned.
- `return_tokens_as_token_ids`: logprobs name tokens `token_id:<id>`.
- `stream_options.continuous_usage_stats`: usage in every chunk.
- `truncate_prompt_tokens`: done by the tokenizer (`PromptOptions`).
"""
import dataclasses

from proto.requests import PromptOptions
from shared.outputs import CompletionOutput, RequestOutput
from services.gateway.schemas import CompletionLogprobs, UsageInfo
from shared.sampling_params import SamplingParams, SamplingParamsError

# vLLM's default --max-logprobs: the most alternatives a request may ask for, per token.
MAX_LOGPROBS = 20

# vLLM request fields pagoda declares but refuses unless they keep their default meaning,
# with why: {field: (default, reason)}.
REFUSED_VLLM_FIELDS = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "length_penalty applies to beam search, which is not supported"),
    "prompt_embeds": (None, "prompt embeddings are not supported"),
    "bad_words": (None, "bad_words is not supported (use logit_bias)"),
    "logits_processors": (None, "custom logits processors are not supported"),
    "priority": (0, "the scheduler serves requests first come, first served (priority 0)"),
    "kv_transfer_params": (None, "disaggregated prefill (KV transfer) is not supported"),
    "vllm_xargs": (None, "vllm_xargs is not supported"),
}


class ExtensionError(ValueError):
    """A request's extension field that cannot be served; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def check_refused(req) -> None:
    for name, (default, why) in REFUSED_VLLM_FIELDS.items():
        value = getattr(req, name, default)
        if value is not None and value != default and value != [] and value != {}:
            raise ExtensionError(name, why)


def check_prompt_logprobs(req) -> None:
    k = req.prompt_logprobs
    if k is None:
        return
    if k == -1:
        raise ExtensionError("prompt_logprobs", f"-1 (the whole vocabulary) is more than this "
                                                f"server's max_logprobs ({MAX_LOGPROBS})")
    if k < 0:
        raise ExtensionError("prompt_logprobs", f"must be a non-negative integer, got {k}")
    if k > MAX_LOGPROBS:
        raise ExtensionError("prompt_logprobs", f"requested {k} prompt logprobs; this server "
                                                f"allows at most max_logprobs={MAX_LOGPROBS}")
    if req.stream and k > 0:
        raise ExtensionError("prompt_logprobs", "prompt logprobs are not available when "
                                                "stream is true")


def check_best_of(req) -> None:
    if req.best_of is None:
        return
    if req.best_of < req.n:
        raise ExtensionError("best_of", f"must be at least n ({req.n}), got {req.best_of}")
    if req.stream and req.best_of > req.n:
        raise ExtensionError("best_of", "cannot be used with stream (the best samples are "
                                        "known only once all have finished)")


def check_stream_options(req) -> None:
    if req.stream_options is not None and not req.stream:
        raise ExtensionError("stream_options", "only allowed when stream is true")


def prompt_options(req) -> PromptOptions | None:
    """What the tokenizer and engine are asked of the prompt; None for the defaults."""
    options = PromptOptions(req.truncate_prompt_tokens, bool(req.return_token_ids))
    return None if options == PromptOptions() else options


def with_extensions(params: SamplingParams, *, prompt_logprobs: int | None = None,
                    best_of: int | None = None, logprobs: int | None = None) -> SamplingParams:
    """`params` with the engine-side parts of the extensions; a bad value raises
    ExtensionError naming the request's field."""
    changes = {}
    if prompt_logprobs is not None:
        changes["prompt_logprobs"] = prompt_logprobs
    if best_of is not None and best_of != params.n:
        changes["n"] = best_of
    if logprobs is not None and params.logprobs is None:
        changes["logprobs"] = logprobs
    if not changes:
        return params
    try:
        return dataclasses.replace(params, **changes)
    except SamplingParamsError as e:
        param = "best_of" if e.field == "n" else e.field
        raise ExtensionError(param, str(e).split(": ", 1)[-1]) from None


# -- responses ------------------------------------------------------------------------------------
def vllm_prompt_logprobs(out: RequestOutput, k: int, computed: int | None = None
                         ) -> list[dict | None] | None:
    """The prompt's logprobs in vLLM's shape: None for the first token, then per position the
    prompt's token and its top `k` alternatives as {token id: {logprob, rank, decoded_token}}.
    `rank` is 1 for the likeliest; None for a prompt token that is not among the top
    `computed` (what the engine was asked for: more than `k` when echo's logprobs asked more)."""
    if out.prompt_logprobs is None:
        return None
    computed = k if computed is None else computed
    result: list[dict | None] = []
    for pos, entry in enumerate(out.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        token = out.prompt_token_ids[pos]
        texts = out.prompt_logprob_texts[pos]
        order = sorted(entry, key=lambda t: -entry[t])
        # The engine's entry holds the top k and, when it is not one of them, the prompt's
        # token besides: its rank is then unknown (only the top k are computed).
        token_known = len(entry) <= computed
        item = {str(token): {"logprob": entry[token],
                             "rank": order.index(token) + 1 if token_known else None,
                             "decoded_token": texts[token]}}
        for rank, t in enumerate(order[:k], 1):
            if t != token:
                item[str(t)] = {"logprob": entry[t], "rank": rank, "decoded_token": texts[t]}
        result.append(item)
    return result


def token_names(texts: dict[int, str], as_ids: bool):
    """How logprobs name a token: its text, or (vLLM's return_tokens_as_token_ids)
    `token_id:<id>`, which stays unambiguous for tokens that are not whole characters."""
    if as_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: texts[t]


def echo_logprobs(out: RequestOutput, as_ids: bool = False,
                  k: int | None = None) -> CompletionLogprobs:
    """The prompt's part of an echoed completion's logprobs (legacy completions shape); the
    first token has none, as in OpenAI's API. `as_ids`: see `token_names`. `k`: the request's
    `logprobs`, the alternatives kept besides the prompt's token (None: all the engine gave,
    which is more when prompt_logprobs asked more)."""
    lp = CompletionLogprobs()
    offset = 0
    for token, entry, texts in zip(out.prompt_token_ids, out.prompt_logprobs,
                                   out.prompt_logprob_texts):
        name = token_names(texts, as_ids)
        lp.tokens.append(name(token))
        lp.text_offset.append(offset)
        offset += len(texts[token])
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
        else:
            lp.token_logprobs.append(entry[token])
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            kept = top if k is None else top[:k] + [(t, v) for t, v in top[k:] if t == token]
            lp.top_logprobs.append({name(t): v for t, v in kept})
    return lp


def sampled_logprob_sum(c: CompletionOutput) -> float:
    """The sum of the sampled tokens' logprobs in one output delta (0 without logprobs)."""
    if not c.logprobs:
        return 0.0
    return sum(lps[token] for lps, token in zip(c.logprobs, c.token_ids))


def best_of_order(cumulative: list[float], n: int) -> list[int]:
    """Of one prompt's samples, the `n` to return: highest cumulative logprob first."""
    return sorted(range(len(cumulative)), key=lambda k: -cumulative[k])[:n]


def usage_so_far(out: RequestOutput, with_output: bool = True) -> UsageInfo:
    """One engine request's usage up to this output (continuous_usage_stats); without its
    output tokens for a chunk sent before them."""
    p = out.num_prompt_tokens or 0
    c = (out.num_output_tokens or 0) if with_output else 0
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)
