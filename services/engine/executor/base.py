"""The executor interface (seed §5.3).

`submit` / `collect` let the engine keep one step in flight: it submits step N+1 while the
workers run step N, then collects N. `execute_model` is the two back to back.
"""
from abc import ABC, abstractmethod

from proto.messages import ExecuteModelRequest, SamplerOutput
from shared.config import PagodaConfig


class Executor(ABC):
    def __init__(self, config: PagodaConfig):
        self.config = config

    @abstractmethod
    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) the memory budget allows."""

    @abstractmethod
    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        ...

    @abstractmethod
    def submit(self, request: ExecuteModelRequest) -> None:
        """Start a step; steps run in submission order."""

    @abstractmethod
    def collect(self) -> SamplerOutput:
        """The output of the oldest submitted step that has not been collected."""

    def execute_model(self, request: ExecuteModelRequest) -> SamplerOutput:
        self.submit(request)
        return self.collect()

    def shutdown(self) -> None:
        pass
