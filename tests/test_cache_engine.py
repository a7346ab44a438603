"""CacheEngine: the paged KV cache layout, swapping between device and CPU, block copies."""
import pytest
import torch

from services.worker.cache_engine import CacheEngine
from shared.config import CacheConfig
from tests.helpers import model_config_for, tiny_llama_config

NUM_DEVICE_BLOCKS, NUM_CPU_BLOCKS, BLOCK_SIZE = 12, 6, 16


def cache_config(block_size=BLOCK_SIZE) -> CacheConfig:
    return CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, kv_cache_space_gib=1.0,
                       swap_space_gib=1.0, num_gpu_blocks_override=None,
                       enable_prefix_caching=False, num_device_blocks=NUM_DEVICE_BLOCKS,
                       num_cpu_blocks=NUM_CPU_BLOCKS)


def model_config(dtype=torch.float32):
    hf_config = tiny_llama_config()  # 3 layers, 2 KV heads of 16
    return model_config_for("unused", hf_config, dtype)


@pytest.fixture
def engine():
    engine = CacheEngine(cache_config(), model_config(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    for k, v in engine.device_cache:
        k.copy_(torch.randn(k.shape, generator=generator))
        v.copy_(torch.randn(v.shape, generator=generator))
    return engine


def snapshot(cache):
    return [(k.clone(), v.clone()) for k, v in cache]


def test_caches_have_the_paged_layout_per_layer():
    engine = CacheEngine(cache_config(), model_config(torch.bfloat16), torch.device("cpu"))
    assert len(engine.device_cache) == len(engine.cpu_cache) == 3
    for (k, v), (cpu_k, cpu_v) in zip(engine.device_cache, engine.cpu_cache):
        assert k.shape == v.shape == (NUM_DEVICE_BLOCKS, BLOCK_SIZE, 2, 16)
        assert cpu_k.shape == cpu_v.shape == (NUM_CPU_BLOCKS, BLOCK_SIZE, 2, 16)
        assert k.dtype == cpu_v.dtype == torch.bfloat16
        assert torch.count_nonzero(k) == 0  # zero-filled: masked slots must be finite


def test_swap_out_then_in_restores_blocks_into_other_device_blocks(engine):
    before = snapshot(engine.device_cache)
    engine.swap_out([(3, 0), (7, 5)])
    for k, v in engine.device_cache:
        k[[3, 7]] = 0
        v[[3, 7]] = 0
    engine.swap_in([(0, 9), (5, 2)])
    for (k, v), (k0, v0) in zip(engine.device_cache, before):
        assert torch.equal(k[9], k0[3]) and torch.equal(v[9], v0[3])
        assert torch.equal(k[2], k0[7]) and torch.equal(v[2], v0[7])
        untouched = [b for b in range(NUM_DEVICE_BLOCKS) if b not in (2, 3, 7, 9)]
        assert torch.equal(k[untouched], k0[untouched])


def test_copy_duplicates_source_blocks_and_leaves_the_rest(engine):
    before = snapshot(engine.device_cache)
    engine.copy([(1, 4), (2, 6), (1, 8)])
    for (k, v), (k0, v0) in zip(engine.device_cache, before):
        for src, dst in ((1, 4), (2, 6), (1, 8)):
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        untouched = [b for b in range(NUM_DEVICE_BLOCKS) if b not in (4, 6, 8)]
        assert torch.equal(k[untouched], k0[untouched]) and torch.equal(v[untouched], v0[untouched])


@pytest.mark.parametrize("dtype, block_size", [(torch.float32, 16), (torch.bfloat16, 32)])
def test_block_size_bytes_counts_k_and_v_of_every_layer(dtype, block_size):
    config = model_config(dtype)
    size = CacheEngine.get_cache_block_size_bytes(cache_config(block_size), config)
    assert size == 2 * 3 * block_size * 2 * 16 * dtype.itemsize
    engine = CacheEngine(cache_config(block_size), config, torch.device("cpu"))
    allocated = sum(k.nbytes + v.nbytes for k, v in engine.device_cache)
    assert allocated == size * NUM_DEVICE_BLOCKS
