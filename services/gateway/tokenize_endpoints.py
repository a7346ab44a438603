"""vLLM's tokenizer endpoints: POST /tokenize (a prompt, or chat messages) and POST /detokenize.

They run here, on the gateway's own copy of the model's tokenizer (the one `echo` of token-id
prompts loads already), not in the tokenizer service: they are a function of the tokenizer
files and the chat template alone, which this process reads as the tokenizers do, so a round
trip over ZeroMQ would add a message type and a reply path for nothing, and would queue these
calls behind generation requests. Chat messages are rendered by `shared.chat_template`'s
`render_chat`, the function the tokenizers apply, with the same --chat-template, so /tokenize
shows the token ids a chat request is given.
"""
import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import Field, NonNegativeInt, ValidationError

from proto.requests import ChatOptions
from services.gateway.schemas import RequestModel
from services.gateway.chat_tools import UNTRUSTED_TEMPLATE
from shared.chat_template import ChatTemplateError, render_chat

# Fill-in-the-middle tokens as models name them (prefix, suffix, middle).
_FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
               ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The template already holds any BOS token, so none is added by default.
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[NonNegativeInt]


class GatewayTokenizer:
    """The model's tokenizer, loaded (in a thread) on first use."""

    def __init__(self, path: str | None, chat_template: str | None = None,
                 trust_request_chat_template: bool = False):
        self.path = path
        self.chat_template = chat_template  # the served --chat-template's text, if any
        self.trust_request_chat_template = trust_request_chat_template
        self._tokenizer = None
        self._fim: tuple[tuple[str, str, str] | None] | None = None  # (the tokens,) once looked up

    async def get(self):
        if self._tokenizer is None:
            from shared.tokenizer import get_tokenizer
            self._tokenizer = await asyncio.to_thread(get_tokenizer, self.path)
        return self._tokenizer

    async def fim_tokens(self) -> tuple[str, str, str] | None:
        """The model's fill-in-the-middle tokens (prefix, suffix, middle), or None. Looked up
        once: `get_vocab` builds the whole vocabulary as a new dict each time."""
        if self._fim is None:
            vocab = (await self.get()).get_vocab()
            self._fim = (next((names for names in _FIM_TOKENS
                               if all(t in vocab for t in names)), None),)
        return self._fim[0]


def _text_of(message: dict) -> dict:
    """A message with OpenAI's content parts joined into its text, as chat requests send it."""
    content = message.get("content")
    if isinstance(content, list):
        message = {**message, "content": "".join(
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")}
    return message


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def add_tokenize_routes(app: FastAPI, tokenizer: GatewayTokenizer, max_model_len: int | None,
                        check_model: Callable[[str | None], None],
                        refuse: Callable[[int, str, str | None], Exception]) -> None:
    """`check_model` raises for a model this gateway does not serve; `refuse(status, message,
    param)` makes the API's error for a request that cannot be served."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await _json_body(request, refuse)
        chat = "messages" in body
        req = _parse(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
        check_model(req.model)
        tok = await tokenizer.get()
        if chat:
            if req.chat_template is not None and not tokenizer.trust_request_chat_template:
                raise refuse(400, f"chat_template: {UNTRUSTED_TEMPLATE}", "chat_template")
            options = ChatOptions(
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template,
                chat_template_kwargs=(json.dumps(req.chat_template_kwargs)
                                      if req.chat_template_kwargs is not None else None),
                tools=json.dumps(req.tools) if req.tools is not None else None)
            try:
                rendered = render_chat(tok, [_text_of(m) for m in req.messages], options,
                                       tokenizer.chat_template)
            except ChatTemplateError as e:
                field = str(e).split(":", 1)[0]
                raise refuse(400, str(e), field) from None
            ids = (tok.encode(rendered.text, add_special_tokens=True)
                   if req.add_special_tokens else rendered.token_ids)
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return JSONResponse({
            "count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = _parse(DetokenizeRequest, await _json_body(request, refuse))
        check_model(req.model)
        tok = await tokenizer.get()
        vocab = len(tok)
        bad = [t for t in req.tokens if t >= vocab]
        if bad:
            raise refuse(400, f"tokens: ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})


async def _json_body(request: Request, refuse) -> dict:
    try:
        body = await request.json()
    except ValueError:
        raise refuse(400, "the body is not valid JSON", None) from None
    if not isinstance(body, dict):
        raise refuse(400, "the body must be a JSON object", None)
    return body
