"""Worker: one device's model, KV cache and runner (the seed's Worker).

With tensor_parallel_size > 1 it is one rank of a group (services/worker/distributed.py): the
leader (rank 0) relays every message from the engine to the others before handling it, and
each rank then does the same work on its own part of the model (`serve_follower` is the other
ranks' loop).
"""
import dataclasses
import gc
import os
import time
from collections.abc import Callable

import structlog
import torch

from proto.codec import decode, encode
from proto.control import WorkerCall
from proto.messages import ExecuteModelRequest, SamplerOutput
from shared.config import PagodaConfig, device_for_rank
from services.worker.cache_engine import CacheEngine
from services.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_apply
from services.worker.distributed import TensorParallelGroup
from services.worker.host_memory import keep_freed_memory
from services.worker.memory_budget import ProfileMemory, num_kv_blocks
from services.worker.model_runner import LaunchedStep, ModelRunner
from shared.tensor_parallel import shard_for

log = structlog.get_logger("worker")

_GIB = 1 << 30


def step_memory_error(step_id: int, allocated_at_start: int, step_peak: int,
                      profile_transient: int) -> str | None:
    """PAGODA_DEBUG_MEMORY's check of one step: what it allocated above what was held when it
    started (weights, KV cache, graphs) may not exceed what the profile run allocated above the
    weights, which the KV budget left room for. -> the error, or None."""
    over = step_peak - allocated_at_start
    if over <= profile_transient:
        return None
    return (f"step {step_id} peaked {over / _GIB:.3f} GiB above its start, more than the "
            f"profile run's {profile_transient / _GIB:.3f} GiB that the KV cache budget left "
            f"room for")


