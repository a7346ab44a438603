"""The C prefill attention for whole prompts (pagoda_kernels/cpu/prefill_attention.c) against the torch
reference (pagoda_kernels.reference.causal_prefill_attention), on every path this machine runs
(portable, AVX-512 or AVX2, AVX512-BF16 and AMX for bf16), and the CPU attention backend that
calls it against the torch backend."""
import itertools

import pytest
import torch

from pagoda_kernels import cpu as cpu_kernels
from pagoda_kernels import reference
from services.worker.attention.cpu_backend import CpuAttentionBackend
from services.worker.attention.torch_backend import TorchAttentionBackend
from tests.helpers import PagedBatchPlanner, PagedSequence, profile_metadata

PATHS = cpu_kernels.prefill_paths()
# Several sequences of different lengths: 1, and lengths on both sides of the 16- and 32-key
# blocks, so that blocks straddle sequences.
LENGTHS = {"one token": [1], "one prompt": [77], "several": [1, 16, 33, 5, 64, 2, 31]}
HEADS = [(9, 3), (8, 8), (4, 1)]
# bf16: the output's own rounding (half a bf16 step, ~0.4%) plus the probabilities rounded to
# bf16 on the AMX and AVX512-BF16 paths; fp32: the order of the float sums.
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# Each path with the dtypes it runs (AMX and AVX512-BF16: bf16 only; fp32 there takes
# AVX-512).
PATH_DTYPES = [(p, d) for p in PATHS for d in (torch.float32, torch.bfloat16)
               if p not in ("amx", "avx512_bf16") or d == torch.bfloat16]


@pytest.fixture(params=PATH_DTYPES,
                ids=lambda c: f"{c[0]}-{'fp32' if c[1] == torch.float32 else 'bf16'}")
def path_dtype(request):
    cpu_kernels.set_prefill_path(request.param[0])
    yield request.param
    cpu_kernels.set_prefill_path("amx")


