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
