"""OpenAI requests -> the engine's SamplingParams and prompts, for both endpoints: vLLM's
ranges and extensions checked, a bad value a 400 that names its field."""
import contextlib
import json

from services.gateway.api_errors import APIError
from services.gateway.extensions import (ExtensionError, check_best_of, check_prompt_logprobs,
                                         check_refused, check_stream_options, with_extensions)
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from shared.sampling_params import SamplingParams, SamplingParamsError
from shared.structured_output import StructuredOutputsParams, check_supported


_OPTIONAL_FLOATS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty")


def _sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                     logprobs: int | None, rename: dict[str, str]) -> SamplingParams:
    kwargs = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
        logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        structured_outputs=_structured_outputs(req), logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids)
    for name in _OPTIONAL_FLOATS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as e:
        param = rename.get(e.field, e.field)
        raise APIError(400, str(e).replace(e.field, param, 1), param=param) from None


def _structured_outputs(req: CompletionRequest | ChatCompletionRequest
                        ) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` or OpenAI's `response_format`, checked against what the
    grammar library can honour (a 400 names what it cannot)."""
    fmt, so = req.response_format, req.structured_outputs
    from_format = fmt is not None and fmt.type != "text"
    if from_format and so is not None:
        raise APIError(400, "response_format: give response_format or structured_outputs, "
                            "not both", param="response_format")
    try:
        if so is not None:
            fields = so.model_dump(exclude_none=True, exclude_defaults=True)
            if "json_schema" in fields:
                schema = fields.pop("json_schema")
                fields["json"] = schema if isinstance(schema, (dict, str)) else json.dumps(schema)
            params = StructuredOutputsParams(**fields)
        elif from_format and fmt.type == "json_object":
            params = StructuredOutputsParams(json_object=True)
        elif from_format:
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format.json_schema: the json_schema type needs "
                                    "json_schema.schema", param="response_format.json_schema")
            params = StructuredOutputsParams(json=fmt.json_schema.json_schema)
        else:
            return None
        check_supported(params)
    except SamplingParamsError as e:
        param = e.field
        if so is None:  # name the field the request used
            param = param.replace("structured_outputs.json", "response_format.json_schema.schema"
                                  ).replace("structured_outputs", "response_format")
        raise APIError(400, str(e).replace(e.field, param, 1), param=param) from None
    return params


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias: keys must be token ids (integers, as strings)",
                       param="logit_bias") from None


def _refuse_unsupported(req, checks: dict[str, tuple[bool, str]]) -> None:
    for param, (refused, why) in checks.items():
        if refused:
            raise APIError(400, f"{param}: {why}", param=param)
    with extension_errors():
        check_stream_options(req)
        check_refused(req)
        check_prompt_logprobs(req)


@contextlib.contextmanager
def extension_errors():
    """An ExtensionError raised inside becomes a 400 that names its field."""
    try:
        yield
    except ExtensionError as e:
        raise APIError(400, str(e), param=e.param) from None


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {})
    with extension_errors():
        check_best_of(req)
    params = _sampling_params(req, req.max_tokens, req.logprobs, rename={})
    # echo with logprobs returns the prompt's logprobs too; best_of ranks samples by theirs.
    asked = [k for k in (req.prompt_logprobs, req.logprobs if req.echo else None)
             if k is not None]
    best_of = req.best_of if req.best_of is not None and req.best_of > req.n else None
    with extension_errors():
        return with_extensions(params, prompt_logprobs=max(asked) if asked else None,
                               best_of=best_of, logprobs=0 if best_of else None)


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    _refuse_unsupported(req, {
        "top_logprobs": (req.top_logprobs is not None and not req.logprobs,
                         "top_logprobs needs logprobs to be true"),
    })
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rename = {"logprobs": "top_logprobs"}
    if req.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    params = _sampling_params(req, max_tokens, logprobs, rename)
    with extension_errors():
        return with_extensions(params, prompt_logprobs=req.prompt_logprobs)


def completion_prompts(prompt) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of text or token-id prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]
