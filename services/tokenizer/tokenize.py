"""The tokenizer stage's work: chat template, encode, checks. No sockets here."""
from dataclasses import dataclass

from proto.requests import (ChatMessage, ChatOptions, EngineRequest, GenerateRequest,
                            PromptOptions)
from shared.chat_template import ChatTemplateError, render_chat
from shared.tokenizer import eos_token_ids


class RequestRejected(ValueError):
    """The request cannot be served as given; the message says why (sent back as a 400)."""

    def __init__(self, message: str, code: int = 400):
        super().__init__(message)
        self.code = code


@dataclass
class PromptChecks:
    max_model_len: int
    vocab_size: int


class RequestTokenizer:
    def __init__(self, tokenizer, checks: PromptChecks, hf_config=None,
                 chat_template: str | None = None):
        """`chat_template`: Jinja text that replaces the tokenizer's own (--chat-template)."""
        self.tokenizer = tokenizer
        self.checks = checks
        self.eos_token_ids = eos_token_ids(tokenizer, hf_config)
        self.chat_template = chat_template

    def encode_prompt(self, prompt: str | list[int] | list[ChatMessage],
                      chat_options: ChatOptions | None = None) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], ChatMessage):
            try:
                rendered = render_chat(self.tokenizer, prompt, chat_options, self.chat_template)
            except ChatTemplateError as e:
                raise RequestRejected(str(e)) from None
            return rendered.text, rendered.token_ids
        return None, list(prompt)

    def tokenize(self, req: GenerateRequest) -> EngineRequest:
        text, ids = self.encode_prompt(req.prompt, req.chat_options)
        if not ids:
            raise RequestRejected("prompt: the prompt is empty")
        vocab = self.checks.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt: token ids out of range [0, {vocab}): {bad[:5]}")
        limit = self.checks.max_model_len
        params = req.sampling_params
        options = req.prompt_options or PromptOptions()
        if options.truncate_prompt_tokens is not None:
            ids, cut = self.truncate(ids, options.truncate_prompt_tokens)
            text = None if cut else text  # the text no longer matches the ids
        if len(ids) >= limit:
            raise RequestRejected(
                f"prompt: this model's maximum context length is {limit} tokens; the prompt has "
                f"{len(ids)} tokens (at most {limit - 1} leave room for one output token)")
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise RequestRejected(
                f"max_tokens: this model's maximum context length is {limit} tokens; the prompt "
                f"has {len(ids)} tokens and max_tokens is {params.max_tokens} "
                f"({len(ids) + params.max_tokens} in all)")
        bad_stop = [t for t in params.stop_token_ids if t >= vocab]
        if bad_stop:
            raise RequestRejected(f"stop_token_ids: ids out of range [0, {vocab}): {bad_stop[:5]}")
        return EngineRequest(req.request_id, req.gateway_id, text, ids, params,
                             self.eos_token_ids, req.arrival_time, req.cache_salt, req.resumed,
                             options.return_prompt_token_ids)

    def truncate(self, ids: list[int], keep: int) -> tuple[list[int], bool]:
        """The prompt's last `keep` tokens (-1: the last max_model_len), as vLLM's
        truncate_prompt_tokens; and whether any were cut."""
        limit = self.checks.max_model_len
        if keep == -1:
            keep = limit
        if keep < 1:
            raise RequestRejected(f"truncate_prompt_tokens: must be -1 or at least 1, got {keep}")
        if keep > limit:
            raise RequestRejected(f"truncate_prompt_tokens: {keep} is more than this model's "
                                  f"maximum context length ({limit} tokens)")
        return ids[-keep:], len(ids) > keep
