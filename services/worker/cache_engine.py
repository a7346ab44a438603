"""The paged KV cache: device blocks the attention backend reads and writes, and CPU blocks that
preempted sequences are swapped out to."""
import torch

from pagoda_kernels.reference import KV_CACHE_TORCH_DTYPES, cache_row_width
from services.worker.host_memory import host_empty
from shared.config import CacheConfig, ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]


def kv_cache_dtype(cache_config: CacheConfig, model_config: ModelConfig) -> torch.dtype:
    """The dtype the cache blocks hold: the model's for --kv-cache-dtype auto, else the 8-bit
    one (the layouts are in pagoda_kernels/reference.py)."""
    if cache_config.kv_cache_dtype == "auto":
        return model_config.dtype
    return KV_CACHE_TORCH_DTYPES[cache_config.kv_cache_dtype]


class CacheEngine:
    """Allocates the caches and moves blocks. Moves run in inference mode, so that they work
    whether or not the caches were made inside it."""

    def __init__(self, cache_config: CacheConfig, model_config: ModelConfig, device: torch.device,
                 num_kv_heads: int | None = None):
        """`num_kv_heads`: this tensor-parallel rank's (default: the model's)."""
        assert cache_config.num_device_blocks is not None and cache_config.num_cpu_blocks is not None, \
            "the number of blocks is set after the profile run"
        self.device = torch.device(device)
        self.block_size = cache_config.block_size
        self.num_device_blocks = cache_config.num_device_blocks
        self.num_cpu_blocks = cache_config.num_cpu_blocks
        num_kv_heads = num_kv_heads or model_config.num_kv_heads
        dtype = self.dtype = kv_cache_dtype(cache_config, model_config)
        block_shape = (self.block_size, num_kv_heads, cache_row_width(dtype,
                                                                      model_config.head_dim))
        # K and V of a layer live in one [2, num_blocks, ...] tensor so that a swap or copy is
        # one index op per layer. Device blocks are zero-filled: attention masks padded slots
        # but still multiplies by them, so they must hold finite numbers. On the CPU they are on
        # huge pages: a decode step streams the whole live cache (host_memory).
        shape = (2, self.num_device_blocks, *block_shape)
        self._device_kv = [host_empty(shape, dtype).zero_() if self.device.type == "cpu"
                           else torch.zeros(shape, dtype=dtype, device=self.device)
                           for _ in range(model_config.num_layers)]
        pin = self.device.type == "cuda"  # page-locked host memory for the device transfers
        self._cpu_kv = [torch.empty((2, self.num_cpu_blocks, *block_shape), dtype=dtype,
                                    pin_memory=pin)
                        for _ in range(model_config.num_layers)]
        # Per layer (k, v), each [num_blocks, block_size, num_kv_heads, head_dim (+ 4: int8)].
        self.device_cache: list[KVCache] = [(kv[0], kv[1]) for kv in self._device_kv]
        self.cpu_cache: list[KVCache] = [(kv[0], kv[1]) for kv in self._cpu_kv]
        # Blocks move as bytes (int8 scales ride in their rows): torch's index ops have no
        # float8 kernels on the CPU.
        if dtype.itemsize == 1:
            self._device_kv = [kv.view(torch.uint8) for kv in self._device_kv]
            self._cpu_kv = [kv.view(torch.uint8) for kv in self._cpu_kv]

    @torch.inference_mode()
    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu_block, device_block) pairs: CPU -> device."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for device_kv, cpu_kv in zip(self._device_kv, self._cpu_kv):
            blocks = cpu_kv.index_select(1, src).to(self.device, non_blocking=True)
            device_kv.index_copy_(1, dst, blocks)

    @torch.inference_mode()
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device_block, cpu_block) pairs: device -> CPU."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        for device_kv, cpu_kv in zip(self._device_kv, self._cpu_kv):
            cpu_kv.index_copy_(1, dst, device_kv.index_select(1, src).cpu())

    @torch.inference_mode()
    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device block pairs, for copy-on-write. Sources are read before any write."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        for device_kv in self._device_kv:
            device_kv.index_copy_(1, dst, device_kv.index_select(1, src))

    @staticmethod
    def get_cache_block_size_bytes(cache_config: CacheConfig, model_config: ModelConfig,
                                   num_kv_heads: int | None = None) -> int:
        """Bytes of one block as stored: K and V, every layer (of `num_kv_heads`, default the
        model's), int8 scales included."""
        num_kv_heads = num_kv_heads or model_config.num_kv_heads
        dtype = kv_cache_dtype(cache_config, model_config)
        elements = (cache_config.block_size * num_kv_heads
                    * cache_row_width(dtype, model_config.head_dim))
        return 2 * model_config.num_layers * elements * dtype.itemsize
