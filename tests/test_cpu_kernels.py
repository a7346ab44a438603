"""The compiled CPU kernels (pagoda_kernels/cpu) against the torch code each one stands in for:
paged decode attention and the KV cache write against pagoda_kernels/reference.py, the layer ops
against the torch path of services/worker/models/llama.py (for bfloat16 also against the
Hugging Face rounding they copy), the packed bf16 matmuls (panels on AMX or AVX512-BF16, and
oneDNN) against F.linear, the
layer blocks against their kernels one by one; the build and its fallbacks in fresh processes;
and a tiny bf16 Llama with the kernels on against transformers, against itself with them off,
and with its layers as blocks against module by module."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pagoda_kernels import cpu as cpu_kernels
from pagoda_kernels import reference
from services.worker.attention.base import get_attn_backend
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.model_loader import load_model
from services.worker.models import linear as linear_module
from services.worker.models.linear import (Linear, SiluAndMulLinear, _onednn, linear,
                                           pack_weight)
from services.worker.models.llama import RotaryEmbedding
from tests.helpers import (PagedBatchPlanner, PagedSequence, load_config, model_config_for,
                           new_kv_caches, save_random_model, tiny_llama_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 values lie between a and b (0: equal, 1: neighbours), elementwise."""
    def ordered(x):
        bits = x.contiguous().view(torch.int16).int()
        return torch.where(bits < 0, -(bits & 0x7FFF), bits)
    return (ordered(a) - ordered(b)).abs()


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The gap between x and the next bfloat16 away from zero, in float64, elementwise."""
    exponent = torch.frexp(x.double().abs().clamp_min(2.0 ** -126)).exponent
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float64), exponent - 8)


def summation_slack(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    gate_up: bool = False) -> torch.Tensor:
    """How far two float32 accumulations of x @ weight.T (+ bias) in different orders can be
    apart, elementwise (each within (k + 1) * 2^-24 * (sum |x||w| + |b|) of the exact sum); with
    gate_up, carried through SiLU(gate) * up (SiLU's slope stays within 1.1)."""
    k = x.shape[-1]
    terms = x.double().abs() @ weight.double().abs().T
    bias = torch.zeros(weight.shape[0], dtype=torch.float64) if bias is None else bias.double()
    slack = 2 * (k + 1) * 2.0 ** -24 * (terms + bias.abs())
    if not gate_up:
        return slack
    product = F.linear(x.double(), weight.double(), bias)
    gate, up = product.chunk(2, dim=-1)
    gate_slack, up_slack = slack.chunk(2, dim=-1)
    return 1.1 * gate_slack * (up.abs() + up_slack) + F.silu(gate).abs() * up_slack


def test_the_kernels_build_on_this_machine():
    assert cpu_kernels.unavailable_reason() is None
    assert cpu_kernels.available_for(torch.zeros(2, 2))
    assert cpu_kernels.available_for(torch.zeros(2, 2, dtype=torch.bfloat16))
    assert not cpu_kernels.available_for(torch.zeros(2, 2, dtype=torch.float16))
    assert not cpu_kernels.available_for(torch.zeros(2, 2, device="meta"))


# --- paged decode attention ------------------------------------------------------------------

class PagedCase:
    """A decode batch over a paged cache: each sequence's blocks at random, non-sequential ids;
    block tables padded with block 0 to two columns past the longest sequence's; every cache slot
    random (so stale data sits in the padding and past each sequence's end)."""

    def __init__(self, lens, num_kv_heads, group, head_dim, block_size, dtype,
                 strided_query=True, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.lens, self.block_size = list(lens), block_size
        self.num_heads = num_kv_heads * group
        blocks_per_seq = [-(-n // block_size) for n in lens]
        num_blocks = sum(blocks_per_seq) + 5
        ids = torch.randperm(num_blocks, generator=g).tolist()
        width = max(blocks_per_seq) + 2
        self.tables = []
        for n in blocks_per_seq:
            self.tables.append(ids[:n])
            ids = ids[n:]
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables])
        self.seq_lens = torch.tensor(self.lens)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_cache = torch.randn(shape, generator=g).to(dtype)
        self.value_cache = torch.randn(shape, generator=g).to(dtype)
        num_seqs = len(lens)
        if strided_query:  # q sliced out of a fused [q | k] tensor, as the model passes it
            qk = torch.randn(num_seqs, self.num_heads + num_kv_heads, head_dim, generator=g)
            self.query = qk.to(dtype)[:, :self.num_heads]
            assert not self.query.is_contiguous()
        else:
            self.query = torch.randn(num_seqs, self.num_heads, head_dim, generator=g).to(dtype)
        self.scale = head_dim ** -0.5

    def args(self, dtype=None):
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
        return (cast(self.query), cast(self.key_cache), cast(self.value_cache), self.block_tables,
                self.seq_lens, max(self.lens), self.scale)

    def used_slots(self) -> torch.Tensor:
        """[num_blocks, block_size] bool: the slots that hold one of the sequences' tokens."""
        used = torch.zeros(self.key_cache.shape[:2], dtype=torch.bool)
        for table, n in zip(self.tables, self.lens):
            for i, block in enumerate(table):
                used[block, :min(self.block_size, n - i * self.block_size)] = True
        return used


# (num_kv_heads, group, head_dim, block_size, seq_lens): groups 1/3/4/8/16, head_dim 64, 128 and
# generic ones, block sizes 8..128; lengths 1, exactly a block, a block + 1, long, mixed batches.
ATTENTION_CASES = [
    (2, 1, 64, 16, [1, 16, 17]),
    (2, 3, 128, 16, [16, 1, 600]),
    (1, 4, 128, 8, [9, 8, 1]),
    (2, 8, 96, 32, [33, 600, 32]),
    (1, 16, 80, 128, [128, 129, 5]),
    (4, 4, 64, 128, [600, 1]),
    (2, 4, 128, 16, [1, 16, 17, 600, 250, 3, 64, 65]),
    (1, 8, 256, 32, [70, 31]),
    (3, 3, 48, 8, [1, 8, 9, 64, 2]),
    # Batches of 16 sequences, enough that a work item takes several KV heads (as at serving
    # time): groups 2, 5 and 8, up to 16 query heads per item.
    (1, 2, 64, 32, [1, 31, 32, 33, 200, 7, 64, 65, 16, 17, 3, 90, 128, 129, 5, 40]),
    (4, 5, 64, 16, [16, 1, 17, 300, 15, 2, 48, 49, 33, 8, 100, 64, 1, 19, 77, 31]),
    (8, 8, 128, 16, [5, 17, 16, 1, 250, 33, 64, 2, 31, 48, 9, 120, 15, 80, 3, 65]),
]
CASE_IDS = [f"kv{kv}-g{g}-d{d}-b{b}" for kv, g, d, b, _ in ATTENTION_CASES]


# Decode attention's two paths: the vector one (AVX-512, or AVX2 without it; head_dim 64/128, up
# to 8 heads per KV head) where this machine has it, and the portable loop, which runs every
# other case.
ATTENTION_PATHS = ["portable", pytest.param("simd", marks=pytest.mark.skipif(
    not cpu_kernels.attention_simd_available(),
    reason="decode attention's vector loop needs AVX-512 or AVX2 with FMA"))]


@pytest.fixture(params=ATTENTION_PATHS)
def attention_path(request):
    cpu_kernels.set_attention_simd(request.param == "simd")
    yield request.param
    cpu_kernels.set_attention_simd(True)


@pytest.mark.parametrize("strided_query", [True, False], ids=["strided_q", "contiguous_q"])
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=CASE_IDS)
def test_paged_decode_attention_fp32_equals_the_reference(case, strided_query, attention_path):
    num_kv_heads, group, head_dim, block_size, lens = case
    c = PagedCase(lens, num_kv_heads, group, head_dim, block_size, torch.float32, strided_query)
    out = cpu_kernels.paged_decode_attention(*c.args())
    expected = reference.paged_decode_attention(*c.args())
    assert out.shape == expected.shape == (len(lens), c.num_heads, head_dim)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=CASE_IDS)
