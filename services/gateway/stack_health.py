"""The stack's health as the gateway sees it: the engine's HealthResponse, probed at most once per
`ttl_s`, so that checking it before every request costs nothing while the stack is up and at most
one probe timeout while it is down."""
import asyncio
import time
from dataclasses import dataclass

from proto.requests import HealthResponse
from services.gateway.metrics import SERVICE_COUNTS


@dataclass
class StackStatus:
    health: HealthResponse | None

    @property
    def missing(self) -> list[str]:
        """Services without a live process; empty when the stack can serve (all engine
        replicas ok, or some: "degraded")."""
        if self.health is None or self.health.status not in ("ok", "degraded"):
            return ["engine"]
        return [service for service, key in SERVICE_COUNTS.items()
                if not int(self.health.details.get(key) or 0)]

    @property
    def ready(self) -> bool:
        return not self.missing

    @property
    def engine_coming_back(self) -> bool:
        """Only the engine or its workers are missing, and the engine is down, starting,
        stalled or recovering from a worker's loss: it may serve again soon, so a request may
        wait for it. Not so for an engine whose workers' set-up failed ("failed"): it waits
        for someone to start new worker processes."""
        if self.health is None:
            return True
        if not set(self.missing) <= {"engine", "worker"}:
            return False
        return (self.health.status in ("starting", "stalled")
                or bool(self.health.details.get("recovering")))

    @property
    def degraded(self) -> bool:
        """Some engine replicas are not ok; the stack serves from the others."""
        return self.health is not None and self.health.status == "degraded"

    def explain(self) -> str:
        if self.health is None:
            return "the engine is not answering"
        if self.degraded:
            details = self.health.details
            down = [str(k) for k in range(int(details.get("replicas") or 0))
                    if details.get(f"replica{k}_status") != "ok"]
            return f"engine replica(s) {', '.join(down)} not ok; serving from the others"
        if self.health.status != "ok":
            return f"the engine is {self.health.status}"
        return "no live " + ", ".join(self.missing) + " process"


class StackHealth:
    def __init__(self, client, ttl_s: float = 1.0, probe_timeout_s: float = 1.0):
        self.client = client
        self.ttl_s = ttl_s
        self.probe_timeout_s = probe_timeout_s
        self._status: StackStatus | None = None
        self._checked_at = 0.0
        self._probe: asyncio.Task | None = None

    async def status(self) -> StackStatus:
        if self._status is not None and time.monotonic() - self._checked_at < self.ttl_s:
            return self._status
        # Concurrent callers share one probe instead of each waiting for its own.
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._refresh())
        return await asyncio.shield(self._probe)

    async def _refresh(self) -> StackStatus:
        health = await self.client.health(self.probe_timeout_s)
        self._status = StackStatus(health)
        self._checked_at = time.monotonic()
        return self._status
