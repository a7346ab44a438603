"""The engine replicas a client serves from (data parallelism): what it knows of each one, which
one a new request goes to, and the stack's health over all of them."""
import time
from dataclasses import dataclass, field

from proto.requests import HealthResponse

# Counts that add up over replicas (each engine reports its own).
_SUMMED = ("running", "waiting", "swapped", "device_blocks", "free_blocks", "steps",
           "prompt_tokens", "generation_tokens", "preemptions", "workers", "worker_losses",
           "detokenizer_losses", "gateway_losses", "dropped_on_arrival",
           "prefix_cache_queries", "prefix_cache_hits")
# Peers that every replica counts for itself (the shared tokenizers, detokenizers, gateways):
# the stack has what every live replica sees.
_SHARED = ("tokenizers", "detokenizers", "gateways")


@dataclass
class EngineReplica:
    """One engine replica as a client sees it, from its probes."""
    index: int
    control_addr: str
    ok: bool = True  # answering, with status "ok" (until a probe says otherwise)
    boot_id: str | None = None  # which engine process answers
    epoch: int = 0  # its restarts seen
    resumed_epoch: int = 0  # the epoch whose requests were last sent to it again
    last_answer: float = field(default_factory=time.monotonic)
    last_ok: float = field(default_factory=time.monotonic)
    load: int = 0  # its running + waiting requests at its last answer
    kv_cache_usage: float = 0.0
    sent_since_answer: int = 0  # requests this client bound to it since that answer
    # What tells a request queued behind others from one the engine no longer has, as send
    # times (monotonic) of answered probes: the engine ran a step after `stepped_after`, and
    # held no request (running, waiting or swapped out) at `idle_at`.
    steps: int = -1  # its step count at its last answer
    probed_at: float = float("-inf")  # -inf: not yet
    stepped_after: float = float("-inf")
    idle_at: float = float("-inf")

    def observe(self, health: HealthResponse, sent_at: float) -> None:
        """Take in the answer to a probe sent at `sent_at` (monotonic)."""
        if sent_at < self.probed_at:
            return  # an older probe's answer, taken in late: what is here is newer
        details = health.details
        self.load = int(details.get("running") or 0) + int(details.get("waiting") or 0)
        self.kv_cache_usage = float(details.get("kv_cache_usage") or 0.0)
        self.sent_since_answer = 0
        steps = int(details.get("steps") or 0)
        if steps != self.steps:
            # The step ran after the previous answered probe was sent: the sure bound.
            self.steps, self.stepped_after = steps, self.probed_at
        if self.load == 0 and not details.get("swapped"):
            self.idle_at = sent_at
        self.probed_at = sent_at

    def waiting_its_turn(self, stepped_since: float, quiet_since: float) -> bool:
        """Whether a request of this engine with no output since `quiet_since` waits its turn
        behind others: the engine ran a step after `stepped_since`, and no answer to a probe
        sent after `quiet_since` found it holding no requests (one it no longer has waits for
        nothing)."""
        return self.stepped_after >= stepped_since and self.idle_at < quiet_since


def least_loaded(replicas: list[EngineReplica], turn: int) -> EngineReplica | None:
    """The live replica with the fewest requests (those it reported plus those sent to it
    since), then the emptiest KV cache; ties go round, from `turn`. None when none is live."""
    live = [r for r in replicas if r.ok]
    if not live:
        return None
    n = len(replicas)
    return min(live, key=lambda r: (r.load + r.sent_since_answer, r.kv_cache_usage,
                                    (r.index - turn) % n))


def combined_health(answers: list[HealthResponse | None]) -> HealthResponse | None:
    """The stack's engine health over its replicas' answers (None: no answer). One replica: its
    answer as it is. Several: "ok" when all are, "degraded" when some are (the stack serves
    from those), else the first answer's status; counts added up, shared peers as every live
    replica sees them, and each replica's status, running and waiting as `replica<k>_*`."""
    if len(answers) == 1:
        return answers[0]
    given = [h for h in answers if h is not None]
    if not given:
        return None
    ok = [h for h in given if h.status == "ok"]
    status = ("ok" if len(ok) == len(answers) else "degraded" if ok else given[0].status)
    serving = ok or given
    details: dict = {"replicas": len(answers), "replicas_ok": len(ok)}
    for key in _SUMMED:
        values = [h.details[key] for h in serving if isinstance(h.details.get(key), (int, float))]
        if values:
            details[key] = sum(values)
    for key in _SHARED:
        details[key] = min(int(h.details.get(key) or 0) for h in serving)
    if details.get("prefix_cache_queries"):
        details["prefix_cache_hit_rate"] = round(
            details.get("prefix_cache_hits", 0) / details["prefix_cache_queries"], 4)
    usage = [h.details["kv_cache_usage"] for h in serving if "kv_cache_usage" in h.details]
    if usage:
        details["kv_cache_usage"] = round(sum(usage) / len(usage), 4)
    details["recovering"] = any(bool(h.details.get("recovering")) for h in serving)
    for h in given:
        for key in ("error", "stalled_s"):
            if key in h.details and key not in details:
                details[key] = h.details[key]
    for k, h in enumerate(answers):
        details[f"replica{k}_status"] = h.status if h is not None else "down"
        if h is not None:
            details[f"replica{k}_running"] = h.details.get("running", 0)
            details[f"replica{k}_waiting"] = h.details.get("waiting", 0)
    return HealthResponse("engine", status, details)
