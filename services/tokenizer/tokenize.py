"""The tokenizer stage's work: chat template, encode, checks. No sockets here."""
from dataclasses import dataclass

from proto.requests import ChatMessage, EngineRequest, GenerateRequest
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
    def __init__(self, tokenizer, checks: PromptChecks, hf_config=None):
        self.tokenizer = tokenizer
        self.checks = checks
        self.eos_token_ids = eos_token_ids(tokenizer, hf_config)

    def encode_prompt(self, prompt: str | list[int] | list[ChatMessage]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], ChatMessage):
            messages = [{"role": m.role, "content": m.content} for m in prompt]
            try:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                          add_generation_prompt=True)
            except Exception as e:  # a template may reject a conversation (roles, order)
                raise RequestRejected(f"messages: the chat template refused them: {e}") from None
            # The template already holds any BOS token.
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return None, list(prompt)

    def tokenize(self, req: GenerateRequest) -> EngineRequest:
        text, ids = self.encode_prompt(req.prompt)
        if not ids:
            raise RequestRejected("prompt: the prompt is empty")
        vocab = self.checks.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt: token ids out of range [0, {vocab}): {bad[:5]}")
        limit = self.checks.max_model_len
        params = req.sampling_params
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
                             self.eos_token_ids, req.arrival_time, req.cache_salt, req.resumed)
