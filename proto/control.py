"""Messages that set the stack up: registration of stateless processes and engine→worker calls."""
from dataclasses import dataclass, field


@dataclass
class Register:
    """A process announces itself to the engine it connected to; repeated as its heartbeat."""
    service: str  # "worker", "detokenizer", "tokenizer"
    instance_id: str  # unique per process (host + pid)
    rank: int = 0  # a worker's rank in its tensor-parallel group
    ready: bool = True
    # Sent from a background thread on a socket of its own: the process is alive even while
    # its main thread is inside a long step. Only a non-heartbeat Register routes work.
    heartbeat: bool = False


@dataclass
class WorkerCall:
    """engine → worker: one setup call of the executor interface (seed §5.3)."""
    call_id: int
    # "determine_num_available_blocks" | "initialize_cache"; "stop" only inside a
    # tensor-parallel group (its leader to the other ranks)
    method: str
    args: list[int] = field(default_factory=list)


@dataclass
class WorkerReply:
    call_id: int
    result: list[int] = field(default_factory=list)
    error: str | None = None
