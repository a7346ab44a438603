"""Executor that runs one Worker in the engine's own process (tests, debugging, offline LLM)."""
from collections import deque

from proto.messages import ExecuteModelRequest, SamplerOutput
from shared.config import PagodaConfig
from services.engine.executor.base import Executor
from services.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: PagodaConfig):
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self._pending: deque[ExecuteModelRequest] = deque()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_device_blocks, num_cpu_blocks)

    def submit(self, request: ExecuteModelRequest) -> None:
        # One thread: a submitted step runs when collected (nothing to overlap with).
        self._pending.append(request)

    def collect(self) -> SamplerOutput:
        return self.worker.execute_model(self._pending.popleft())
