"""Device selection and the GPU memory budget, as pure functions: no GPU is needed (none is on
this machine), and none of these tests pretends to be one."""
import types

import pytest
import torch

from services.worker.memory_budget import ProfileMemory, kv_cache_budget_bytes, num_kv_blocks
from shared.config import ConfigError, device_for_rank
from shared.engine_args import EngineArgs

GIB = 1 << 30


@pytest.mark.parametrize("device, rank, count, want", [
    ("cpu", 0, 0, "cpu"), ("cpu", 3, 0, "cpu"),
    ("cuda", 0, 1, "cuda:0"), ("cuda", 1, 2, "cuda:1"),
    ("cuda:1", 0, 4, "cuda:1"), ("cuda:1", 2, 4, "cuda:3"),
])
def test_each_rank_takes_its_own_device(device, rank, count, want):
    assert device_for_rank(torch.device(device), rank, count) == torch.device(want)


def test_a_rank_past_the_last_gpu_is_a_clear_error():
    with pytest.raises(ConfigError, match="rank 2 would run on cuda:3, but this host has 3"):
        device_for_rank(torch.device("cuda:1"), 2, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_without_cuda_auto_is_the_cpu_and_cuda_is_refused():
    config = EngineArgs(device="auto").create_engine_config()
    assert config.device_config.device == torch.device("cpu")
    assert config.model_config.dtype == torch.float32  # the CPU default; bf16 is CUDA's
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match="no CUDA device"):
            EngineArgs(device=name).create_engine_config()
    with pytest.raises(ConfigError, match="must be cpu or cuda"):
        EngineArgs(device="mps").create_engine_config()


def profile(free_at_start, free_after, peak, reserved) -> ProfileMemory:
    return ProfileMemory(int(free_at_start * GIB), int(free_after * GIB), int(peak * GIB),
                         int(reserved * GIB))


def test_the_budget_is_free_memory_at_start_times_utilization_less_the_profile_peak():
    # 80 GiB free; the profile's peak (weights 16 + activations 4) is all torch reserved.
    m = profile(80, 60, 20, 20)
    assert kv_cache_budget_bytes(m, 0.9) == int(80 * GIB * 0.9) - 20 * GIB
    assert num_kv_blocks(m, 0.9, 2 * 1024 * 1024) == (int(72 * GIB) - 20 * GIB) // (2 << 20)


def test_memory_taken_outside_torch_meanwhile_is_left_out_too():
    # 1.5 GiB went missing beyond torch's reservation: a CUDA context, NCCL buffers, or
    # another process that started since.
    m = profile(80, 58.5, 20, 20)
    assert kv_cache_budget_bytes(m, 0.9) == int(80 * GIB * 0.9) - 20 * GIB - int(1.5 * GIB)


def test_torch_cache_held_after_the_profile_is_not_counted_twice():
    # torch keeps 6 GiB reserved past its 20 GiB peak (freed blocks it caches): that is not
    # memory lost outside torch.
    m = profile(80, 54, 20, 26)
    assert kv_cache_budget_bytes(m, 0.9) == int(80 * GIB * 0.9) - 20 * GIB


def test_no_memory_left_is_zero_blocks_and_bad_arguments_are_errors():
    assert num_kv_blocks(profile(24, 2, 22, 22), 0.9, 1 << 20) == 0
    with pytest.raises(ValueError, match="utilization"):
        kv_cache_budget_bytes(profile(80, 60, 20, 20), 1.5)
    with pytest.raises(ValueError, match="block_bytes"):
        num_kv_blocks(profile(80, 60, 20, 20), 0.9, 0)


def test_layers_whose_weights_are_not_packed_never_build_the_cpu_kernels(monkeypatch):
    """On a GPU no weight is packed for the CPU kernels; asking whether the layer blocks run must
    then not load (compile) those kernels."""
    from pagoda_kernels import cpu as cpu_kernels
    from services.worker.models.layer_blocks import LayerBlocks

    def must_not_run():
        raise AssertionError("the CPU kernels were consulted for a layer with no packed weights")
    monkeypatch.setattr(cpu_kernels, "layer_blocks_available", must_not_run)
    unpacked = types.SimpleNamespace(packed=None)
    layer = types.SimpleNamespace(
        self_attn=types.SimpleNamespace(qkv_proj=unpacked, o_proj=unpacked, group=None),
        mlp=types.SimpleNamespace(gate_up_proj=unpacked, down_proj=unpacked))
    assert LayerBlocks.of(layer) is None
