"""Addresses of the stack's sockets, from flags or environment (`PAGODA_*`).

Locally they default to `ipc://` files in one run directory; inside compose they are
`tcp://service:port` names on the private network. Stateless stages (tokenizers, workers,
detokenizers, clients) connect; the engine, which everything fans in to, binds.

With data parallelism (several engine replicas) each address the engine binds holds one entry
per replica, comma-separated ("tcp://engine:5557,tcp://engine-1:5557"); ipc addresses given
once are derived for the other replicas (`engine-input.sock` -> `engine-input-r1.sock`).
`replica` says which replica a process belongs to (its engine and workers); its fields then
hold that replica's entries, and `replica_addresses` gives every replica's.
"""
import argparse
import copy
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
    # tcp://host:port where a tensor-parallel worker group meets (torch.distributed's store,
    # hosted by rank 0 on that host). Only needed with tensor_parallel_size > 1.
    dist_init_addr: str = ""
    # This process's control socket (health probes); one per process.
    control_addr: str = ""
    # The engine's control socket, which clients probe for the stack's health.
    engine_control: str = ""
    # Host that a client advertises in its return address (its gateway id).
    return_host: str = "127.0.0.1"
    # The engine replica of this process (engine, workers): which entry of each per-replica
    # address it binds or connects to. Tokenizers, detokenizers and clients serve every replica.
    replica: int = 0
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
    # usage.prompt_tokens_details.cached_tokens in responses: the prompt tokens the prefix
    # cache held (vLLM's flag of the same name; without it the field is null, as in vLLM).
    enable_prompt_tokens_details: bool = False

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
        self._replica_addrs = {name: _split(getattr(self, name)) for name in REPLICA_FIELDS}
        self.use_replicas(max(map(len, self._replica_addrs.values())))

    @property
    def num_replicas(self) -> int:
        return len(self._replica_addrs["engine_input"])

    def replica_addresses(self, name: str) -> list[str]:
        """Every replica's entry of a per-replica address (`REPLICA_FIELDS`)."""
        return list(self._replica_addrs[name])

    def use_replicas(self, count: int) -> None:
        """Give every per-replica address `count` entries: ipc files given once are derived
        (suffix -r<k>); any other address must be given once per replica. Then this process's
        fields take its replica's entries."""
        if not 0 <= self.replica < count:
            raise ValueError(f"replica {self.replica}: the stack has {count} replica(s)")
        for name in REPLICA_FIELDS:
            addrs = self._replica_addrs[name]
            if len(addrs) == 1 and count > 1 and addrs[0].startswith("ipc://"):
                addrs = [addrs[0]] + [_replica_ipc(addrs[0], k) for k in range(1, count)]
            if len(addrs) != count:
                raise ValueError(f"{name}: {len(addrs)} address(es) for {count} engine "
                                 f"replica(s); give one per replica, comma-separated")
            self._replica_addrs[name] = addrs
            setattr(self, name, addrs[self.replica])

    def set_replica_addresses(self, name: str, addrs: list[str]) -> None:
        self._replica_addrs[name] = list(addrs)
        setattr(self, name, addrs[self.replica])

    def for_replica(self, replica: int) -> "StackConfig":
        """The same stack as a process of another replica sees it."""
        other = copy.copy(self)
        other._replica_addrs = {k: list(v) for k, v in self._replica_addrs.items()}
        other.replica = replica
        other.use_replicas(self.num_replicas)
        return other

    def control_for(self, service: str, instance: int | str = 0) -> str:
        """A process's own control address when none was given explicitly."""
        if self.control_addr:
            return self.control_addr
        if service == "engine":
            return self.engine_control
        replica = f"-r{self.replica}" if self.replica else ""
        return f"ipc://{os.path.join(self.run_dir, f'{service}{replica}-{instance}.ctl')}"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser,
                     names: tuple[str, ...] | None = None,
                     title: str = "stack addresses and settings (default: PAGODA_* "
                                  "environment, then ipc files in the run directory)"
                     ) -> argparse.ArgumentParser:
        """A flag per field (of `names` only, when given); unset flags are None."""
        group = parser.add_argument_group(title)
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            # A switch may stand alone (`--trust-request-chat-template`, as vLLM takes it)
            # or take a value (`... false`).
            switch = {"nargs": "?", "const": True} if isinstance(f.default, bool) else {}
            group.add_argument("--" + f.name.replace("_", "-"), default=None,
                               type=lambda text, d=f.default: _from_text(text, d), **switch)
        return parser

    @property
    def curve(self) -> "CurveKeys | None":
        """The stack's CURVE keys (read once per process); None when CURVE is off."""
        from shared.curve import load_keys
        return load_keys(self.curve_keys_dir) if self.curve_keys_dir else None

    @classmethod
    def ignoring_env(cls, names, **given) -> "StackConfig":
        """A StackConfig of `given` that does not read the PAGODA_* variables of the fields
        `names` (whatever this environment holds for them)."""
        hidden = {k: os.environ.pop(k) for k in ["PAGODA_" + name.upper() for name in names]
                  if k in os.environ}
        try:
            return cls(**given)
        finally:
            os.environ.update(hidden)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "StackConfig":
        """The stack of a service process: its keys become the process's (shared.curve.use),
        so every socket it binds or connects uses them; a bad key directory stops it here."""
        from shared.curve import CurveKeysError, use
        given = {f.name: getattr(args, f.name) for f in fields(cls)
                 if getattr(args, f.name, None) is not None}
        # A flag wins over the environment also when it gives the default (`... false`),
        # which __post_init__ cannot tell from a field left unset: it does not see the
        # variables of the flags given.
        stack = cls.ignoring_env(given, **given)
        replicas = getattr(args, "data_parallel_size", None)  # the engine flag, where given
        if replicas and replicas > 1:
            try:
                stack.use_replicas(replicas)
            except ValueError as e:
                raise SystemExit(f"pagoda: --data-parallel-size {replicas}: {e}") from None
        try:
            use(stack.curve_keys_dir)
        except CurveKeysError as e:
            raise SystemExit(f"pagoda: {e}") from None
        return stack

    def to_env(self) -> dict[str, str]:
        env = {"PAGODA_" + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)
               if f.name != "control_addr"}
        for name, addrs in self._replica_addrs.items():
            if getattr(self, name) == addrs[self.replica]:  # else set since, as one address
                env["PAGODA_" + name.upper()] = ",".join(addrs)
        return env


# How the stack serves, as opposed to where its sockets are: `pagoda serve` takes these as flags
# too and hands them to every process as PAGODA_* variables (ops/serve_cli.py).
SERVING_FIELDS = ("chat_template", "tool_call_parser", "reasoning_parser",
                  "trust_request_chat_template", "enable_prompt_tokens_details")

# The addresses an engine binds: one per replica.
REPLICA_FIELDS = ("request_input", "tokenizer_input", "engine_input", "worker_addr",
                  "detokenizer_addr", "engine_control")


def _split(text: str) -> list[str]:
    return [a.strip() for a in text.split(",") if a.strip()] or [text]


def _replica_ipc(addr: str, replica: int) -> str:
    root, ext = os.path.splitext(addr)
    return f"{root}-r{replica}{ext}"


def _from_text(text: str, default):
    """A setting given as text (environment, command line), as the type of its default."""
    if isinstance(default, bool):
        if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise ValueError(f"not a boolean: {text!r}")
        return text.lower() in ("1", "true", "yes", "on")
    return type(default)(text) if default != "" else text
