"""The torch attention backend against dense per-sequence attention, on a shuffled paged cache."""
import pytest
import torch

from services.worker.attention.torch_backend import (TorchAttentionBackend, padding_pays,
                                                     prefill_calls)
from tests.helpers import PagedBatchPlanner, PagedSequence, profile_metadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM ** -0.5
BLOCK_SIZES = [8, 16, 32]


class RandomSequence(PagedSequence):
    """A sequence whose every position has fixed random q/k/v."""

    def __init__(self, length: int, generator: torch.Generator):
        super().__init__(token_ids=[0] * length)
        self.q = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=generator)
        self.k = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator)
        self.v = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=generator)


def dense_attention(seq: RandomSequence, start: int, end: int) -> torch.Tensor:
    """Queries at positions [start, end), each attending to keys [0, its position]."""
    group = NUM_HEADS // NUM_KV_HEADS
    q = seq.q[start:end].double().transpose(0, 1)  # [H, n, D]
    k = seq.k[:end].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, end, D]
    v = seq.v[:end].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * SCALE  # [H, n, end]
    query_pos = torch.arange(start, end)[:, None]
    scores = scores.masked_fill(torch.arange(end)[None, :] > query_pos, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).float()  # [n, H, D]


class Bench:
    def __init__(self, block_size: int, num_blocks: int = 96, seed: int = 0):
        self.planner = PagedBatchPlanner(num_blocks, block_size, seed=seed)
        self.generator = torch.Generator().manual_seed(seed)
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache, self.v_cache = torch.zeros(shape), torch.zeros(shape)
        self.backend = TorchAttentionBackend()

    def sequence(self, length: int) -> RandomSequence:
        return RandomSequence(length, self.generator)

    def run_step(self, prefills: list[tuple[RandomSequence, int]],
                 decodes: list[RandomSequence]) -> float:
        """One backend call; returns the largest difference from dense attention."""
        spans = [(seq, seq.num_computed, seq.num_computed + n) for seq, n in prefills]
        spans += [(seq, seq.num_computed, seq.num_computed + 1) for seq in decodes]
        step = self.planner.plan_step(prefills, decodes)
        q = torch.cat([seq.q[a:b] for seq, a, b in spans])
        k = torch.cat([seq.k[a:b] for seq, a, b in spans])
        v = torch.cat([seq.v[a:b] for seq, a, b in spans])
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, step.meta, SCALE)
        assert out.shape == q.shape
        expected = torch.cat([dense_attention(seq, a, b) for seq, a, b in spans])
        return (out - expected).abs().max().item()


# Similar lengths run as one padded batch, a long prompt among short ones as a call per sequence.
PROMPT_LAYOUTS = {"padded": [12, 7, 16, 9], "per-sequence": [1, 7, 33, 20]}


@pytest.mark.parametrize("layout", PROMPT_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prompts_of_different_lengths_match_dense_attention(block_size, layout):
    lengths = PROMPT_LAYOUTS[layout]
    assert padding_pays(lengths, lengths) == (layout == "padded")
    bench = Bench(block_size)
    seqs = [bench.sequence(n) for n in lengths]
    diff = bench.run_step([(s, len(s.token_ids)) for s in seqs], [])
    print(f"prompts ({layout}), block {block_size}: max abs diff {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prompts_of_one_length_match_dense_attention(block_size):
    # The flat tensors are viewed as a batch, with no padded copy.
    bench = Bench(block_size)
    seqs = [bench.sequence(11) for _ in range(5)]
    diff = bench.run_step([(s, 11) for s in seqs], [])
    assert diff < 1e-5


def test_chunks_over_a_cache_and_whole_prompts_never_share_a_call():
    # A prompt's second chunk (cached prefix of 20) first, then three whole prompts.
    query_lens, seq_lens = [8, 12, 10, 12], [28, 12, 10, 12]
    assert prefill_calls(query_lens, seq_lens, cached=True) == [(0, 1, False), (1, 4, True)]
    # No cache (the profile run): everything is a whole prompt.
    assert prefill_calls(query_lens, query_lens, cached=False) == [(0, 4, True)]
    # A long prompt among short ones: a call per sequence within the run.
    assert prefill_calls([1, 7, 33, 20], [1, 7, 33, 20], cached=True) == [
        (0, 1, True), (1, 2, True), (2, 3, True), (3, 4, True)]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_prompt_chunks_over_a_cached_prefix_match_dense_attention(block_size):
    bench = Bench(block_size)
    seq = bench.sequence(45)
    diffs = [bench.run_step([(seq, n)], []) for n in (13, 19, 13)]
    print(f"chunks, block {block_size}: max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-5


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_batch_matches_dense_attention(block_size):
    bench = Bench(block_size)
    seqs = [bench.sequence(n) for n in (9, 40, 17, 64)]
    bench.run_step([(s, len(s.token_ids) - 6) for s in seqs], [])
    diffs = [bench.run_step([], seqs) for _ in range(6)]
    print(f"decodes, block {block_size}: max abs diff {max(diffs):.2e}")
    assert max(diffs) < 1e-5


# (first chunk, second chunk) of a 50-token prompt, and a whole prompt beside the second chunk.
MIXED_LAYOUTS = {"padded": (21, 29, 9), "per-sequence": (45, 5, 40)}


@pytest.mark.parametrize("layout", MIXED_LAYOUTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_mixed_step_of_prompts_chunks_and_decodes_matches_dense_attention(block_size, layout):
    first_chunk, second_chunk, fresh_len = MIXED_LAYOUTS[layout]
    assert padding_pays([second_chunk, fresh_len], [50, fresh_len]) == (layout == "padded")
    bench = Bench(block_size)
    decoding = [bench.sequence(n) for n in (12, 30)]
    chunked = bench.sequence(first_chunk + second_chunk)
    bench.run_step([(s, len(s.token_ids) - 1) for s in decoding] + [(chunked, first_chunk)], [])
    fresh = bench.sequence(fresh_len)
    diff = bench.run_step([(chunked, second_chunk), (fresh, fresh_len)], decoding)
    print(f"mixed ({layout}), block {block_size}: max abs diff {diff:.2e}")
    assert diff < 1e-5


@pytest.mark.parametrize("layout", PROMPT_LAYOUTS)
def test_profile_run_without_a_cache_is_causal_attention_per_prompt(layout):
    lengths = PROMPT_LAYOUTS[layout]
    generator = torch.Generator().manual_seed(1)
    seqs = [RandomSequence(n, generator) for n in lengths]
    q = torch.cat([s.q for s in seqs])
    k = torch.cat([s.k for s in seqs])
    v = torch.cat([s.v for s in seqs])
    out = TorchAttentionBackend().forward(q, k, v, None, None, profile_metadata(lengths), SCALE)
    expected = torch.cat([dense_attention(s, 0, len(s.token_ids)) for s in seqs])
    assert (out - expected).abs().max().item() < 1e-5


def test_step_key_values_are_written_to_their_cache_slots():
    bench = Bench(block_size=8)
    seqs = [bench.sequence(n) for n in (11, 4)]
    bench.run_step([(s, len(s.token_ids)) for s in seqs], [])
    for seq in seqs:
        for pos in range(len(seq.token_ids)):
            block, offset = seq.block_ids[pos // 8], pos % 8
            assert torch.equal(bench.k_cache[block, offset], seq.k[pos])
            assert torch.equal(bench.v_cache[block, offset], seq.v[pos])
