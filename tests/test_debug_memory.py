"""PAGODA_DEBUG_MEMORY's per-step check (services/worker/worker.py): the arithmetic, on the CPU.
The check itself runs only on CUDA, where torch counts device allocations."""
from services.worker.worker import step_memory_error

GIB = 1 << 30


def test_a_step_within_the_profiles_transient_passes():
    # 10 GiB held (weights, cache) at the start, a 3 GiB peak above it, the profile 3 GiB.
    assert step_memory_error(7, 10 * GIB, 13 * GIB, 3 * GIB) is None
    assert step_memory_error(7, 10 * GIB, 10 * GIB, 0) is None


def test_a_step_over_the_profiles_transient_names_the_step_and_both_sizes():
    error = step_memory_error(7, 10 * GIB, 13 * GIB + 1, 3 * GIB)
    assert error is not None
    assert "step 7" in error and "3.000 GiB" in error
