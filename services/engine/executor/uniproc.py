"""Executor that runs one Worker in the engine's own process (tests, debugging, offline LLM)."""
from collections import deque

from proto.messages import ExecuteModelRequest, SamplerOutput
from shared.config import PagodaConfig
from services.engine.executor.base import Executor
from services.worker.model_runner import LaunchedStep
from services.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: PagodaConfig):
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.init_device()
        self.worker.load_model()
        self._launched: deque[LaunchedStep] = deque()  # in order, behind self._finished
        self._finished: deque[SamplerOutput] = deque()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_available_blocks()

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.initialize_cache(num_device_blocks, num_cpu_blocks)

    def submit(self, request: ExecuteModelRequest) -> None:
        # Launched now, ahead of the collection of the step before it where that step's samples
        # are needed only as inputs (as a worker process launches the steps queued behind a
        # running one); finished when collected, in order.
        if self._launched and not self.worker.can_launch_ahead(request):
            while self._launched:
                self._finished.append(self.worker.finish(self._launched.popleft()))
        self._launched.append(self.worker.launch(request))

    def collect(self) -> SamplerOutput:
        if self._finished:
            return self._finished.popleft()
        return self.worker.finish(self._launched.popleft())
