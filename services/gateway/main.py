"""`pagoda gateway`: the OpenAI-compatible HTTP API (uvicorn) in front of a pagoda stack.

It takes the engine's flags (for the served model's name and its tokenizer) and the stack's
addresses, like every other service, so one command line starts any of them.
"""
import argparse
import asyncio
import contextlib
import logging
import os
import signal

import uvicorn

from shared.engine_args import EngineArgs
from shared.gc_freeze import freeze_startup_objects
from shared.logging import configure, get_logger
from shared.stack_config import StackConfig

log = get_logger("gateway")


class GatewayServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT / SIGTERM stop serving. Unlike uvicorn's own, this does not raise the signal
        again once the server is down, so the gateway's cleanup (aborts, sockets) still runs."""
        original = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gateway")
    g.add_argument("--instance", default="0", help="names this process's control socket")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--timeout-keep-alive", type=float, default=65.0,
                   help="seconds an idle HTTP connection stays open; longer than clients' own "
                        "idle expiry (httpx: 5 s), so a client never sends on a connection the "
                        "server is closing at that moment")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $PAGODA_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="the names requests may use in `model` (any of them); the first is the "
                        "one responses report (default: $PAGODA_SERVED_MODEL_NAME, "
                        "space-separated, else the model's name)")
    g.add_argument("--max-pending-requests", type=int, default=None,
                   help="generation requests in flight in this gateway; past it, 429 at once "
                        "(default: no limit; requests queue in the engine)")
    g.add_argument("--request-timeout", type=float, default=60.0,
                   help="seconds without output after which a request fails (503, or an "
                        "error event in a stream), unless the engine ran steps in that time "
                        "and was not seen holding no requests since (the request is queued "
                        "behind others, and waits; keep it well above the 1 s health probe "
                        "interval); also how long requests wait for an engine that is away "
                        "(restarting): they are then sent to it again and go on where they "
                        "were")
    EngineArgs.add_cli_args(parser)
    StackConfig.add_cli_args(parser)


def served_model_names(flag: list[str] | None) -> list[str]:
    """--served-model-name's names, else $PAGODA_SERVED_MODEL_NAME's (how compose and
    `pagoda serve` set them), without repeats."""
    names = flag or os.environ.get("PAGODA_SERVED_MODEL_NAME", "").split()
    return list(dict.fromkeys(names))


def _max_model_len(args: argparse.Namespace) -> int | None:
    """The context length the engine will use (its flag, else the model's, as EngineArgs
    defaults it), for model cards and /tokenize. Read from the model's config alone: the
    engine's whole configuration would probe the device from this process."""
    if args.max_model_len is not None:
        return args.max_model_len
    from shared.config import load_hf_config
    from shared.model_source import resolve_model
    try:
        config = load_hf_config(resolve_model(args.model))
    except Exception as e:  # the engine reports a bad model itself
        log.warning("the model's context length is unknown", error=str(e))
        return None
    return getattr(config, "max_position_embeddings", None) or 2048


def _chat_template(stack: StackConfig) -> str | None:
    """The tokenizers' --chat-template text, so /tokenize renders chats as they do."""
    from shared.chat_template import load_chat_template
    try:
        return load_chat_template(stack.chat_template)
    except (OSError, ValueError) as e:  # the tokenizers refuse to start with it
        log.warning("the chat template cannot be loaded", error=str(e))
        return None


def raise_open_files_limit() -> tuple[int, int]:
    """Every request in flight holds a connection, so a burst of thousands needs as many file
    descriptors: raise the soft limit to the hard one (often 1,024 against 500,000 or more).
    Returns (before, after)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft, soft
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, want


def run(args: argparse.Namespace) -> int:
    configure("gateway")
    import zmq

    from services.gateway.app import GatewaySettings, create_app
    from services.gateway.client import AsyncEngineClient
    from shared.model_source import resolve_model
    from shared.sockets import ControlServer

    if args.max_pending_requests is not None and args.max_pending_requests < 1:
        raise SystemExit("--max-pending-requests must be at least 1")
    if args.request_timeout <= 0:
        raise SystemExit("--request-timeout must be positive")
    stack = StackConfig.from_cli_args(args)
    source = resolve_model(args.model)
    names = served_model_names(args.served_model_name) or [source.name]
    settings = GatewaySettings(
        model_name=names[0], model_aliases=tuple(names[1:]), model_root=args.model or source.name,
        max_model_len=_max_model_len(args), chat_template=_chat_template(stack),
        api_key=args.api_key or os.environ.get("PAGODA_API_KEY") or None,
        max_pending_requests=args.max_pending_requests,
        tokenizer=args.tokenizer or args.model,
        tool_call_parser=stack.tool_call_parser or None,
        reasoning_parser=stack.reasoning_parser or None,
        trust_request_chat_template=stack.trust_request_chat_template,
        enable_prompt_tokens_details=stack.enable_prompt_tokens_details)
    try:
        from services.gateway.chat_tools import ChatSettings
        ChatSettings(settings.tool_call_parser, settings.reasoning_parser)
    except ValueError as e:
        raise SystemExit(f"pagoda gateway: {e}") from None
    # uvicorn's own access log is replaced by the app's one structured line per request.
    logging.getLogger("uvicorn.access").disabled = True

    url = f"http://{args.host}:{args.port}"

    async def serve() -> None:
        client = AsyncEngineClient(stack, output_timeout_s=args.request_timeout)
        client.start()
        app = create_app(client, settings)
        server = GatewayServer(uvicorn.Config(app, host=args.host, port=args.port,
                                              access_log=False, log_level="warning",
                                              timeout_keep_alive=args.timeout_keep_alive,
                                              timeout_graceful_shutdown=5))

        def status() -> tuple[str, dict]:
            # This process's own health (the launcher's and compose's probes): up once HTTP
            # is served. The stack's health is GET /health.
            return ("ok" if server.started else "starting",
                    {"url": url, "requests_in_flight": app.state.pending.count,
                     "requests_resumed": client.num_resumed,
                     "resumed_tokens": client.num_resumed_tokens})

        ctx = zmq.Context()
        control = ControlServer(ctx, stack.control_for("gateway", args.instance), "gateway",
                                status).start()
        files_before, files_limit = raise_open_files_limit()
        log.info("gateway starting", url=url, model=settings.model_name,
                 frozen_objects=freeze_startup_objects(),
                 requests=stack.request_input, auth=settings.api_key is not None,
                 max_pending_requests=settings.max_pending_requests,
                 open_files_limit=files_limit, open_files_limit_was=files_before)
        try:
            await server.serve()
        finally:
            if client.streams:  # requests cut off by the shutdown: free their blocks now
                with contextlib.suppress(Exception):
                    await client.abort(list(client.streams), reason="gateway stopping")
            control.close()
            client.close()
            ctx.term()
            log.info("gateway stopped")

    with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
        runner.run(serve())
    return 0


def _event_loop_factory():
    """uvloop's event loop where it is installed (about half the loop's own cost per streamed
    chunk), else asyncio's; uvicorn likewise picks httptools' HTTP parser when it is there."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop

