"""One host-to-device copy per step for the step's inputs.

A step's inputs are a handful of small arrays: int64 token ids, positions, slot mapping, query
offsets, sequence and context lengths and block tables, and the sampling parameters per sampled
row (float32 temperatures and top-p / min-p, bool greedy flags, int64 top-k, seeds and
indices). Copied one by one from pageable memory, each is a transfer of its own; packed back to
back into one page-locked buffer they cross in one non-blocking copy, and the device tensors
are views of the one device buffer (an integer array as int64; float32 and bool arrays keep
their type, their bytes padded to whole int64 words).

`pack_layout` decides where each array goes (pure, tested on the CPU); `StagingBuffer` owns the
host and device buffers and grows them when a step needs more.
"""
from dataclasses import dataclass

import numpy as np
import torch

_ALIGN = 16  # int64 elements (128 bytes) between arrays: each view starts on its own line


_INT64 = np.dtype(np.int64)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
                 np.dtype(np.bool_): torch.bool}


@dataclass(frozen=True)
class Slot:
    name: str
    offset: int  # in int64 words from the buffer's start
    shape: tuple[int, ...]
    dtype: np.dtype = _INT64

    @property
    def size(self) -> int:
        """Elements."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def words(self) -> int:
        """int64 words the array's bytes take."""
        return -(-self.nbytes // 8)


def staged_dtype(dtype) -> np.dtype:
    """The type an array crosses as: any integer type as int64; float32 and bool as they are."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return _INT64
    if dtype not in _TORCH_DTYPES:
        raise TypeError(f"no staging for {dtype} arrays (int, float32 and bool cross)")
    return dtype


def pack_layout(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, np.dtype] | None = None
                ) -> tuple[list[Slot], int]:
    """Each array's place in one int64 buffer, in the order given (int64 unless `dtypes` says
    otherwise); returns (slots, total words). Every offset is a multiple of `_ALIGN`."""
    slots, offset = [], 0
    for name, shape in shapes.items():
        dtype = staged_dtype((dtypes or {}).get(name, _INT64))
        slot = Slot(name, offset, tuple(int(n) for n in shape), dtype)
        slots.append(slot)
        offset += -(-slot.words // _ALIGN) * _ALIGN
    return slots, offset


class StagingBuffer:
    """Host and device int64 buffers reused step after step. On CUDA the host side is two
    page-locked buffers used in turn, each with the event of its last copy, so filling one
    waits at most for the copy before last, never for the device to go idle."""

    def __init__(self, device: torch.device, initial_elements: int = 1 << 16):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._hosts: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self._events: list = [None, None]
        self._device = torch.empty(0, dtype=torch.int64, device=self.device)
        self._turn = 0
        self._reserve(initial_elements)

    def _reserve(self, num_elements: int) -> None:
        if num_elements <= self._device.numel():
            return
        size = max(num_elements, 2 * self._device.numel())
        for event in self._events:
            if event is not None:
                event.synchronize()  # nothing may still read a buffer that goes away
        self._hosts = [torch.empty(size, dtype=torch.int64, pin_memory=self.cuda)
                       for _ in range(2 if self.cuda else 1)]
        self._events = [None] * len(self._hosts)
        self._device = (torch.empty(size, dtype=torch.int64, device=self.device) if self.cuda
                        else self._hosts[0])

    def transfer(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Copy every array to the device in one transfer; returns device views by name. The
        views are valid until the next `transfer`, which overwrites the device buffer in
        stream order (after the step that reads them)."""
        arrays = {name: np.asarray(a) for name, a in arrays.items()}
        slots, total = pack_layout({name: a.shape for name, a in arrays.items()},
                                   {name: a.dtype for name, a in arrays.items()})
        self._reserve(total)
        turn = self._turn = (self._turn + 1) % len(self._hosts)
        if self._events[turn] is not None:
            self._events[turn].synchronize()  # this buffer's last copy has left it
        host = self._hosts[turn]
        flat_host = host.numpy()
        host_bytes = flat_host.view(np.uint8)
        for slot in slots:
            array = arrays[slot.name].reshape(-1)
            if slot.dtype == _INT64:
                flat_host[slot.offset:slot.offset + slot.size] = array
            else:
                start = slot.offset * 8
                host_bytes[start:start + slot.nbytes] = array.astype(slot.dtype).view(np.uint8)
        if self.cuda:
            self._device[:total].copy_(host[:total], non_blocking=True)
            event = self._events[turn] or torch.cuda.Event()
            event.record()
            self._events[turn] = event
        return {slot.name: self._view(slot) for slot in slots}

    def _view(self, slot: Slot) -> torch.Tensor:
        words = self._device[slot.offset:slot.offset + slot.words]
        if slot.dtype == _INT64:
            return words.view(slot.shape)
        return words.view(torch.uint8)[:slot.nbytes].view(_TORCH_DTYPES[slot.dtype]).view(
            slot.shape)
