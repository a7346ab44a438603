"""The gateway's FastAPI app: OpenAI-compatible routes over an `AsyncEngineClient`.

`create_app(client, settings)`; the caller owns the client (and closes it after the server).
"""
import asyncio
import importlib.metadata
import secrets
import time
import uuid
from dataclasses import dataclass

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.chat_tools import ChatSettings
from services.gateway.client import EngineRequestError
from services.gateway.metrics import GatewayMetrics
from services.gateway.api_errors import APIError, api_error_from_engine, error_body
from services.gateway.schemas import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                      ModelList)
from services.gateway.serving_chat import ChatServing
from services.gateway.serving_completion import CompletionServing
from services.gateway.stack_health import StackHealth
from services.gateway.streaming import BODY_SEND_KEY
from services.gateway.tokenize_endpoints import GatewayTokenizer, add_tokenize_routes
from shared.logging import get_logger

log = get_logger("gateway")


@dataclass
class GatewaySettings:
    model_name: str  # the name responses report
    max_model_len: int | None = None
    model_aliases: tuple[str, ...] = ()  # other names requests may use (--served-model-name)
    model_root: str | None = None  # what the names serve (the model's path), for model cards
    chat_template: str | None = None  # the tokenizers' --chat-template text, for /tokenize
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    # Generation requests in flight here; past it, 429. None: no limit (as vLLM's server,
    # whose benchmark client sends 1,000 at once by default; a queue is the engine's job).
    max_pending_requests: int | None = None
    health_ttl_s: float = 1.0  # how long a probe of the engine's health is reused
    tokenizer: str | None = None  # loaded on first use: echo of token-id prompts, /tokenize
    disconnect_poll_s: float = 0.25
    # How chat outputs are read (--tool-call-parser, --reasoning-parser); None: not at all.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False  # see ChatSettings
    # `usage.prompt_tokens_details.cached_tokens` in responses (vLLM's flag of the same name).
    enable_prompt_tokens_details: bool = False


class PendingRequests:
    """Counts generation requests in flight; with a limit, refuses past it instead of
    queueing."""

    def __init__(self, limit: int | None, metrics: GatewayMetrics):
        self.limit = limit
        self.count = 0
        self.metrics = metrics

    def try_acquire(self):
        """A `release` callable (safe to call twice), or None when the gateway is full."""
        if self.limit is not None and self.count >= self.limit:
            return None
        self.count += 1
        self.metrics.pending.set(self.count)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.count -= 1
                self.metrics.pending.set(self.count)
        return release


class PromptDecoder:
    """Turns token-id prompts back into text for `echo`; loads the tokenizer on first use."""

    def __init__(self, tokenizer_path: str | None):
        self.tokenizer_path = tokenizer_path
        self._tokenizer = None

    async def __call__(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            from shared.tokenizer import get_tokenizer
            self._tokenizer = await asyncio.to_thread(get_tokenizer, self.tokenizer_path)
        return self._tokenizer.decode(token_ids)


def pagoda_version() -> str:
    try:
        return importlib.metadata.version("pagoda")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        import pagoda
        return pagoda.__version__


def _json_error(status: int, message: str, param: str | None = None, code: str | None = None,
                headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def _validation_param(loc: tuple) -> str | None:
    """The field a pydantic error blames, as OpenAI names nested ones: `messages[0].role`."""
    parts = list(loc[1:]) if loc and loc[0] == "body" else list(loc)
    if not parts or not isinstance(parts[0], str):
        return None
    param, previous = parts[0], parts[0]
    for part in parts[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(previous, int):  # a field of a list item (a message's role)
            param += f".{part}"
        else:
            break  # a union branch's type name: not a field
        previous = part
    return param


class RequestContext:
    """Plain ASGI middleware: gives each HTTP request an id bound into every log line, checks
    the API key on /v1/*, and logs one line per request."""

    def __init__(self, app: ASGIApp, api_key: str | None):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = uuid.uuid4().hex
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        scope.setdefault("state", {})["request_id"] = request_id
        # Each request runs in its own task, so this binding is the request's alone.
        structlog.contextvars.bind_contextvars(request_id=request_id)
        if "x-request-id" in headers:
            structlog.contextvars.bind_contextvars(client_request_id=headers["x-request-id"])
        status = {"code": 0}
        start = time.perf_counter()
        # A stream's body chunks may skip the wrappers below this one (they act on the
        # response's start only, which still goes through them): see EventStreamResponse.
        scope[BODY_SEND_KEY] = send

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            if scope["path"].startswith("/v1/") and not self._authorized(headers):
                response = _json_error(
                    401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key")
                await response(scope, receive, send_with_id)
                return
            await self.app(scope, receive, send_with_id)
        finally:
            log.info("http request", method=scope["method"], path=scope["path"],
                     status=status["code"], duration_s=round(time.perf_counter() - start, 4))
            structlog.contextvars.unbind_contextvars("request_id", "client_request_id")

    def _authorized(self, headers: dict[str, str]) -> bool:
        if not self.api_key:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                     self.api_key.encode())


def create_app(client, settings: GatewaySettings) -> FastAPI:
    metrics = GatewayMetrics(settings.model_name)
    health = StackHealth(client, ttl_s=settings.health_ttl_s)
    pending = PendingRequests(settings.max_pending_requests, metrics)
    decoder = PromptDecoder(settings.tokenizer)
    completions = CompletionServing(client, settings.model_name, metrics, decoder,
                                    settings.disconnect_poll_s,
                                    settings.enable_prompt_tokens_details)
    chat = ChatServing(client, settings.model_name, metrics, decoder, settings.disconnect_poll_s,
                       settings.enable_prompt_tokens_details,
                       chat_settings=ChatSettings(settings.tool_call_parser,
                                                  settings.reasoning_parser,
                                                  settings.trust_request_chat_template))
    model_names = [settings.model_name, *settings.model_aliases]
    tokenizer = GatewayTokenizer(settings.tokenizer, settings.chat_template,
                                 settings.trust_request_chat_template)
    for serving in (completions, chat):
        serving.model_names = set(model_names)
    completions.fim_tokens = tokenizer.fim_tokens

    app = FastAPI(title="pagoda", description="OpenAI-compatible API of a pagoda stack")
    app.state.metrics, app.state.health, app.state.pending = metrics, health, pending
    app.add_middleware(RequestContext, api_key=settings.api_key)

    # -- errors as OpenAI's error object ---------------------------------------------------------
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        param = _validation_param(tuple(errors[0]["loc"])) if errors else None
        same = [e for e in errors if _validation_param(tuple(e["loc"])) == param] or errors
        message = "; ".join(dict.fromkeys(e["msg"] for e in same)) or "invalid request"
        metrics.observe_error(400)
        return _json_error(400, f"{param}: {message}" if param else message, param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        metrics.observe_error(exc.status)
        log.info("request refused", status=exc.status, error=exc.message)
        return _json_error(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(EngineRequestError)
    async def on_engine_error(request: Request, exc: EngineRequestError):
        return await on_api_error(request, api_error_from_engine(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return _json_error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        metrics.observe_error(500)
        return _json_error(500, f"internal error: {exc}")

    # -- generation ------------------------------------------------------------------------------
    async def admit(request: Request):
        """Refuse at once when this gateway is full (429) or the stack cannot serve (503). An
        engine that is away (restarting, or recovering from a stuck step) is waited for, up
        to the request timeout: the client holds the request meanwhile."""
        release = pending.try_acquire()
        if release is None:
            raise APIError(429, f"too many requests in flight (limit "
                                f"{settings.max_pending_requests}); retry later",
                           code="rate_limit_exceeded", headers={"Retry-After": "1"})
        try:
            status = await health.status()
        except BaseException:
            release()
            raise
        if not status.ready and not (status.engine_coming_back and not client.engine_given_up):
            release()
            raise APIError(503, f"the stack cannot serve requests: {status.explain()}")
        return release

    async def serve(serving, body, request: Request) -> Response:
        release = await admit(request)
        try:
            if await request.is_disconnected():
                # It left while queued here (a busy gateway): nothing goes to the stack.
                release()
                return Response(status_code=499)
            return await serving.create(body, request, request.state.request_id, release)
        except BaseException:
            release()
            raise

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await serve(completions, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(chat, body, request)

    add_tokenize_routes(app, tokenizer, settings.max_model_len, completions.check_model,
                        lambda status, message, param: APIError(status, message, param))

    # -- information -----------------------------------------------------------------------------
    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=settings.model_root or settings.model_name,
                         max_model_len=settings.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(ModelList(data=[model_card(n) for n in model_names]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in model_names:
            raise APIError(404, f"The model `{model_id}` does not exist.", param="model",
                           code="model_not_found")
        return JSONResponse(model_card(model_id).model_dump())

    @app.get("/version")
    async def get_version() -> JSONResponse:
        return JSONResponse({"version": pagoda_version()})

    @app.get("/health")
    async def get_health() -> JSONResponse:
        status = await health.status()
        details = status.health.details if status.health is not None else {}
        body = {"status": ("degraded" if status.degraded else "ok") if status.ready
                else "unavailable",
                "engine": status.health.status if status.health is not None else "down",
                **{key: details.get(key, 0) for key in ("workers", "tokenizers", "detokenizers")}}
        if not status.ready:
            body["missing"] = status.missing
        if not status.ready or status.degraded:
            body["message"] = status.explain()
        for key in ("error", "stalled_s", "replicas", "replicas_ok"):
            if key in details:
                body[key] = details[key]
        return JSONResponse(body, status_code=200 if status.ready else 503)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        metrics.update_from_health((await health.status()).health)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