def test_paged_decode_attention_bf16_equals_the_reference_to_bf16_rounding(case, attention_path):
    num_kv_heads, group, head_dim, block_size, lens = case
    c = PagedCase(lens, num_kv_heads, group, head_dim, block_size, torch.bfloat16)
    out = cpu_kernels.paged_decode_attention(*c.args())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference.paged_decode_attention(*c.args()),
                               atol=1e-2, rtol=1.6e-2)
    # Against fp32 attention over the same (bf16-valued) inputs the only error is the final
    # rounding to bf16: at most half a unit in the last place (2^-8 relative) plus float noise.
    exact = reference.paged_decode_attention(*c.args(torch.float32))
    error = (out.float() - exact).abs()
    assert (error <= exact.abs() * 2 ** -8 + 1e-5).all(), error.max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1, 17, 40, 16], [1, 17, 40, 16, 5, 33, 2, 64] * 2],
                         ids=["4_seqs", "16_seqs"])
def test_paged_decode_attention_reads_only_each_sequences_own_tokens(dtype, lens, attention_path):
    """NaN in every slot no sequence owns (the tail of each last block, the unused blocks, block
    0 that pads the tables) leaves the output finite and unchanged."""
    c = PagedCase(lens, 2, 4, 64, 16, dtype)
    expected = cpu_kernels.paged_decode_attention(*c.args())
    free = ~c.used_slots()
    assert free.any()
    c.key_cache[free] = float("nan")
    c.value_cache[free] = float("nan")
    out = cpu_kernels.paged_decode_attention(*c.args())
    assert torch.isfinite(out).all()
    assert torch.equal(out, expected)


def test_paged_decode_attention_addresses_a_cache_past_2_to_the_31_elements(attention_path):
    """Block ids whose element offset does not fit in 32 bits. The cache is left uninitialised
    (untouched pages cost no memory); only the blocks the sequences use are written."""
    block_size, head_dim = 16, 64
    num_blocks = (1 << 31) // (block_size * head_dim) + 8  # 4 GiB of bf16, one KV head
    key_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.bfloat16)
    value_cache = torch.empty_like(key_cache)
    assert key_cache.numel() > 2 ** 31
    g = torch.Generator().manual_seed(0)
    tables = [[num_blocks - 1, 3, num_blocks - 5], [num_blocks - 2]]
    for block in {b for t in tables for b in t}:
        key_cache[block] = torch.randn(block_size, 1, head_dim, generator=g)
        value_cache[block] = torch.randn(block_size, 1, head_dim, generator=g)
    key_cache[0] = value_cache[0] = 0  # the padding block: the reference reads it (masked)
    block_tables = torch.tensor([tables[0], tables[1] + [0, 0]])
    seq_lens = torch.tensor([40, 11])
    query = torch.randn(2, 4, head_dim, generator=g).to(torch.bfloat16)
    args = (query, key_cache, value_cache, block_tables, seq_lens, 40, head_dim ** -0.5)
    out = cpu_kernels.paged_decode_attention(*args)
    torch.testing.assert_close(out, reference.paged_decode_attention(*args), atol=1e-2,
                               rtol=1.6e-2)


UNSUPPORTED = [  # (num_heads, num_kv_heads, head_dim, block_size): past the kernel's limits
    (17, 1, 64, 16),  # 17 query heads per KV head
    (34, 2, 64, 16),
    (4, 1, 264, 16),  # head_dim > 256
    (4, 1, 64, 256),  # block_size > 128
]


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", UNSUPPORTED)
def test_shapes_past_the_kernels_limits_are_refused(num_heads, num_kv_heads, head_dim,
                                                    block_size):
    cpu = torch.device("cpu")
    assert not cpu_kernels.supports(torch.float32, cpu, num_heads, num_kv_heads, head_dim,
                                    block_size)
    query = torch.randn(2, num_heads, head_dim)
    cache = torch.randn(3, block_size, num_kv_heads, head_dim)
    with pytest.raises(ValueError, match="cannot run"):
        cpu_kernels.paged_decode_attention(query, cache, cache, torch.tensor([[1], [2]]),
                                           torch.tensor([1, 2]), 2, 0.125)


def test_supports_only_cpu_float32_and_bfloat16_with_whole_groups():
    cpu = torch.device("cpu")
    assert cpu_kernels.supports(torch.float32, cpu, 32, 8, 128, 16)
    assert cpu_kernels.supports(torch.bfloat16, cpu, 16, 1, 256, 128)
    assert not cpu_kernels.supports(torch.float16, cpu, 32, 8, 128, 16)
    assert not cpu_kernels.supports(torch.float32, torch.device("cuda"), 32, 8, 128, 16)
    assert not cpu_kernels.supports(torch.float32, cpu, 6, 4, 64, 16)  # 6 heads over 4 KV heads


def test_get_attn_backend_picks_the_cpu_kernels_where_they_run():
    assert get_attn_backend("auto", dtype=torch.bfloat16, num_heads=8, num_kv_heads=2).name == "cpu"
    assert get_attn_backend("cpu", dtype=torch.float32).name == "cpu"
    assert get_attn_backend("torch", dtype=torch.float32).name == "torch"
    assert get_attn_backend("auto", dtype=torch.float16).name == "torch"
    assert get_attn_backend("auto", num_heads=17, num_kv_heads=1).name == "torch"
    with pytest.raises(ValueError, match="head_dim 512"):
        get_attn_backend("cpu", head_dim=512)


# --- rms_norm ----------------------------------------------------------------------------------

def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: float compute, round to the dtype, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def norm_inputs(rows, hidden, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    weight = (1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype)
    residual = (torch.randn(rows, hidden, generator=g) * 10).to(dtype)
    return x, weight, residual


@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 4096)])
def test_rms_norm_fp32_matches_torch(rows, hidden):
    x, weight, _ = norm_inputs(rows, hidden, torch.float32)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), weight, 1e-5), atol=1e-6, rtol=1e-6)


# 72: a row the 16-lane path does not take (the portable loop runs it).
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (33, 4096), (5, 72)])
def test_rms_norm_bf16_rounds_as_hugging_face(rows, hidden):
    x, weight, _ = norm_inputs(rows, hidden, torch.bfloat16)
    out = cpu_kernels.rms_norm(x, weight, 1e-6)
    ulps = bf16_ulps(out, hf_rms_norm(x, weight, 1e-6))
    assert ulps.max() <= 1 and (ulps == 0).float().mean() > 0.99


@pytest.mark.parametrize("hidden", [128, 72])  # 72: the portable loop, not the 16-lane one
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_adds_it_in_place_and_normalises_the_sum(dtype, hidden):
    x, weight, residual = norm_inputs(9, hidden, dtype)
    before = residual.clone()
    out = cpu_kernels.rms_norm(x, weight, 1e-5, residual)
    total = x + before  # in the dtype, as the model adds them
    assert torch.equal(residual, total)
    if dtype == torch.float32:
        torch.testing.assert_close(out, F.rms_norm(total, (hidden,), weight, 1e-5), atol=1e-6,
                                   rtol=1e-6)
    else:
        assert bf16_ulps(out, hf_rms_norm(total, weight, 1e-5)).max() <= 1
    assert not torch.equal(x, total)  # x itself is left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_non_contiguous_rows(dtype):
    x, weight, residual = norm_inputs(6, 64, dtype)
    wide = torch.cat((x, torch.full_like(x, float("nan"))), dim=1)  # rows 128 elements apart
    rows_view = wide[:, :64]
    assert rows_view.stride() == (128, 1)
    torch.testing.assert_close(cpu_kernels.rms_norm(rows_view, weight, 1e-5),
                               cpu_kernels.rms_norm(x, weight, 1e-5), atol=0, rtol=0)
    columns_view = x.t().contiguous().t()  # elements not contiguous within a row
    torch.testing.assert_close(cpu_kernels.rms_norm(columns_view, weight, 1e-5),
                               cpu_kernels.rms_norm(x, weight, 1e-5), atol=0, rtol=0)
    res = residual.clone()
    out = cpu_kernels.rms_norm(rows_view, weight, 1e-5, res)
    assert torch.equal(res, x + residual)
    torch.testing.assert_close(out, cpu_kernels.rms_norm(x + residual, weight, 1e-5), atol=0,
                               rtol=0)


# --- rotary --------------------------------------------------------------------------------------

def torch_rotary(x, positions, cos_sin, half):
    """The torch path of RotaryEmbedding.forward."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).unbind(2)
    return torch.addcmul(x * cos, x.roll(half, dims=-1), sin)


def hf_rotary(x, positions, cos_sin, half):
    """transformers' q * cos + rotate_half(q) * sin: three ops, each rounded to the dtype."""
    cos, sin = cos_sin.index_select(0, positions).unsqueeze(1).unbind(2)
    return x * cos + x.roll(half, dims=-1) * sin


def fused_qkv(tokens, heads, kv_heads, head_dim, dtype, seed=0):
    """qkv [T, (H + 2 KVH) D] as the fused projection returns it and its q|k view
    [T, H + KVH, D]."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    return qkv, qk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_rotary_rotates_the_qk_view_in_place_and_leaves_v_alone(dtype, head_dim):
    rope = RotaryEmbedding(tiny_llama_config(), head_dim, 512, dtype)
    heads, kv_heads, tokens = 6, 2, 23
    qkv, qk = fused_qkv(tokens, heads, kv_heads, head_dim, dtype)
    before = qkv.clone()
    qk_before = qk.clone()
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(1))
    positions[:2] = torch.tensor([0, 511])
    out = cpu_kernels.rotary_(qk, positions, rope.cos_sin)
    assert out is qk
    split = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, split:], before[:, split:])
    assert not torch.equal(qkv[:, :split], before[:, :split])
    expected = torch_rotary(qk_before, positions, rope.cos_sin, head_dim // 2)
    if dtype == torch.float32:
        torch.testing.assert_close(qk, expected, atol=1e-6, rtol=1e-6)
    else:
        assert torch.equal(qk, hf_rotary(qk_before, positions, rope.cos_sin, head_dim // 2))
        torch.testing.assert_close(qk, expected, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_module_with_the_kernels_on_and_off(dtype, monkeypatch):
    rope = RotaryEmbedding(tiny_llama_config(rope_theta=500000.0), 64, 256, dtype)
    qkv, qk = fused_qkv(9, 4, 2, 64, dtype, seed=2)
    positions = torch.arange(100, 109)
    with monkeypatch.context() as patch:
        patch.setattr(cpu_kernels, "available_for", lambda x: False)
        off = rope(positions, qk)
    assert off is not qk
    on = rope(positions, qk)
    assert on is qk
    if dtype == torch.float32:
        torch.testing.assert_close(on, off, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(on, off, atol=1e-2, rtol=1.6e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_refuses_positions_outside_its_table(dtype):
    rope = RotaryEmbedding(tiny_llama_config(), 64, 32, dtype)
    _, qk = fused_qkv(2, 2, 1, 64, dtype)
    before = qk.clone()
    for positions in ([0, 32], [-1, 3]):
        with pytest.raises(IndexError):
            cpu_kernels.rotary_(qk, torch.tensor(positions), rope.cos_sin)
    assert torch.equal(qk, before)  # refused before anything was written


# --- packed linear -----------------------------------------------------------------------------

needs_bf16_panels = pytest.mark.skipif(not cpu_kernels.bf16_matmul_available(),
                                       reason="this CPU has neither AVX512-BF16 nor AVX2 and FMA")


@pytest.fixture(params=["dot", "amx", "amx-stream", "avx2"])
def bf16_matmul_path(request):
    """Each loop of the bf16 panel matmul in turn: vdpbf16ps, then AMX tiles, K-blocked from 512
    rows and streaming at every size, or AVX2 FMA on bf16 widened to fp32 (each skipped where
    the CPU does not run it)."""
    if request.param not in cpu_kernels.bf16_matmul_paths():
        pytest.skip(f"the bf16 panel matmul's {request.param} loop does not run on this CPU")
    cpu_kernels.set_bf16_matmul_path(request.param)
    yield request.param
    cpu_kernels.set_bf16_matmul_path("amx")


@pytest.fixture
def onednn_only():
    """bf16 weights packed for oneDNN even where the panel matmul runs."""
    cpu_kernels.set_bf16_matmul(False)
    yield
    cpu_kernels.set_bf16_matmul(True)


needs_onednn_bf16 = pytest.mark.skipif(
    not _onednn(torch.bfloat16),
    reason="oneDNN packs bf16 weights only where it has bf16 instructions (AVX-512 or newer)")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_bf16_linear_equals_f_linear(bias, onednn_only):
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(384, 256, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(384, generator=g).to(torch.bfloat16) if bias else None
    packed = pack_weight(weight)
    assert packed.kind == "onednn" and not packed.gate_up
    for rows in (1, 7, 64, 300):
        x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
        out = linear(x, weight, b, packed)
        expected = F.linear(x, weight, b)
        assert out.shape == expected.shape and out.dtype == torch.bfloat16
        # Float accumulation either way (here the very same result); a different summation
        # order could move a rounding by one bf16 step.
        assert bf16_ulps(out, expected).max() <= 1


def silu_and_mul(product: torch.Tensor) -> torch.Tensor:
    gate, up = product.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("gate_up", [False, True])
def test_bf16_panel_linear_equals_f_linear(bias, gate_up, bf16_matmul_path):
    """Rows around each loop's blocks (8 or 32 rows a pass, 256 a chunk), x rows at a stride,
    bias, and the fused SiLU(gate) * up, against F.linear (and torch's SiLU and product) in
    bf16."""
    g = torch.Generator().manual_seed(5)
    n, k = 192, 96
    weight = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    packed = pack_weight(weight, gate_up=gate_up)
    assert packed.kind == "bf16" and packed.gate_up == gate_up
    assert packed.data.numel() == weight.numel()  # the same size as the weight: one copy
    for rows in (1, 7, 8, 9, 31, 32, 33, 64, 255, 257, 600):
        wide = torch.randn(rows, k + 32, generator=g).to(torch.bfloat16)
        for x in (wide[:, :k].contiguous(), wide[:, 16:16 + k]):  # the second at a row stride
            out = linear(x, weight, b, packed)
            expected = F.linear(x, weight, b)
            if gate_up:
                expected = silu_and_mul(expected)
            assert out.shape == expected.shape and out.dtype == torch.bfloat16
            # One summation order or another: a rounding may move by one bf16 step, and in the
            # fused SiLU that step passes through two more roundings. Where the sum cancels to
            # near zero, the orders may differ by more steps of that small result, but never by
            # more than two fp32 sums of these terms can (summation_slack).
            steps = 2 if gate_up else 1
            step = torch.maximum(bf16_step(out), bf16_step(expected))
            slack = summation_slack(x, weight, b, gate_up) + steps * step
            gap = (out.double() - expected.double()).abs()
            far = (bf16_ulps(out, expected) > steps) & (gap > slack)
            assert not far.any(), (rows, out[far], expected[far])
            assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("gate_up", [False, True])
def test_amx_prompt_loop_gives_the_streaming_loops_results_bit_for_bit(gate_up):
    """From 512 rows the AMX loop cuts K into blocks and keeps accumulators between them; each
    output is summed in the same order as the streaming loop's, so the two agree exactly: over
    several K blocks (K = 640: 20 steps, three blocks), a thread's panels in groups of four
    and a group left over (672 columns: 21 panels), a tail of rows, x at a row stride, bias;
    and a K long enough (4,096) that a thread's panels go in several spans of four."""
    if "amx" not in cpu_kernels.bf16_matmul_paths():
        pytest.skip("this CPU or OS runs no AMX")
    g = torch.Generator().manual_seed(11)
    n, k = 672, 640
    weight = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    packed = pack_weight(weight, gate_up=gate_up)
    assert packed.kind == "bf16"
    long_k = 4096
    long_weight = (torch.randn(n, long_k, generator=g) * 0.02).to(torch.bfloat16)
    long_packed = pack_weight(long_weight, gate_up=gate_up)
    try:
        for rows, w, p in ((512, weight, packed), (600, weight, packed), (1100, weight, packed),
                           (545, long_weight, long_packed)):
            wide = torch.randn(rows, w.shape[1] + 32, generator=g).to(torch.bfloat16)
            for x in (wide[:, :w.shape[1]].contiguous(), wide[:, 16:16 + w.shape[1]]):
                cpu_kernels.set_bf16_matmul_path("amx-stream")
                streamed = linear(x, w, b, p)
                cpu_kernels.set_bf16_matmul_path("amx")
                blocked = linear(x, w, b, p)
                assert torch.equal(blocked, streamed), (rows, w.shape)
        x = torch.randn(600, k, generator=g).to(torch.bfloat16)
        blocked = linear(x, weight, b, packed)
        assert bf16_ulps(blocked, F.linear(x, weight, b) if not gate_up
                         else silu_and_mul(F.linear(x, weight, b))).float().mean() < 0.05
    finally:
        cpu_kernels.set_bf16_matmul_path("amx")


@needs_bf16_panels
def test_bf16_panel_linear_of_batched_input_keeps_the_leading_dims():
    g = torch.Generator().manual_seed(6)
    weight = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    packed = pack_weight(weight)
    x = torch.randn(3, 5, 32, generator=g).to(torch.bfloat16)
    out = linear(x, weight, None, packed)
    assert out.shape == (3, 5, 64)
    assert bf16_ulps(out, F.linear(x, weight)).max() <= 1


def test_bf16_panel_silu_and_mul_matches_torch_at_the_extremes(bf16_matmul_path):
    """Gates far into SiLU's tails (exp overflowing and underflowing) and at zero: identity
    weights make the gate and up halves equal x, so the result is SiLU(x) * x exactly as torch
    rounds it."""
    eye = torch.eye(32)
    weight = torch.cat((eye, eye)).to(torch.bfloat16)  # [gate; up], both the identity
    values = torch.tensor([-3e38, -200.0, -104.0, -90.0, -88.0, -20.0, -1.0, -0.5, 0.0, 0.5, 1.0,
                           20.0, 88.0, 90.0, 200.0, 1e30])
    x = torch.cat((values, -values)).to(torch.bfloat16).unsqueeze(0)
    packed = pack_weight(weight, gate_up=True)
    out = linear(x, weight, None, packed)
    expected = F.silu(x) * x
    assert torch.equal(out.isinf(), expected.isinf())
    finite = expected.isfinite()
    assert bf16_ulps(out[finite], expected[finite]).max() <= 1


@needs_bf16_panels
def test_silu_and_mul_linear_module_with_bf16_panels_and_with_onednn():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16)
    weight = (torch.randn(256, 64, generator=g) * 0.1).to(torch.bfloat16)
    expected = silu_and_mul(F.linear(x, weight))
    for panels in (True, False):
        cpu_kernels.set_bf16_matmul(panels)
        try:
            layer = SiluAndMulLinear(64, 256, bias=False, dtype=torch.bfloat16)
            layer.weight.data.copy_(weight)
            layer.pack()
        finally:
            cpu_kernels.set_bf16_matmul(True)
        if panels or _onednn(torch.bfloat16):
            assert layer.packed.kind == ("bf16" if panels else "onednn")
            # oneDNN has no fused epilogue: SiLU runs after it
            assert layer.packed.gate_up == panels
            assert layer.weight.device.type == "meta"  # the plain copy is dropped either way
        else:  # no bf16 in oneDNN here: the plain weight stays, for F.linear
            assert layer.packed is None and layer.weight.device.type == "cpu"
        out = layer(x)
        assert out.shape == (9, 128)
        assert bf16_ulps(out, expected).max() <= 2


def test_shapes_the_bf16_panel_matmul_does_not_take_go_to_onednn():
    """N or K not a multiple of 32 (and anything on a CPU without AVX512-BF16) is packed for
    oneDNN where oneDNN has bf16 instructions, and left to F.linear where it has not."""
    g = torch.Generator().manual_seed(8)
    for n, k in ((48, 64), (64, 40)):
        weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
        assert cpu_kernels.pack_bf16_weight(weight) is None
        packed = pack_weight(weight)
        assert (packed.kind == "onednn") if _onednn(torch.bfloat16) else packed is None
        x = torch.randn(5, k, generator=g).to(torch.bfloat16)
        assert bf16_ulps(linear(x, weight, None, packed), F.linear(x, weight)).max() <= 1
    assert cpu_kernels.pack_bf16_weight(torch.randn(64, 64)) is None  # fp32: not this kernel


@needs_bf16_panels
def test_bf16_panel_linear_refuses_an_input_that_does_not_fit_the_weight():
    packed = pack_weight(torch.randn(64, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.randn(4, 64).to(torch.bfloat16), torch.empty(0), None, packed)
    with pytest.raises(ValueError, match="does not fit"):
        linear(torch.randn(4, 32), torch.empty(0), None, packed)  # fp32 into a bf16 kernel


@pytest.fixture
def fp32_layout_set():
    """Sets the fp32 layout for one test and puts back whatever this process had."""
    before = linear_module._fp32_layout
    yield linear_module.set_fp32_layout
    linear_module.set_fp32_layout(before)


def test_fp32_layer_weights_are_stored_transposed_where_that_layout_is_chosen(fp32_layout_set):
    fp32_layout_set("transposed")
    g = torch.Generator().manual_seed(1)
    layer = Linear(16, 32, bias=True, dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(32, 16, generator=g))
    layer.bias.data.copy_(torch.randn(32, generator=g))
    before = layer.weight.detach().clone()
    x = torch.randn(3, 16, generator=g)
    expected = F.linear(x, before, layer.bias)
    layer.pack()
    assert layer.packed is None
    assert torch.equal(layer.weight, before) and layer.weight.shape == (32, 16)
    assert layer.weight.t().is_contiguous()  # stored [in, out] for MKL
    assert torch.allclose(layer(x), expected, atol=1e-6)


@pytest.mark.parametrize("layout", ["onednn", "panels"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_fp32_layer_weights_packed_as_the_chosen_layout(gate_up, layout, fp32_layout_set):
    """oneDNN's packing (SiLU * up after it) or the fp32 panels (SiLU * up fused)."""
    if layout == "panels" and not cpu_kernels.f32_matmul_available():
        pytest.skip("the fp32 panel matmul needs a CPU with AVX-512 or AVX2 and FMA")
    fp32_layout_set(layout)
    g = torch.Generator().manual_seed(3)
    cls = SiluAndMulLinear if gate_up else Linear
    layer = cls(64, 96, bias=True, dtype=torch.float32)
    layer.weight.data.copy_(torch.randn(96, 64, generator=g))
    layer.bias.data.copy_(torch.randn(96, generator=g))
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    assert layer.packed.kind == ("f32" if layout == "panels" else "onednn")
    assert layer.packed.gate_up == (gate_up and layout == "panels")
    assert layer.weight.device.type == "meta"  # the plain copy is dropped
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 64, generator=g)
        expected = F.linear(x, weight, bias)
        if gate_up:
            expected = silu_and_mul(expected)
        assert torch.allclose(layer(x), expected, rtol=1e-5, atol=1e-5), rows


def test_fp32_layout_is_measured_once_and_kept(fp32_layout_set):
    fp32_layout_set(None)
    chosen = linear_module.fp32_layout()
    assert chosen in linear_module.FP32_LAYOUTS
    if not cpu_kernels.f32_matmul_available():
        assert chosen != "panels"
    assert linear_module._fp32_layout == chosen  # kept: the next weight does not time again
    with pytest.raises(ValueError, match="fp32 layout"):
        linear_module.set_fp32_layout("mkl")


def test_fp32_layout_candidates_take_turns_and_keep_their_fastest_time(monkeypatch):
    """A drift of the machine's speed during the timing falls on every candidate alike: each
    round runs every candidate once, and each keeps its fastest round."""
    clock = iter(range(1000))
    monkeypatch.setattr(linear_module.time, "perf_counter", lambda: float(next(clock)))
    order = []
    # Each call advances the fake clock by its cost in that call (one more tick is the stop
    # reading): the first call untimed, then three rounds, the fastest in a different one each.
    costs = {"a": iter([9, 3, 1, 4]), "b": iter([9, 0, 2, 5]), "c": iter([9, 2, 6, 1])}
    runs = {name: (lambda name=name: order.append(name) or
                   [next(clock) for _ in range(next(costs[name]))])
            for name in costs}
    times = linear_module.fastest_times(runs, rounds=3)
    assert order == ["a", "b", "c"] + ["a", "b", "c"] * 3  # a first call each, then turns
    assert times == {"a": 2.0, "b": 1.0, "c": 2.0}


def test_faster_fp32_layout_prefers_panels_then_transposed_on_a_tie():
    faster = linear_module.faster_fp32_layout
    # oneDNN only where it is clearly faster; a tie keeps the huge-page [in, out] copy.
    assert faster({"transposed": 1.0, "onednn": 0.5}) == "onednn"
    assert faster({"transposed": 1.0, "onednn": 0.95}) == "transposed"
    assert faster({"transposed": 1.0, "onednn": 2.0}) == "transposed"
    # Panels (the layer blocks take them) unless another is 25% faster: a bare matmul 13%
    # faster on oneDNN still ran the engine slower than the panels.
    assert faster({"panels": 1.0, "transposed": 0.95, "onednn": 0.92}) == "panels"
    assert faster({"panels": 1.0, "transposed": 1.2, "onednn": 0.87}) == "panels"
    assert faster({"panels": 1.0, "transposed": 1.2, "onednn": 0.7}) == "onednn"
    assert faster({"panels": 1.0, "transposed": 0.74, "onednn": 0.7}) == "transposed"
    assert faster({"panels": 1.0, "transposed": 0.7, "onednn": 0.64}) == "transposed"
    assert faster({"panels": 1.0, "transposed": 0.7, "onednn": 0.62}) == "onednn"
    with pytest.raises(ValueError):
        faster({})


@pytest.fixture
def f32_block_rows():
    """Sets the fp32 panel matmul's block height for one test, then puts back the one it ran
    before."""
    if not cpu_kernels.f32_matmul_available():
        pytest.skip("the fp32 panel matmul needs a CPU with AVX-512 or AVX2 and FMA")
    before = cpu_kernels.f32_block_rows_now()
    yield cpu_kernels.set_f32_block_rows
    cpu_kernels.set_f32_block_rows(before)


@pytest.mark.parametrize("gate_up", [False, True])
def test_fp32_panels_give_the_same_bits_at_either_block_height(gate_up, f32_block_rows):
    """Either block height (8 or 12 rows with AVX-512, 4 or 6 with AVX2) sums each output over
    K in the same order: the same bits, for row counts that leave every tail height (and, with
    AVX-512, several row chunks)."""
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(128, 96, generator=g)
    bias = torch.randn(128, generator=g)
    panels = cpu_kernels.pack_f32_weight(weight, gate_up)
    low, tall = cpu_kernels.f32_block_rows()
    for rows in (*range(1, 26), 64, 300, 517):
        x = torch.randn(rows, 96, generator=g)
        out = {}
        for height in (low, tall):
            f32_block_rows(height)
            out[height] = cpu_kernels.f32_linear(x, panels, bias, 128, gate_up)
        reference = F.linear(x, weight, bias)
        if gate_up:
            reference = silu_and_mul(reference)
        assert torch.equal(out[low], out[tall]), rows
        assert torch.allclose(out[low], reference, rtol=1e-5, atol=1e-4), rows
    with pytest.raises(ValueError, match="block rows"):
        f32_block_rows(16)


def test_fp32_lm_head_packing_equals_f_linear(fp32_layout_set):
    fp32_layout_set("transposed")  # the layers' layout; the head is packed for oneDNN anyway
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(1000, 64, generator=g)
    assert pack_weight(weight) is None  # only when asked for fp32
    packed = pack_weight(weight, (torch.bfloat16, torch.float32))
    assert packed.kind == "onednn"
    for rows in (1, 5, 64):
        x = torch.randn(rows, 64, generator=g)
        assert torch.allclose(linear(x, weight, None, packed), F.linear(x, weight), atol=1e-5)


# --- build and fallbacks, in fresh processes ---------------------------------------------------

def run_python(code: str, **env) -> dict:
    """Runs `code` in a fresh interpreter at the repository root; it prints one JSON line last."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return {**json.loads(result.stdout.strip().splitlines()[-1]), "log": result.stderr
            + result.stdout}


FALLBACK = """
    import json, torch
    from pagoda_kernels import cpu
    from pagoda_kernels.cpu.build import load
    from services.worker.attention.base import get_attn_backend
    try:
        get_attn_backend("cpu", dtype=torch.bfloat16)
        error = None
    except ValueError as e:
        error = str(e)
    print(json.dumps(dict(loaded=load() is not None, reason=cpu.unavailable_reason(),
                          available=cpu.available_for(torch.zeros(2, 2)),
                          auto=get_attn_backend("auto", dtype=torch.bfloat16).name, error=error)))
"""


def test_pagoda_cpu_kernels_0_turns_them_off(tmp_path):
    out = run_python(FALLBACK, PAGODA_CPU_KERNELS="0", PAGODA_CACHE_DIR=str(tmp_path))
    assert not out["loaded"] and not out["available"]
    assert out["auto"] == "torch"
    assert "PAGODA_CPU_KERNELS=0" in out["reason"] and "PAGODA_CPU_KERNELS=0" in out["error"]
    assert not (tmp_path / "kernels").exists()  # nothing was built


def test_a_broken_compiler_leaves_the_torch_ops_in_charge(tmp_path):
    out = run_python(FALLBACK, CC="/bin/false", PAGODA_CACHE_DIR=str(tmp_path))
    assert not out["loaded"] and not out["available"]
    assert out["auto"] == "torch"
    assert "/bin/false" in out["reason"] and "failed" in out["reason"]
    assert "failed" in out["error"]
    assert os.listdir(tmp_path / "kernels") == []  # the half-built file is removed


LOAD = """
    import json, os, time, torch
    from pagoda_kernels.cpu import build
    start = time.perf_counter()
    lib = build.load()
    print(json.dumps(dict(loaded=lib is not None, reason=build.unavailable_reason(),
                          seconds=time.perf_counter() - start,
                          files=sorted(os.listdir(build.cache_dir())))))
"""


def test_the_library_is_built_once_into_the_cache_dir_and_reused(tmp_path):
    # What is tested is the race and the cache, not the code: the compiler, through a wrapper
    # that puts -O0 after the build's own -O3 (the last -O wins), takes a few seconds a build
    # instead of ~18.
    compiler = tmp_path / "cc-O0"
    compiler.write_text(f'#!/bin/sh\nexec {shutil.which("cc") or shutil.which("gcc")} "$@" -O0\n')
    compiler.chmod(0o755)
    env = dict(PAGODA_CACHE_DIR=str(tmp_path / "cache"), CC=str(compiler))
    # Two processes starting together both find no library and build it: each renames its own
    # finished build into place, so both load a whole file and one library is left.
    script = textwrap.dedent(LOAD)
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **env})
             for _ in range(2)]
    results, logs = [], ""
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        results.append(json.loads(stdout.strip().splitlines()[-1]))
        logs += stdout + stderr
    assert all(r["loaded"] and r["reason"] is None for r in results)
    assert "building cpu kernels" in logs
    files = os.listdir(tmp_path / "cache" / "kernels")
    assert len(files) == 1  # no half-built temporaries left behind
    assert files[0].startswith("pagoda_cpu_kernels_") and files[0].endswith(".so")
    library = tmp_path / "cache" / "kernels" / files[0]
    built = library.stat().st_mtime_ns
    again = run_python(LOAD, **env)
    assert again["loaded"] and again["files"] == files
    assert "building cpu kernels" not in again["log"]
    assert library.stat().st_mtime_ns == built


# --- a tiny bf16 Llama -----------------------------------------------------------------------

class TinyBf16Llama:
    """transformers in bf16, pagoda in bf16 with the CPU kernels, and pagoda with the torch ops."""

    def __init__(self, folder):
        self.hf_config = tiny_llama_config()
        self.hf = save_random_model(self.hf_config, folder).to(torch.bfloat16)
        c = self.hf_config
        self.head_dim = c.hidden_size // c.num_attention_heads
        config = model_config_for(folder, c, torch.bfloat16)
        self.cpu_backend = get_attn_backend("cpu", dtype=torch.bfloat16,
                                            num_heads=c.num_attention_heads,
                                            num_kv_heads=c.num_key_value_heads,
                                            head_dim=self.head_dim, block_size=16)
        assert self.cpu_backend.name == "cpu"
        self.on = load_model(config, load_config(), torch.device("cpu"), self.cpu_backend)
        self.off = load_model(config, load_config(), torch.device("cpu"), TorchAttentionBackend())

    def greedy(self, model, prompts, steps, forced=None):
        """Prefills the prompts together, decodes `steps` tokens -> (tokens, logits per step);
        with `forced` (tokens per prompt) those are appended instead of the argmax."""
        c = self.hf_config
        planner = PagedBatchPlanner(64, 16, seed=3)
        caches = new_kv_caches(c.num_hidden_layers, 64, 16, c.num_key_value_heads,
                               self.head_dim, torch.bfloat16)
        seqs = [PagedSequence(list(p)) for p in prompts]
        step = planner.plan_step([(s, len(s.token_ids)) for s in seqs], [])
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        with torch.inference_mode():
            logits = model.compute_logits(model(step.input_ids, step.positions, caches,
                                                step.meta))[ends]
            all_logits = [logits]
            for _ in range(steps):
                n = len(all_logits) - 1
                next_tokens = (all_logits[-1].argmax(-1).tolist() if forced is None
                               else [f[n] for f in forced])
                for seq, token in zip(seqs, next_tokens):
                    seq.token_ids.append(token)
                step = planner.plan_step([], seqs)
                all_logits.append(model.compute_logits(
                    model(step.input_ids, step.positions, caches, step.meta)))
        return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)], all_logits


def top2_gap(logits: torch.Tensor) -> torch.Tensor:
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def test_tiny_bf16_llama_with_the_kernels_matches_transformers_and_the_torch_ops(tmp_path,
                                                                                  monkeypatch):
    pair = TinyBf16Llama(tmp_path)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 1)]
    steps = 8
    tokens, logits_on = pair.greedy(pair.on, prompts, steps)
    logits_on = torch.stack(logits_on, dim=1).float()  # [num_seqs, steps + 1, vocab]
    # Each step's logits against transformers run over the whole sequence so far.
    with torch.no_grad():
        hf_logits = torch.stack([
            pair.hf(torch.tensor([prompt + tokens[i]])).logits[0, len(prompt) - 1:].float()
            for i, prompt in enumerate(prompts)])
    hf_diff = (logits_on - hf_logits).abs().max().item()
    # The same model with the torch ops in place of every kernel, fed the same tokens.
    monkeypatch.setattr(cpu_kernels, "available_for", lambda x: False)
    _, logits_off = pair.greedy(pair.off, prompts, steps, forced=tokens)
    logits_off = torch.stack(logits_off, dim=1).float()
    off_diff = (logits_on - logits_off).abs().max().item()
    print(f"bf16 kernels vs transformers bf16: max abs logit diff {hf_diff:.3e}; vs the torch "
          f"ops {off_diff:.3e} (logits up to {logits_on.abs().max().item():.2f})")
    assert hf_diff < 0.1 and off_diff < 0.1
    # Greedy choices: the torch ops and transformers pick the kernels' token at every step,
    # except where their own top two logits tie within that noise (bf16 logits of this tiny
    # random model are often exactly equal: one bf16 step is 1/64 here).
    chosen = torch.tensor(tokens)  # [num_seqs, steps]
    for name, logits, diff in (("torch ops", logits_off, off_diff), ("transformers", hf_logits,
                                                                      hf_diff)):
        same = logits[:, :steps].argmax(-1) == chosen
        near_tie = top2_gap(logits[:, :steps]) <= 2 * diff
        print(f"{name}: {int(same.sum())}/{same.numel()} greedy tokens equal, the rest near ties")
        assert (same | near_tie).all()
        assert same.float().mean() >= 0.9


# --- the KV cache write and the bf16 layer blocks (tests/test_layer_blocks.py: every kind) -------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_equals_the_reference(dtype):
    """K and V as the model hands them over: views into one qkv row, at its stride."""
    g = torch.Generator().manual_seed(8)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 2, 8, 9
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    k = qkv[:, 4 * head_dim:(4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    reference.write_kv_cache(k, v, *expected, slots)
    cpu_kernels.write_kv_cache(k, v, *caches, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert not torch.equal(caches[0], caches[1])


def test_write_kv_cache_refuses_a_slot_outside_the_cache_and_writes_nothing():
    k = torch.ones(3, 2, 8)
    caches = [torch.zeros(2, 4, 2, 8) for _ in range(2)]
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        cpu_kernels.write_kv_cache(k, k, *caches, torch.tensor([0, 5, 8]))
    assert not caches[0].any() and not caches[1].any()
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.write_kv_cache(k.bfloat16(), k.bfloat16(), *caches, torch.tensor([0, 1, 2]))


@needs_bf16_panels
def test_tiny_bf16_llama_runs_its_layers_as_blocks_which_change_no_logit(tmp_path):
    pair = TinyBf16Llama(tmp_path)
    assert pair.on.model.use_blocks and pair.off.model.use_blocks
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 40, 1)]
    tokens, logits_blocks = pair.greedy(pair.on, prompts, 6)
    pair.on.model.use_blocks = False  # each op through its module, as on CPUs without AVX512-BF16
    tokens_layers, logits_layers = pair.greedy(pair.on, prompts, 6)
    assert tokens == tokens_layers
    assert all(torch.equal(a, b) for a, b in zip(logits_blocks, logits_layers))
    # Weights left to oneDNN (as without AVX512-BF16): the layers run module by module.
    cpu_kernels.set_bf16_matmul(False)
    try:
        assert not TinyBf16Llama(tmp_path / "onednn").on.model.use_blocks
    finally:
        cpu_kernels.set_bf16_matmul(True)
