"""EngineWatch: what a client (client.py) knows of its engine replicas, and what it does with
its requests in flight when one restarts, goes away or comes back.

Every `probe_interval_s` the client probes each replica's control socket. A replica that
answers from another process (its boot id changed) gets the requests it had again, with their
output so far; with several replicas, the requests of one that has gone silent move to a live
one; once none has answered "ok" for `output_timeout_s`, every request fails with 503. New
requests are bound to the least loaded live replica (`replicas.least_loaded`).
"""
import asyncio
import contextlib
import functools
import time
from collections.abc import Callable

from shared.logging import get_logger
from shared.sockets import probe_health
from shared.stack_config import StackConfig
from services.gateway.replicas import EngineReplica, combined_health, least_loaded
from services.gateway.request_stream import RESUBMIT, EngineRequestError, RequestStream

log = get_logger("client")


class EngineWatch:
    def __init__(self, stack: StackConfig, streams: dict[str, RequestStream],
                 output_timeout_s: float, engine_timeout_s: float):
        self.streams = streams  # the client's requests in flight, by id (shared, not copied)
        self.curve = stack.curve
        self.output_timeout_s = output_timeout_s
        self.engine_timeout_s = engine_timeout_s
        self.replicas = [EngineReplica(k, addr) for k, addr in
                         enumerate(stack.replica_addresses("engine_control"))]
        self._turn = 0  # where ties between equally loaded replicas start
        self.probed = False  # the first probe is done
        self._back = asyncio.Event()  # set while some replica is ok
        self._back.set()

    # -- what is known -------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        """Some engine replica answers "ok" (until a probe says otherwise)."""
        return any(r.ok for r in self.replicas)

    def away_s(self) -> float:
        """How long no engine replica has been answering "ok" (0 while one does)."""
        if self.ok:
            return 0.0
        return time.monotonic() - max(r.last_ok for r in self.replicas)

    @property
    def given_up(self) -> bool:
        """The engine has been away for longer than a request may wait for it."""
        return self.away_s() > self.output_timeout_s

    async def health(self, timeout_s: float = 1.0):
        """The engine's HealthResponse, or None if it is down; with several replicas, their
        answers combined (`replicas.combined_health`)."""
        return combined_health(await self._probe_replicas(timeout_s))

    # -- requests ------------------------------------------------------------------------------
    def bind(self, request_id: str, stream: RequestStream) -> None:
        """Bind a request to the least loaded live replica (it stays there unless that one
        goes away); with one replica, to it."""
        replica = least_loaded(self.replicas, self._turn) or self.replicas[stream.replica]
        self._turn += 1
        replica.sent_since_answer += 1
        stream.replica, stream.engine_epoch = replica.index, replica.epoch
        if len(self.replicas) > 1:
            log.info("request bound to a replica", request_id=request_id,
                     replica=replica.index, load=replica.load + replica.sent_since_answer)

    async def wait(self, request_id: str) -> None:
        """Returns once the engine answers ok; 503 once it has been away too long."""
        while not self.ok:
            left = self.output_timeout_s - self.away_s()
            if left <= 0:
                raise EngineRequestError(
                    503, f"the engine has not been available for {self.away_s():.0f} s; "
                         f"retry later", request_id)
            with contextlib.suppress(asyncio.TimeoutError):
                # Not `wait_for`: AsyncEngineClient.generate says why.
                async with asyncio.timeout(left):
                    await self._back.wait()

    # -- probing -------------------------------------------------------------------------------
    async def run(self, probe_interval_s: Callable[[], float]) -> None:
        """Probe forever, `probe_interval_s()` apart (read each time: the client may change
        it)."""
        while True:
            await self.probe()
            await asyncio.sleep(probe_interval_s())

    async def probe(self) -> None:
        """Probe every engine replica once. When another engine process answers for one,
        send its requests in flight to it again (once it is ok); the requests of a replica
        that is not ok move to a live one; when none has answered ok for `output_timeout_s`,
        fail them."""
        sent = time.monotonic()
        answers = await self._probe_replicas(min(1.0, self.engine_timeout_s))
        now = time.monotonic()
        first = not self.probed
        self.probed = True
        for replica, health in zip(self.replicas, answers):
            self._observe(replica, health, sent, now, first)
        if self.ok:
            self._back.set()
        else:
            self._back.clear()
        if len(self.replicas) > 1 and self.ok:
            self._move_streams()
        if self.given_up:
            self._fail_streams(f"the engine has not been available for {self.away_s():.0f} s")

    async def _probe_replicas(self, timeout_s: float) -> list:
        return await asyncio.gather(*(asyncio.to_thread(functools.partial(
            probe_health, r.control_addr, timeout_s, curve=self.curve)) for r in self.replicas))

    def _observe(self, replica: EngineReplica, health, sent: float, now: float,
                 first: bool) -> None:
        """What one probe of a replica (sent at `sent`) says: restarted, ok or not, its load
        and progress."""
        rlog = log.bind(replica=replica.index) if len(self.replicas) > 1 else log
        if health is not None:
            boot_id = health.details.get("boot_id")
            if replica.boot_id is not None and boot_id != replica.boot_id:
                replica.epoch += 1
                rlog.warning("the engine restarted; requests in flight will be sent to it "
                             "again", pid=health.details.get("pid"),
                             requests=self._count_on(replica))
            replica.boot_id = boot_id
            replica.last_answer = now
            replica.observe(health, sent)
            ok = health.status == "ok"
            if ok != replica.ok:
                rlog.info("engine available" if ok else "engine not available",
                          status=health.status)
            self._set_ok(replica, ok, now)
            if ok and replica.resumed_epoch < replica.epoch:
                replica.resumed_epoch = replica.epoch
                self._resubmit_streams(replica)
        elif first:
            # Never seen: away from now on (not since this client was made, maybe long ago).
            rlog.warning("no engine answers", addr=replica.control_addr)
            replica.last_answer = replica.last_ok = now
            self._set_ok(replica, False, now)
        elif now - replica.last_answer > self.engine_timeout_s:
            if replica.ok:
                rlog.warning("the engine is not answering; requests wait for it",
                             silent_s=round(now - replica.last_answer, 1),
                             requests=self._count_on(replica))
            self._set_ok(replica, False, now)

    def _count_on(self, replica: EngineReplica) -> int:
        return sum(s.replica == replica.index for s in self.streams.values())

    @staticmethod
    def _set_ok(replica: EngineReplica, ok: bool, now: float) -> None:
        if ok:
            replica.last_ok = now
        replica.ok = ok

    def _resubmit_streams(self, replica: EngineReplica) -> None:
        """A replica's engine restarted and is ok: its requests go to it again."""
        for stream in self.streams.values():
            if (stream.replica == replica.index and stream.engine_epoch < replica.epoch
                    and not stream.failed):
                stream.engine_epoch = replica.epoch
                stream.queue.put_nowait(RESUBMIT)

    def _move_streams(self) -> None:
        """The requests of replicas whose engine is gone (silent for the engine timeout, or a
        new process that does not have them) go, with their output so far, to live ones
        (`LLMEngine.resume_outputs` there), each to the least loaded at its turn. A replica
        that answers but is not ok (recovering its workers, say) keeps its requests: it still
        holds them and goes on with them, and a copy elsewhere would run twice."""
        now = time.monotonic()
        for request_id, stream in self.streams.items():
            old = self.replicas[stream.replica]
            gone = (now - old.last_answer > self.engine_timeout_s
                    or stream.engine_epoch < old.epoch)
            if old.ok or stream.failed or not gone:
                continue
            self.bind(request_id, stream)
            log.warning("request moved to another engine replica", request_id=request_id,
                        replica=stream.replica, from_replica=old.index,
                        resumed_tokens=sum(map(len, stream.token_ids.values())))
            stream.queue.put_nowait(RESUBMIT)

    def _fail_streams(self, message: str) -> None:
        for request_id, stream in self.streams.items():
            if not stream.failed:
                stream.failed = True
                stream.queue.put_nowait(EngineRequestError(503, message, request_id))
