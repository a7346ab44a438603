"""Addresses of the stack's sockets, from flags or environment (`PAGODA_*`).

Locally they default to `ipc://` files in one run directory; inside compose they are
`tcp://service:port` names on the private network. Stateless stages (tokenizers, workers,
detokenizers, clients) connect; the engine, which everything fans in to, binds.
"""
import argparse
import os
import tempfile
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.curve import CurveKeys


def default_run_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"pagoda-{os.getuid()}")


@dataclass
class StackConfig:
    run_dir: str = ""
    # The engine binds these.
    request_input: str = ""  # clients PUSH GenerateRequest here (forwarded to tokenizers)
    tokenizer_input: str = ""  # tokenizers PULL GenerateRequest from here (round robin)
    engine_input: str = ""  # EngineRequest, AbortRequest, FinishRequest fan in here
    worker_addr: str = ""  # workers connect (DEALER) and register
    detokenizer_addr: str = ""  # detokenizers connect (DEALER) and register
    # This process's control socket (health probes); one per process.
    control_addr: str = ""
    # The engine's control socket, which clients probe for the stack's health.
    engine_control: str = ""
    # Host that a client advertises in its return address (its gateway id).
    return_host: str = "127.0.0.1"
    # Seconds without an answer after which a peer counts as gone.
    liveness_timeout_s: float = 10.0
    # Seconds a step may stay in flight with no output before its worker counts as stuck
    # (it may still heartbeat) and the engine recovers as from a worker death. Longer than the
    # slowest step, shorter than the gateway's --request-timeout (60 s), so that requests
    # wait for the recovery instead of timing out first.
    step_timeout_s: float = 30.0
    # A CurveZMQ key directory (`pagoda keys DIR`): every socket encrypted, and only holders
    # of an authorized key get in. "" (default): no CURVE, for one host or a private network.
    curve_keys_dir: str = ""
    # How chat requests are served. chat_template: a Jinja template (a file, or a template
    # shipped in shared/templates such as `hermes_tools`) used instead of the model's, by the
    # tokenizers. tool_call_parser (`hermes`, `llama3_json`, `mistral`) and reasoning_parser
    # (`deepseek_r1`, `qwen3`): how the gateway reads tool calls and <think> spans out of the
    # model's text; "" (default): none.
    chat_template: str = ""
    tool_call_parser: str = ""
    reasoning_parser: str = ""
    # A request's own `chat_template` is Jinja that the gateway and the tokenizers run: refused
    # (400) unless the operator trusts its clients with that (vLLM's flag of the same name).
    trust_request_chat_template: bool = False

    def __post_init__(self):
        self.run_dir = self.run_dir or os.environ.get("PAGODA_RUN_DIR") or default_run_dir()
        for f in fields(self):
            env = os.environ.get("PAGODA_" + f.name.upper())
            current = getattr(self, f.name)
            if env is not None and current in ("", f.default):
                setattr(self, f.name, _from_text(env, f.default))
        ipc = lambda name: f"ipc://{os.path.join(self.run_dir, name)}"  # noqa: E731
        self.request_input = self.request_input or ipc("requests.sock")
        self.tokenizer_input = self.tokenizer_input or ipc("tokenizer-input.sock")
        self.engine_input = self.engine_input or ipc("engine-input.sock")
        self.worker_addr = self.worker_addr or ipc("workers.sock")
        self.detokenizer_addr = self.detokenizer_addr or ipc("detokenizers.sock")
        self.engine_control = self.engine_control or ipc("engine-0.ctl")

    def control_for(self, service: str, instance: int | str = 0) -> str:
        """A process's own control address when none was given explicitly."""
        if self.control_addr:
            return self.control_addr
        if service == "engine":
            return self.engine_control
        return f"ipc://{os.path.join(self.run_dir, f'{service}-{instance}.ctl')}"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        group = parser.add_argument_group("stack addresses (default: PAGODA_* environment, "
                                          "then ipc files in the run directory)")
        for f in fields(cls):
            group.add_argument("--" + f.name.replace("_", "-"), default=None,
                               type=lambda text, d=f.default: _from_text(text, d))
        return parser

    @property
    def curve(self) -> "CurveKeys | None":
        """The stack's CURVE keys (read once per process); None when CURVE is off."""
        from shared.curve import load_keys
        return load_keys(self.curve_keys_dir) if self.curve_keys_dir else None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "StackConfig":
        """The stack of a service process: its keys become the process's (shared.curve.use),
        so every socket it binds or connects uses them; a bad key directory stops it here."""
        from shared.curve import CurveKeysError, use
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        stack = cls(**given)
        try:
            use(stack.curve_keys_dir)
        except CurveKeysError as e:
            raise SystemExit(f"pagoda: {e}") from None
        return stack

    def to_env(self) -> dict[str, str]:
        return {"PAGODA_" + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)
                if f.name != "control_addr"}


def _from_text(text: str, default):
    """A setting given as text (environment, command line), as the type of its default."""
    if isinstance(default, bool):
        if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("1", "true", "yes", "on")
    return type(default)(text) if default != "" else text
