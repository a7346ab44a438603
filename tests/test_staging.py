"""The step inputs' staging buffer: the layout of the one host-to-device copy (pure, no GPU
needed) and, on the CPU, the views it hands out. The pinned memory and the non-blocking copy
run only on a GPU, which this machine lacks."""
import numpy as np
import torch

from services.worker.staging import _ALIGN, StagingBuffer, pack_layout


def test_arrays_are_laid_out_in_order_aligned_and_apart():
    slots, total = pack_layout({"input_ids": (7,), "block_tables": (3, 5), "seq_lens": (3,),
                                "empty": (0,)})
    assert [s.name for s in slots] == ["input_ids", "block_tables", "seq_lens", "empty"]
    for a, b in zip(slots, slots[1:]):
        assert a.offset % _ALIGN == 0 and a.offset + a.size <= b.offset
    assert slots[1].size == 15 and total >= slots[-1].offset + slots[-1].size
    assert total % _ALIGN == 0


def test_views_hold_each_array_and_the_buffer_grows_when_a_step_needs_more():
    buffer = StagingBuffer(torch.device("cpu"), initial_elements=32)
    rng = np.random.default_rng(0)
    for num_tokens in (5, 200, 3):  # the second step outgrows the first buffer
        arrays = {"input_ids": rng.integers(0, 50_000, num_tokens),
                  "positions": np.arange(num_tokens, dtype=np.int64),
                  "block_tables": rng.integers(0, 1000, (4, 9))}
        views = buffer.transfer(arrays)
        for name, array in arrays.items():
            assert views[name].dtype == torch.int64
            assert views[name].shape == array.shape
            assert torch.equal(views[name], torch.from_numpy(array.astype(np.int64)))


def test_float32_and_bool_arrays_cross_as_themselves_and_other_integers_as_int64():
    """The sampling parameters ride in the same copy: float32 and bool views over the int64
    buffer, their bytes padded to whole words, the next array still aligned."""
    buffer = StagingBuffer(torch.device("cpu"), initial_elements=8)
    rng = np.random.default_rng(1)
    for num_rows in (1, 3, 70):
        arrays = {"temperature": rng.random(num_rows, dtype=np.float32),
                  "is_greedy": rng.random(num_rows) < 0.5,
                  "top_k": rng.integers(1, 100, num_rows).astype(np.int32),
                  "top_p": rng.random(num_rows, dtype=np.float32)}
        slots, _ = pack_layout({n: a.shape for n, a in arrays.items()},
                               {n: a.dtype for n, a in arrays.items()})
        assert all(s.offset % _ALIGN == 0 for s in slots)
        views = buffer.transfer(arrays)
        assert views["temperature"].dtype == views["top_p"].dtype == torch.float32
        assert views["is_greedy"].dtype == torch.bool and views["top_k"].dtype == torch.int64
        for name, array in arrays.items():
            assert views[name].tolist() == array.tolist()


def test_an_array_of_another_type_is_refused():
    try:
        pack_layout({"x": (3,)}, {"x": np.dtype(np.float64)})
    except TypeError as e:
        assert "float64" in str(e)
    else:
        raise AssertionError("a float64 array was laid out")