def packed(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int = 0):
    """Random q [T, heads, D] and k, v [T, kv_heads, D] as views of one fused qkv (tokens
    strided, as the model passes them), and query_start_loc."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    starts = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int64)
    return (q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim),
            v.view(tokens, kv_heads, head_dim), starts)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}/{h[1]}")
@pytest.mark.parametrize("layout", LENGTHS)
def test_causal_prefill_equals_the_reference(layout, heads, head_dim, path_dtype):
    dtype = path_dtype[1]
    lengths = LENGTHS[layout]
    q, k, v, starts = packed(lengths, *heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # an element left unwritten fails
    returned = cpu_kernels.causal_prefill_attention(q, k, v, starts, max(lengths), scale, out=out)
    assert returned.data_ptr() == out.data_ptr() and not out.isnan().any()
    # The reference in fp32 on the same (bf16-valued) inputs, and in the input dtype.
    exact = reference.causal_prefill_attention(q.float(), k.float(), v.float(), starts,
                                               max(lengths), scale)
    torch.testing.assert_close(out.float(), exact, **TOLERANCE[dtype])
    torch.testing.assert_close(out, reference.causal_prefill_attention(q, k, v, starts,
                                                                       max(lengths), scale),
                               **TOLERANCE[dtype])


def test_a_long_prompt_beside_short_ones_over_many_key_blocks(path_dtype):
    """Online softmax across many blocks, with scores large enough that the running max moves."""
    dtype = path_dtype[1]
    lengths = [3, 700, 41]
    q, k, v, starts = packed(lengths, 9, 3, 64, dtype, seed=1)
    q = q * 4  # peaked softmax: a late key block often holds a new max
    out = cpu_kernels.causal_prefill_attention(q, k, v, starts, max(lengths), 0.125)
    exact = reference.causal_prefill_attention(q.float(), k.float(), v.float(), starts,
                                               max(lengths), 0.125)
    torch.testing.assert_close(out.float(), exact, **TOLERANCE[dtype])


def test_the_vector_path_runs_where_the_cpu_has_one():
    vector = [p for p in ("avx512", "avx2") if p in PATHS]
    if not vector:
        pytest.skip("this CPU (or the kernels' build) has neither AVX-512 nor AVX2 with FMA: "
                    "only the portable path runs here")
    q, k, v, starts = packed([50, 7], 9, 3, 64, torch.float32)
    results = {}
    for p in ("portable", vector[0]):
        cpu_kernels.set_prefill_path(p)
        results[p] = cpu_kernels.causal_prefill_attention(q, k, v, starts, 50, 0.125)
    cpu_kernels.set_prefill_path("amx")
    torch.testing.assert_close(results[vector[0]], results["portable"], atol=1e-5, rtol=1e-5)


def test_the_avx512_bf16_path_runs_where_the_cpu_has_it_and_is_the_default_there():
    if "avx512_bf16" not in PATHS:
        pytest.skip("this CPU (or the kernels' build) lacks AVX512-BF16: bf16 prefill attention "
                    "widens to float on AVX-512 here")
    q, k, v, starts = packed([300, 7, 64], 9, 3, 64, torch.bfloat16)
    results = {}
    try:
        for p in ("avx512", "avx512_bf16", "amx"):  # "amx": the default, falling to avx512_bf16
            cpu_kernels.set_prefill_path(p)
            results[p] = cpu_kernels.causal_prefill_attention(q, k, v, starts, 300, 0.125)
    finally:
        cpu_kernels.set_prefill_path("amx")
    # Its probabilities rounded to bf16: not the widened path's result bit for bit.
    assert not torch.equal(results["avx512_bf16"], results["avx512"])
    torch.testing.assert_close(results["avx512_bf16"].float(), results["avx512"].float(),
                               **TOLERANCE[torch.bfloat16])
    if "amx" not in PATHS:
        assert torch.equal(results["amx"], results["avx512_bf16"])


def test_shapes_it_does_not_run_are_refused_and_the_backend_falls_back():
    assert not cpu_kernels.causal_prefill_supports(torch.float32, torch.device("cpu"), 8, 2, 32)
    assert not cpu_kernels.causal_prefill_supports(torch.float16, torch.device("cpu"), 8, 2, 64)
    assert cpu_kernels.causal_prefill_supports(torch.bfloat16, torch.device("cpu"), 9, 3, 64)
    q, k, v, starts = packed([5, 9], 4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="head_dim 32"):
        cpu_kernels.causal_prefill_attention(q, k, v, starts, 9, 0.2)
    meta = profile_metadata([5, 9])
    out = CpuAttentionBackend().forward(q, k, v, None, None, meta, 0.2)
    expected = TorchAttentionBackend().forward(q, k, v, None, None, meta, 0.2)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("bad", [[0, 5, 3, 14], [1, 5, 14], [0, 5, 13]],
                         ids=["going back", "not from 0", "not to T"])
def test_query_start_loc_out_of_order_is_refused_before_writing(bad):
    q, k, v, _ = packed([5, 9], 9, 3, 64, torch.float32)
    out = torch.full(q.shape, 7.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        cpu_kernels.causal_prefill_attention(q, k, v, torch.tensor(bad), 9, 0.125, out=out)
    assert (out == 7.0).all()


class Sequence(PagedSequence):
    def __init__(self, length: int, g: torch.Generator, dtype: torch.dtype):
        super().__init__(token_ids=[0] * length)
        self.q = torch.randn(length, 9, 64, generator=g).to(dtype)
        self.k = torch.randn(length, 3, 64, generator=g).to(dtype)
        self.v = torch.randn(length, 3, 64, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_backend_equals_the_torch_backend_on_a_mixed_step(dtype):
    """Whole prompts (kernel), a chunk over a cached prefix (torch, gathering) and decodes in
    one step; and the profile run (no cache)."""
    g = torch.Generator().manual_seed(2)
    planner = PagedBatchPlanner(num_blocks=64, block_size=16)
    caches = {name: (torch.zeros(64, 16, 3, 64, dtype=dtype),
                     torch.zeros(64, 16, 3, 64, dtype=dtype)) for name in ("cpu", "torch")}
    backends = {"cpu": CpuAttentionBackend(), "torch": TorchAttentionBackend()}

    def step(prefills, decodes):
        spans = [(s, s.num_computed, s.num_computed + n) for s, n in prefills]
        spans += [(s, s.num_computed, s.num_computed + 1) for s in decodes]
        meta = planner.plan_step(prefills, decodes).meta
        q, k, v = (torch.cat([getattr(s, name)[a:b] for s, a, b in spans]) for name in "qkv")
        outs = {name: backends[name].forward(q, k, v, *caches[name], meta, 0.125)
                for name in backends}
        torch.testing.assert_close(outs["cpu"], outs["torch"], **TOLERANCE[dtype])
        return meta

    decoding = [Sequence(n, g, dtype) for n in (20, 3)]
    chunked = Sequence(90, g, dtype)
    first = step([(s, len(s.token_ids) - 1) for s in decoding] + [(chunked, 40)], [])
    assert first.num_prefills == 3  # three whole prompts in one kernel call
    fresh = [Sequence(n, g, dtype) for n in (1, 37)]
    step([(fresh[0], 1), (chunked, 50), (fresh[1], 37)], decoding)

    lengths = [12, 1, 40]
    q, k, v, _ = packed(lengths, 9, 3, 64, dtype, seed=3)
    meta = profile_metadata(lengths)
    torch.testing.assert_close(CpuAttentionBackend().forward(q, k, v, None, None, meta, 0.125),
                               TorchAttentionBackend().forward(q, k, v, None, None, meta, 0.125),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("simd", ["avx2", ""], ids=["vector loop", "no vector loop"])
def test_the_backend_runs_the_kernel_only_where_it_has_a_vector_loop(monkeypatch, simd):
    """Without a vector loop the backend leaves whole prompts to torch (the portable loop is
    slower than SDPA); with one, every whole prompt of the step goes to the kernel in one call.
    Which loop this build has is stood in for: the check is the backend's choice."""
    from services.worker.attention import cpu_backend
    if simd and not PATHS:
        pytest.skip("the C kernels are not built here (no compiler, or PAGODA_CPU_KERNELS=0)")
    calls = []

    def counted(*args, **kwargs):
        calls.append(args)
        return cpu_kernels.causal_prefill_attention(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "prefill_simd_path", lambda: simd)
    monkeypatch.setattr(cpu_backend, "causal_prefill_attention", counted)
    lengths = [12, 1, 40]
    q, k, v, _ = packed(lengths, 9, 3, 64, torch.float32, seed=4)
    meta = profile_metadata(lengths)
    out = CpuAttentionBackend().forward(q, k, v, None, None, meta, 0.125)
    assert len(calls) == (1 if simd else 0)
    expected = TorchAttentionBackend().forward(q, k, v, None, None, meta, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.float32])
