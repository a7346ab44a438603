"""Executor for the offline engine with tensor_parallel_size > 1: rank 0 runs in this process
(as UniProcExecutor's one worker) and leads the group; ranks 1.. run in child processes that
follow it (services/worker/follower_process.py).

The group meets on a free port of 127.0.0.1. The CPUs this process may use are split between
the ranks, each running one OpenMP thread per CPU of its share, so that the ranks' threads do
not take turns on the same cores: the children are started bound to theirs, and in this process
torch's thread count and the calling thread's affinity are set to rank 0's share until
`shutdown` (`LLM.close`). OpenMP threads this process started before keep their own affinity.
"""
import os
import pickle
import subprocess
import sys
from collections import deque

import torch

from proto.messages import ExecuteModelRequest, SamplerOutput
from shared.config import PagodaConfig
from shared.logging import get_logger
from shared.placement import rank_cpus
from shared.sockets import free_tcp_ports
from services.engine.executor.base import Executor
from services.worker.distributed import GroupBroken
from services.worker.worker import Worker

log = get_logger("executor")

# A follower waits for the leader's next step for as long as the user's program leaves the
# engine idle; a dead leader still breaks the group at once (its sockets close).
_GROUP_TIMEOUT_S = 7 * 24 * 3600.0
_JOIN_S = 10.0  # for a follower to exit once told to stop
_JOIN_TIMEOUT_S = 120.0  # for the followers to start and join the group


class TensorParallelExecutor(Executor):
    def __init__(self, config: PagodaConfig):
        super().__init__(config)
        world = config.parallel_config.tensor_parallel_size
        addr = f"tcp://127.0.0.1:{free_tcp_ports('127.0.0.1')[0]}"
        cpus = sorted(os.sched_getaffinity(0))
        blob = pickle.dumps(config)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))))  # the folder that holds `services`
        self.followers: list[subprocess.Popen] = []
        for rank in range(1, world):
            env = {**os.environ, **_follower_env(rank_cpus(cpus, rank, world)),
                   "PYTHONPATH": os.pathsep.join(
                       [root] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
            proc = subprocess.Popen(
                [sys.executable, "-m", "services.worker.follower_process", str(rank), addr,
                 str(_GROUP_TIMEOUT_S), str(_JOIN_TIMEOUT_S)], stdin=subprocess.PIPE, env=env)
            proc.stdin.write(blob)
            proc.stdin.close()
            self.followers.append(proc)
        self._saved_threads = torch.get_num_threads()
        self._saved_affinity = os.sched_getaffinity(0)
        own = rank_cpus(cpus, 0, world)
        torch.set_num_threads(len(own))
        os.sched_setaffinity(0, own)
        log.info("tensor-parallel group starting", world_size=world, addr=addr,
                 followers=[p.pid for p in self.followers])
        try:
            self.worker = Worker(config, 0, addr, _GROUP_TIMEOUT_S, _JOIN_TIMEOUT_S)
            self.worker.init_device()
            self.worker.load_model()
        except BaseException:
            self.shutdown()
            raise
        self._pending: deque[ExecuteModelRequest] = deque()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        self._relay_call("determine_num_available_blocks", [])
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self._relay_call("initialize_cache", [num_device_blocks, num_cpu_blocks])
        self.worker.initialize_cache(num_device_blocks, num_cpu_blocks)

    def _relay_call(self, method: str, args: list[int]) -> None:
        from proto.control import WorkerCall
        self._check_followers()
        self.worker.relay(WorkerCall(-1, method, args))

    def submit(self, request: ExecuteModelRequest) -> None:
        self._pending.append(request)  # run when collected (the group's steps run in lockstep)

    def collect(self) -> SamplerOutput:
        request = self._pending.popleft()
        self._check_followers()
        try:
            self.worker.relay(request)
            return self.worker.execute_model(request)
        except GroupBroken as e:
            raise RuntimeError(f"a tensor-parallel rank died: {self._follower_states()}") from e

    def _check_followers(self) -> None:
        if any(p.poll() is not None for p in self.followers):
            raise RuntimeError(f"a tensor-parallel rank died: {self._follower_states()}")

    def _follower_states(self) -> str:
        return ", ".join(f"rank {i + 1}: " + ("alive" if p.poll() is None else f"exit {p.poll()}")
                         for i, p in enumerate(self.followers))

    def shutdown(self) -> None:
        if getattr(self, "_shut_down", False):
            return
        self._shut_down = True
        worker = getattr(self, "worker", None)
        if worker is not None and worker.group is not None:
            try:
                worker.stop_followers()
            except GroupBroken:
                pass
        for proc in self.followers:
            try:
                proc.wait(_JOIN_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if worker is not None and worker.group is not None:
            worker.group.destroy()
        torch.set_num_threads(self._saved_threads)
        os.sched_setaffinity(0, self._saved_affinity)


def _follower_env(cpus: list[int]) -> dict[str, str]:
    """What a follower's OpenMP runtime and apply_placement read: one bound thread per CPU."""
    return {"PAGODA_CPUS": ",".join(map(str, cpus)), "OMP_NUM_THREADS": str(len(cpus)),
            "OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus), "OMP_PROC_BIND": "close"}