class Worker:
    def __init__(self, config: PagodaConfig, rank: int = 0, dist_init_addr: str = "",
                 group_timeout_s: float = 300.0, join_timeout_s: float = 120.0):
        """`dist_init_addr` (tcp://host:port): where a tensor-parallel group meets, rank 0
        hosting the store; `join_timeout_s`: how long a rank waits for the others to join;
        `group_timeout_s`: how long a collective may wait for a rank."""
        self.config = config
        self.rank = rank
        self.world_size = config.parallel_config.tensor_parallel_size
        self.dist_init_addr = dist_init_addr
        self.group_timeout_s = group_timeout_s
        self.join_timeout_s = join_timeout_s
        self.group: TensorParallelGroup | None = None
        device = config.device_config.device
        if device.type == "cuda":
            # One GPU per rank; the runner and every tensor read the device from the config.
            device = device_for_rank(device, rank, torch.cuda.device_count())
            config.device_config.device = device
        self.device = device
        self.free_at_start: int | None = None  # device bytes free before the model loaded
        self.shard = shard_for(config.model_config.hf_config, rank, self.world_size)
        self.model_runner = ModelRunner(config, self.shard)
        self.cache_engine: CacheEngine | None = None
        self.draft_cache_engine: CacheEngine | None = None  # the draft model's, if any
        # PAGODA_DEBUG_MEMORY=1 (CUDA): every step's peak checked against the profile's.
        self.debug_memory = os.environ.get("PAGODA_DEBUG_MEMORY") == "1"
        self.profile_transient: int | None = None  # the profile's peak above the weights

    def init_device(self) -> None:
        torch.manual_seed(self.config.model_config.seed)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            self.free_at_start, _ = torch.cuda.mem_get_info(self.device)
        elif self.device.type == "cpu":
            keep_freed_memory()  # activations reuse their pages step after step
        if self.world_size > 1:
            if not self.dist_init_addr:
                raise ValueError("tensor_parallel_size > 1 needs dist_init_addr (tcp://host:port "
                                 "of rank 0, PAGODA_DIST_INIT_ADDR)")
            log.info("joining the tensor-parallel group", rank=self.rank,
                     world_size=self.world_size, addr=self.dist_init_addr)
            self.group = TensorParallelGroup.create(self.rank, self.world_size,
                                                    self.dist_init_addr, self.device,
                                                    self.group_timeout_s, self.join_timeout_s)
            self.model_runner.group = self.group

    def load_model(self) -> None:
        self.model_runner.load_model()

    @torch.inference_mode()
    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, CPU swap blocks) that fit the memory budget after a profile run.
        A cache this worker still holds (an engine before this one) is freed first: it would
        count against the budget, and sit beside the new cache while that is allocated."""
        self.free_cache()
        cache = self.config.cache_config
        block_bytes = CacheEngine.get_cache_block_size_bytes(cache, self.config.model_config,
                                                             self.shard.num_kv_heads)
        draft = self.model_runner.draft
        if draft is not None:  # each block has a slot in the draft's cache too
            block_bytes += CacheEngine.get_cache_block_size_bytes(cache, draft.model_config,
                                                                  draft.num_kv_heads)
        # Only preemption by swap ever moves blocks to the CPU.
        swap = self.config.scheduler_config.preemption_mode == "swap"
        num_cpu = int(cache.swap_space_gib * _GIB) // block_bytes if swap else 0
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override, num_cpu
        if self.device.type == "cpu":
            return self._fewest_over_ranks(int(cache.kv_cache_space_gib * _GIB) // block_bytes,
                                           num_cpu)
        sched = self.config.scheduler_config
        # The profile's peak holds the weights too (allocated all along; free_at_start was
        # before them), but not the transients of loading them.
        torch.cuda.reset_peak_memory_stats(self.device)
        held_before = torch.cuda.memory_allocated(self.device)
        self.model_runner.profile_run(sched.max_num_batched_tokens, sched.max_num_seqs)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        profile = ProfileMemory(
            free_at_start=self.free_at_start, free_after=free_after,
            torch_peak=torch.cuda.max_memory_allocated(self.device),
            torch_reserved=torch.cuda.memory_reserved(self.device))
        self.profile_transient = profile.torch_peak - held_before
        torch.cuda.empty_cache()
        num_blocks = num_kv_blocks(profile, cache.gpu_memory_utilization, block_bytes)
        log.info("memory profiled", free_at_start_gib=round(profile.free_at_start / _GIB, 2),
                 peak_gib=round(profile.torch_peak / _GIB, 2), device_blocks=num_blocks)
        return self._fewest_over_ranks(num_blocks, num_cpu)

    def _fewest_over_ranks(self, num_device: int, num_cpu: int) -> tuple[int, int]:
        """Every rank holds every block (of its own heads): the group has the fewest any has."""
        if self.group is None:
            return num_device, num_cpu
        num_device, num_cpu = self.group.min_ints([num_device, num_cpu])
        return num_device, num_cpu

    def initialize_cache(self, num_device_blocks: int, num_cpu_blocks: int) -> None:
        self.free_cache()  # never two caches at once
        cache = self.config.cache_config
        cache.num_device_blocks = num_device_blocks
        cache.num_cpu_blocks = num_cpu_blocks
        self.cache_engine = CacheEngine(cache, self.config.model_config, self.device,
                                        self.shard.num_kv_heads)
        self.model_runner.kv_caches = self.cache_engine.device_cache
        draft = self.model_runner.draft
        if draft is not None:  # the same block ids; never swapped (a swapped-in sequence
            # recomputes its draft KV), so no CPU blocks
            self.draft_cache_engine = CacheEngine(
                dataclasses.replace(cache, num_cpu_blocks=0), draft.model_config, self.device,
                draft.num_kv_heads)
            draft.kv_caches = self.draft_cache_engine.device_cache
        log.info("kv cache ready", device_blocks=num_device_blocks, cpu_blocks=num_cpu_blocks,
                 block_size=cache.block_size,
                 kv_cache_dtype=str(self.cache_engine.dtype).removeprefix("torch."),
                 attention_backend=self.model_runner.attn_backend.name)
        self.capture_decode_graphs()

    def capture_decode_graphs(self) -> None:
        """After the profile and the cache, before serving: decode steps as CUDA graphs (on
        CUDA with the Triton attention, unless --enforce-eager)."""
        runner, dc = self.model_runner, self.config.device_config
        # (Not with a group: its collectives would have to be captured as well.)
        if self.group is not None or not graphs_apply(self.device, dc.enforce_eager,
                                                      runner.attn_backend.name):
            if self.device.type == "cuda":
                log.info("decode steps run eagerly", enforce_eager=dc.enforce_eager,
                         attention_backend=runner.attn_backend.name)
            return
        sizes = capture_sizes(self.config.scheduler_config.max_num_seqs)
        start = time.perf_counter()
        graphs = DecodeGraphs(runner.model, runner.kv_caches, sizes,
                              self.config.model_config.max_model_len,
                              self.config.cache_config.block_size, self.device)
        try:
            graphs.capture()
        except Exception as e:  # a worker that serves eagerly beats one that cannot start
            log.warning("decode graph capture failed; decode steps run eagerly",
                        error=f"{type(e).__name__}: {e}")
            graphs = None  # its half-made graphs and their pool go with it
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            return
        runner.decode_graphs = graphs
        log.info("decode graphs captured", batch_sizes=f"{sizes[0]}-{sizes[-1]}",
                 num_graphs=len(sizes), seconds=round(time.perf_counter() - start, 1),
                 reserved_gib=round(torch.cuda.memory_reserved(self.device) / _GIB, 2))

    def free_cache(self) -> None:
        """Drops the KV cache (device and swap) and the runner's sequences, whose K/V it held:
        they belong to the engine that made the cache, and a new one must not find them as its
        own. On CUDA the memory goes back to the device, so that a profile sees it free; on the
        CPU a layer's cache is unmapped with it where it has a mapping of its own (host_memory;
        smaller ones share a mapping with other tensors)."""
        runner = self.model_runner
        runner.decode_graphs = None  # they read the cache being dropped
        runner.kv_caches = None
        if runner.draft is not None:
            runner.draft.kv_caches = None
        self.draft_cache_engine = None
        runner.seqs.clear()
        runner.requests.clear()
        runner.fan_out.clear()
        self.cache_engine = None
        gc.collect()  # whatever cycle still holds a cache tensor
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- messages from the engine ---------------------------------------------------------------
    def relay(self, message: ExecuteModelRequest | WorkerCall, frame: bytes | None = None) -> None:
        """A group's leader: pass the engine's message (its encoded `frame`, when at hand) on
        to the other ranks, which must handle it too. Nothing to do on one rank."""
        if self.group is not None and self.group.is_leader:
            self.group.broadcast_frame(frame if frame is not None else encode(message))

    def call(self, method: str, args: list[int]) -> list[int]:
        """A setup call by name (proto.control.WorkerCall)."""
        if method == "determine_num_available_blocks":
            return list(self.determine_num_available_blocks())
        if method == "initialize_cache":
            # Both calls free the cache of an engine before this one (or one that lost
            # track of this worker), and the sequences it held there.
            self.initialize_cache(*args)
            return []
        raise ValueError(f"unknown call {method!r}")

    def serve_follower(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """A rank other than the leader: handle what the leader relays until it says stop
        (WorkerCall "stop") or `should_stop()` (checked after each message or ping, which
        comes at least every few seconds); GroupBroken when the group breaks."""
        while not should_stop():
            frame = self.group.receive_frame()
            if frame is None:
                continue  # a ping, answered
            msg = decode(frame, (ExecuteModelRequest, WorkerCall))
            if isinstance(msg, ExecuteModelRequest):
                self.execute_model(msg)
            elif msg.method == "stop":
                return
            else:
                self.call(msg.method, msg.args)

    def stop_followers(self) -> None:
        """The leader: let the other ranks' `serve_follower` return."""
        self.relay(WorkerCall(-1, "stop", []))

    def execute_model(self, request: ExecuteModelRequest) -> SamplerOutput:
        return self.finish(self.launch(request))

    def can_launch_ahead(self, request: ExecuteModelRequest) -> bool:
        """Whether `request` may be launched before the steps launched so far are finished
        (ModelRunner.can_launch_ahead); never with block moves, nor under the memory check,
        which measures one step at a time."""
        return (not (request.blocks_to_swap_out or request.blocks_to_swap_in
                     or request.blocks_to_copy or self._checks_memory)
                and self.model_runner.can_launch_ahead(request))

    @property
    def _checks_memory(self) -> bool:
        return (self.debug_memory and self.device.type == "cuda"
                and self.profile_transient is not None)

    def launch(self, request: ExecuteModelRequest) -> LaunchedStep:
        """Starts the step (ModelRunner.launch): on a GPU it runs on after this returns."""
        # Block moves first: this step's sequences may read blocks just swapped in or copied.
        if request.blocks_to_swap_out:
            self.cache_engine.swap_out(request.blocks_to_swap_out)
        if request.blocks_to_swap_in:
            self.cache_engine.swap_in(request.blocks_to_swap_in)
        if request.blocks_to_copy:
            self.cache_engine.copy(request.blocks_to_copy)
        if not self._checks_memory:
            return self.model_runner.launch(request)
        start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        step = self.model_runner.launch(request)
        self.model_runner.finish(step)  # the whole step's peak, before the next one starts
        error = step_memory_error(request.step_id, start,
                                  torch.cuda.max_memory_allocated(self.device),
                                  self.profile_transient)
        assert error is None, error
        return step

    def finish(self, step: LaunchedStep) -> SamplerOutput:
        """The launched step's output, waiting for the device if it is still running."""
        return self.model_runner.finish(step)
