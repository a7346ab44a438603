"""CUDA graphs for decode-only steps: the model's forward captured once per batch size at start-up
and replayed, so that a small decode step costs one graph launch instead of hundreds of kernel
launches from Python.

A graph reads its inputs from persistent device buffers (`DecodeInputBuffers`): token ids,
positions, slot mapping, sequence lengths and block tables as wide as the longest context. A
step of n decoding sequences replays the graph of the smallest captured size b >= n, its rows
copied into the buffers' first n rows and rows n..b made padding rows: token 0 at position 0,
written to slot -1 (the Triton cache write skips it: a padding row writes nothing) and reading
one token of block 0 (whatever it holds; the padding rows' outputs are dropped).

What keeps the captured forward valid for any step it is replayed for: the decode attention
is captured with the longest context (max_model_len), so its grid and partial buffers cover
every sequence (programs past a sequence's end return at once, a device-side test), and the
Triton backend splits a context into at most a fixed number of partitions, which bounds that
size. Only the Triton attention backend is captured: the torch reference's cache write would
send slot -1 to the cache's last slot.

The pure parts (sizes, padding, buffer layout and filling) run on any device and are tested on
the CPU (tests/test_cuda_graphs.py); the capture itself needs a GPU.
"""
import bisect
from dataclasses import dataclass

import torch

from services.worker.attention.base import AttentionMetadata

MAX_CAPTURE_SIZE = 512  # past this, a decode step's launches are a small part of its time
PAD_SLOT = -1  # a padding row's cache slot: skipped by the Triton cache write


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to the first that holds
    max_num_seqs (or `limit`) sequences."""
    top = max(1, min(max_num_seqs, limit))
    sizes = []
    size = 1
    while True:
        sizes.append(size)
        if size >= top:
            return sizes
        size = size * 2 if size < 8 else size + 8


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs rows; None when none does."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if num_seqs > 0 and i < len(sizes) else None


@dataclass(frozen=True)
class BufferLayout:
    max_batch: int  # rows of every buffer: the largest captured size
    max_blocks: int  # block table width: blocks of the longest context

    @classmethod
    def for_model(cls, max_batch: int, max_model_len: int, block_size: int) -> "BufferLayout":
        return cls(max_batch, -(-max_model_len // block_size))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        b = self.max_batch
        return {"input_ids": (b,), "positions": (b,), "slot_mapping": (b,), "seq_lens": (b,),
                "context_lens": (b,), "query_start_loc": (b + 1,),
                "block_tables": (b, self.max_blocks)}


class DecodeInputBuffers:
    """The buffers a captured graph reads (int64, on the device), and the metadata of a captured
    batch size as views of them."""

    def __init__(self, layout: BufferLayout, device: torch.device):
        self.layout = layout
        for name, shape in layout.shapes().items():
            setattr(self, name, torch.zeros(shape, dtype=torch.int64, device=device))
        # One query token per sequence: the offsets never change.
        torch.arange(layout.max_batch + 1, out=self.query_start_loc)
        self.pad_rows(0, layout.max_batch)

    def pad_rows(self, start: int, end: int) -> None:
        """Rows [start, end) become padding rows."""
        if start >= end:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slot_mapping[start:end] = PAD_SLOT
        self.seq_lens[start:end] = 1
        self.context_lens[start:end] = 0
        self.block_tables[start:end, 0] = 0  # a one-token context reads only column 0

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
             batch_size: int) -> None:
        """A decode-only step's rows into rows [0, n), rows [n, batch_size) padding. Device
        copies only: no host sync. Block table columns past the step's width keep stale
        entries, which no sequence reads (each reads only the blocks of its own length)."""
        n = meta.num_decode_tokens
        assert meta.num_prefills == 0 and n <= batch_size <= self.layout.max_batch
        width = meta.block_tables.shape[1]
        assert width <= self.layout.max_blocks, "a context longer than max_model_len"
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.context_lens[:n].copy_(meta.context_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.pad_rows(n, batch_size)

    def metadata(self, batch_size: int, max_model_len: int, block_size: int
                 ) -> AttentionMetadata:
        """A decode step of batch_size rows over the buffers, its lengths the longest context's
        (what sizes the attention's grid)."""
        b = batch_size
        return AttentionMetadata(
            num_prefills=0, num_prefill_tokens=0, num_decode_tokens=b,
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], max_query_len=1, max_seq_len=max_model_len,
            block_size=block_size, seq_lens_list=[max_model_len] * b, query_lens_list=[1] * b)


class DecodeGraphs:
    """The model's decode forward captured at each of `sizes`; called as the model is, it
    replays a graph for a decode-only step that fits and runs the model itself otherwise."""

    def __init__(self, model, kv_caches: list, sizes: list[int], max_model_len: int,
                 block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.device = device
        self.buffers = DecodeInputBuffers(
            BufferLayout.for_model(self.sizes[-1], max_model_len, block_size), device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, all in one memory pool: the smaller graphs fit in what the
        largest left. Every row is a padding row meanwhile, so nothing is written to the
        cache."""
        buffers = self.buffers
        buffers.pad_rows(0, buffers.layout.max_batch)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            meta = buffers.metadata(size, self.max_model_len, self.block_size)
            ids, positions = buffers.input_ids[:size], buffers.positions[:size]
            # Outside the graph first: Triton compiles its kernels, torch settles its caches.
            self.model(ids, positions, self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, self.kv_caches, meta)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list | None,
                 meta: AttentionMetadata) -> torch.Tensor:
        size = (padded_size(meta.num_decode_tokens, self.sizes)
                if meta.num_prefills == 0 and kv_caches is self.kv_caches else None)
        if size is None or size not in self.graphs:
            return self.model(input_ids, positions, kv_caches, meta)
        self.buffers.fill(input_ids, positions, meta, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        # A view of the graph's output: read before the next replay overwrites it.
        return hidden[:meta.num_decode_tokens]


def graphs_apply(device: torch.device, enforce_eager: bool, attention_backend: str) -> bool:
    """Whether decode steps are captured: on CUDA, unless --enforce-eager, with the Triton
    attention backend (see the module's docstring)."""
    return device.type == "cuda" and not enforce_eager and attention_backend == "triton"
