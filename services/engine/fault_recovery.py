"""The engine service's fault handling: lost workers and gateways, stalled steps, and worker
setups that fail (main.py's docstring lists the faults; a lost detokenizer's requests are moved
by OutputDelivery, services/engine/output_delivery.py).

`FaultRecovery` is a part of `EngineService` kept in its own file: its methods work on the
service's executor, engine, steps in flight, peer table, output delivery and health status.
"""
import time

from services.engine.executor.zmq_executor import WorkerCallError, WorkerLost
from services.engine.llm_engine import LLMEngine, NoKVCacheError
from shared.logging import get_logger

log = get_logger("engine")

_MAX_SETUP_ATTEMPTS = 3  # KV cache set-ups that may fail for the same worker processes
_SETUP_RETRY_S = 1.0


class FaultRecovery:
    """Mixed into EngineService: notices lost peers and stuck steps, and sets the workers' KV
    cache up, at start and again once a lost worker is replaced."""

    def _check_peers(self, now: float) -> None:
        if self.executor.has_all_workers():
            self.executor.check_liveness()
        timeout = self.stack.liveness_timeout_s
        self.delivery.check_detokenizers(now)
        for gateway in [g for g, seen in self.peers["gateway"].items() if now - seen > timeout]:
            self._gateway_lost(gateway, f"no heartbeat for {timeout:.0f} s")
        if self.executor.ready:
            self.executor.check_progress(self.stack.step_timeout_s)

    def _gateway_lost(self, gateway: str, reason: str) -> None:
        """A client process died: nobody reads its requests' output any more. They are
        aborted, which frees their blocks. (A client that never sent a heartbeat is never
        taken for dead.)"""
        del self.peers["gateway"][gateway]
        self.lost_gateways.add(gateway)  # its requests still upstream are dropped as they come
        self.gateway_losses += 1
        request_ids = [r for r, g in self.delivery.gateway_of.items() if g == gateway]
        log.warning("gateway lost; aborting its requests", gateway=gateway, reason=reason,
                    requests=len(request_ids))
        if request_ids:
            self._end_requests(request_ids, "gateway lost", tell_detokenizer=True)

    def _worker_lost(self, error: WorkerLost) -> None:
        ranks = self.executor.drop_lost_workers()
        self.in_flight.clear()
        num_requests = self.engine.recover_from_worker_loss()
        self.worker_losses += 1
        log.error("worker lost; its requests will be recomputed on its replacement",
                  error=str(error), ranks=ranks, requests=num_requests)

    def _build_engine(self, config):
        """The LLMEngine, once the workers' KV cache is set up. A setup that fails is tried
        again, `_MAX_SETUP_ATTEMPTS` times for the same worker processes; then they are
        ignored (health says why) until new ones register."""
        while True:
            self.executor.wait_for_workers(float("inf"))
            try:
                engine = LLMEngine(config, lambda _: self.executor, detokenize=False)
            except WorkerLost as e:
                log.error("a worker was lost while the KV cache was set up", error=str(e))
                self.executor.drop_lost_workers()
                continue
            except (WorkerCallError, NoKVCacheError) as e:
                self._setup_failed(e)
                continue
            self._setup_ok()
            return engine

    def _setup_failed(self, error: Exception) -> None:
        instances = self.executor.worker_instances()
        attempt = self.setup_failures[instances] = self.setup_failures.get(instances, 0) + 1
        log.error("worker setup failed", error=str(error), attempt=attempt,
                  max_attempts=_MAX_SETUP_ATTEMPTS, workers=list(instances))
        if attempt < _MAX_SETUP_ATTEMPTS:
            time.sleep(_SETUP_RETRY_S)
            return
        self.executor.refuse_workers()
        self.status = "failed"
        self.setup_error = (f"{error} (failed {attempt} times; these worker processes are "
                            f"ignored until new ones register)")
        log.error("giving up on these worker processes; waiting for new ones",
                  workers=list(instances), error=str(error))

    def _setup_ok(self) -> None:
        self.setup_error = None
        self.setup_failures.clear()
        if self.status == "failed":
            self.status = "ok"

    def _reinitialize_workers(self) -> None:
        """Once every rank has a worker again: size and initialize the new KV cache."""
        if not self.executor.has_all_workers():
            return
        try:
            num_device_blocks, num_cpu_blocks = self.executor.determine_num_available_blocks()
            if num_device_blocks <= 0:
                raise NoKVCacheError("the new worker has no memory for a KV cache")
            self.executor.initialize_cache(num_device_blocks, num_cpu_blocks)
        except (WorkerCallError, NoKVCacheError) as e:
            self._setup_failed(e)
            if self.executor.has_all_workers():
                raise WorkerLost(str(e)) from None  # dropped, to register and try again
            return  # refused: a new worker process must come
        self._setup_ok()
        self.engine.resize_cache(num_device_blocks, num_cpu_blocks)
        log.info("workers back; resuming", device_blocks=num_device_blocks,
                 waiting=len(self.engine.scheduler.waiting))
