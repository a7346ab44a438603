"""GGUF weights kept packed (`--quantization gguf`): the kernels of pagoda_kernels/cpu/matmul_gguf.c
(both paths) against gguf's own dequantize, the default model (Q4_1) and a Q8_0 copy of it
against the same file dequantized, and the memory a packed load holds."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pagoda_kernels import cpu as cpu_kernels
from pagoda import LLM
from services.worker.models import gguf_weights
from services.worker.models.gguf_weights import (Q4_0, Q4_1, Q4_K, Q8_0, GGUFWeight,
                                                 allocate_part, fill_from_blocks, fill_from_float)
from services.worker.models.linear import Linear
from shared.config import ConfigError
from shared.engine_args import EngineArgs
from shared.model_source import default_model_path
from tests.helpers import greedy_agreement, greedy_outputs, perplexity
from tests.test_int8_weights import (MAX_TOKENS, MIN_AGREEING, PROMPTS, TEXT, TOP_K,
                                     reference_greedy, reference_perplexity)

gguf = pytest.importorskip("gguf")

TYPES = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K}
ROWS = [1, 3, 16, 130]  # the VNNI tiles' 4 rows: fewer, whole ones, and whole ones and a tail
SHAPES = [(32, 8), (96, 33), (160, 17), (576, 64)]  # (K, N): 1, 3, 5 and 18 blocks a row
K_SHAPES = [(256, 8), (512, 33), (768, 17)]  # Q4_K: super-blocks of 256


@pytest.fixture(params=["vnni", "portable"])
def gguf_path(request):
    """The VNNI path where this CPU has it (skipped where not), and the plain C loop."""
    if request.param == "vnni" and not cpu_kernels.gguf_simd_available():
        pytest.skip("the kernels were not built with AVX-512 VNNI on this CPU")
    if cpu_kernels.load() is None:
        pytest.skip(f"cpu kernels unavailable: {cpu_kernels.unavailable_reason()}")
    cpu_kernels.set_gguf_simd(request.param == "vnni")
    yield request.param
    cpu_kernels.set_gguf_simd(True)


def _q4_k_blocks(w: np.ndarray, rng) -> np.ndarray:
    """Random Q4_K super-blocks for a weight shaped like w (gguf's Python package cannot quantize
    to Q4_K): fp16 d and dmin scaled by each row's magnitude, random 6-bit scales and mins,
    random nibbles; every byte pattern of those is a valid block."""
    rows, k = w.shape
    supers = k // 256
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    mag = np.abs(w).max(axis=1, keepdims=True)[:, :, None] + 1e-3
    d = (rng.uniform(0.5, 1.5, (rows, supers, 1)) * mag / 15 / 63).astype(np.float16)
    dmin = (rng.uniform(0.0, 1.0, (rows, supers, 1)) * mag / 63).astype(np.float16)
    raw[:, :, 0:2] = d.view(np.uint8)
    raw[:, :, 2:4] = dmin.view(np.uint8)
    return raw.reshape(rows, supers * 144)


def _weight(qtype: int, n: int, k: int, seed: int) -> tuple[GGUFWeight, torch.Tensor]:
    """A random weight quantized by gguf (Q4_K: random blocks), packed -> (packed, gguf's
    dequantized fp32)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * np.logspace(-2, 0, n)[:, None]).astype(np.float32)
    kind = gguf.GGMLQuantizationType(qtype)
    raw = _q4_k_blocks(w, rng) if qtype == Q4_K else gguf.quants.quantize(w, kind)
    part = allocate_part(qtype, 0, n, k)
    fill_from_blocks(part, 0, raw)
    return GGUFWeight(k, [part]), torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it: 8-bit blocks of 32, d = max|x| / 127, q rounded half to even."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // 32, 32)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127)
    return (q * d[..., None]).reshape(rows, k)


MATMUL_CASES = [(name, k, n) for name in TYPES for k, n in (K_SHAPES if name == "Q4_K"
                                                               else SHAPES)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,k,n", MATMUL_CASES)
def test_gguf_matmul_equals_the_dequantized_weight(gguf_path, name, k, n, dtype):
    qtype = TYPES[name]
    weight, dense = _weight(qtype, n, k, seed=k * 1000 + n)
    part = weight.parts[0]
    for rows in ROWS:
        torch.manual_seed(rows)
        x = torch.randn(rows, k).to(dtype)
        bias = torch.randn(n).to(dtype) if rows % 2 else None
        # Written into the middle columns of a wider, NaN-filled output: nothing else touched.
        wide = torch.full((rows, n + 7), float("nan"), dtype=dtype)
        cpu_kernels.gguf_matmul(x, qtype, part.qs, part.d, part.m, bias, wide[:, 3:3 + n])
        out = wide[:, 3:3 + n].double()
        assert wide[:, :3].isnan().all() and wide[:, 3 + n:].isnan().all()
        assert not out.isnan().any()
        ref = _quantized_activations(x).double() @ dense.double().T
        plain = x.double() @ dense.double().T
        if bias is not None:
            ref += bias.double()
            plain += bias.double()
        scale = ref.abs().max().item()
        # The same sums in another order: fp32 rounding; bf16: the output's rounding.
        tol = (2e-5 if dtype == torch.float32 else 8e-3) * scale
        err = (out - ref).abs().max().item()
        assert err <= tol, f"{gguf_path} rows {rows}: max error {err:.3g} > {tol:.3g}"
        # Against the unquantized activations: the 8-bit blocks' rounding only.
        assert (out - plain).abs().max().item() <= 0.05 * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_linear_of_a_fused_weight_of_two_types_on_decode_and_prompt_rows(dtype):
    """Parts of different types fill their own output columns; above KERNEL_MAX_ROWS rows the
    weight is dequantized into a temporary and the dense matmul runs."""
    top, top_dense = _weight(Q4_1, 40, 96, seed=1)
    low, low_dense = _weight(Q8_0, 24, 96, seed=2)
    low.parts[0].row0 = 40
    weight = GGUFWeight(96, top.parts + low.parts)
    dense = torch.cat([top_dense, low_dense])
    assert torch.equal(weight.dequantize(torch.float32), dense)
    bias = torch.randn(64).to(dtype)
    limit = gguf_weights.KERNEL_MAX_ROWS[dtype]
    for rows in (1, limit, limit + 1):
        x = torch.randn(2, rows, 96).to(dtype)  # leading dims kept
        out = gguf_weights.gguf_linear(x, weight, bias)
        assert out.shape == (2, rows, 64) and out.dtype == dtype
        flat = x.reshape(-1, 96)
        act = _quantized_activations(flat) if 2 * rows <= limit else flat.float()
        ref = act.double() @ dense.double().T + bias.double()
        err = (out.reshape(-1, 64).double() - ref).abs().max().item()
        assert err <= (2e-5 if dtype == torch.float32 else 8e-3) * ref.abs().max().item()


@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_gguf_dequantize_is_ggufs_own(qtype):
    weight, dense = _weight(qtype, 37, 256, seed=qtype)
    assert torch.equal(weight.dequantize(torch.float32), dense)
    assert torch.equal(weight.dequantize(torch.bfloat16), dense.bfloat16())
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(weight.dequantize(torch.float32, ids), dense[ids])
    with pytest.raises(IndexError):
        weight.dequantize(torch.float32, torch.tensor([37]))


def test_gguf_kernels_refuse_arrays_that_do_not_fit_before_reading_them():
    """The C code trusts its shapes: each mismatch is a ValueError naming what does not fit,
    and nothing is written."""
    weight, _ = _weight(Q4_1, 20, 64, seed=4)  # two panels, the second padded
    p = weight.parts[0]
    x, out = torch.randn(2, 64), torch.full((2, 20), float("nan"))
    bad = {
        "x of another K": (torch.randn(2, 96), Q4_1, p.qs, p.d, p.m, 20),
        "qs of another type": (x, Q4_1, p.qs.view(torch.int8), p.d, p.m, 20),
        "qs of fewer panels": (x, Q4_1, p.qs[:1], p.d, p.m, 20),
        "qs not contiguous": (x, Q4_1, torch.zeros(2, 2, 512, dtype=torch.uint8)[:, :, ::2],
                              p.d, p.m, 20),
        "d in fp32": (x, Q4_1, p.qs, p.d.float(), p.m, 20),
        "Q4_1 without m": (x, Q4_1, p.qs, p.d, None, 20),
        "m of other panels": (x, Q4_1, p.qs, p.d, p.m[:1], 20),
        "Q8_0 on Q4 bytes": (x, Q8_0, p.qs, p.d, None, 20),
        "more rows than the panels hold": (x, Q4_1, p.qs, p.d, p.m, 33),
        "K not whole blocks": (torch.randn(2, 48), Q8_0, torch.zeros(2, 1, 512, dtype=torch.uint8),
                               torch.zeros(2, 1, 16, dtype=torch.float16), None, 20),
    }
    wide = torch.full((2, 33), float("nan"))
    for what, (xb, qtype, qs, d, m, n) in bad.items():
        with pytest.raises(ValueError, match="^gguf matmul: "):
            cpu_kernels.gguf_matmul(xb, qtype, qs, d, m, None, wide[:, :n])
        assert wide.isnan().all(), what
        with pytest.raises(ValueError, match="^gguf dequantize: "):
            cpu_kernels.gguf_dequantize(qtype, qs, d, m, n, xb.shape[1], torch.float32)
    with pytest.raises(ValueError, match="qs uint8 \\[2, 2, 256\\].*qs \\(2, 2, 256\\) torch.int8"):
        cpu_kernels.gguf_matmul(x, Q4_1, p.qs.view(torch.int8), p.d, p.m, None, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_gguf_vnni_and_plain_c_agree_to_the_bit(qtype, dtype):
    """The same integer sums and fused multiply-adds in the same order on both paths, the bias
    and the output's rounding included (50 rows: the last panel partial)."""
    if not cpu_kernels.gguf_simd_available():
        pytest.skip("the kernels were not built with AVX-512 VNNI on this CPU")
    weight, _ = _weight(qtype, 50, 256, seed=7)
    part = weight.parts[0]
    x, bias = torch.randn(6, 256).to(dtype), torch.randn(50).to(dtype)
    outs = []
    try:
        for simd in (True, False):
            cpu_kernels.set_gguf_simd(simd)
            out = torch.empty(6, 50, dtype=dtype)
            cpu_kernels.gguf_matmul(x, qtype, part.qs, part.d, part.m, bias, out)
            outs.append(out)
    finally:
        cpu_kernels.set_gguf_simd(True)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("qtype", TYPES.values(), ids=TYPES.keys())
def test_rows_filled_in_pieces_that_split_panels_equal_one_fill(qtype):
    """A streaming load fills a part tensor by tensor: pieces starting and ending inside a panel
    of 16 rows land where one fill of all the rows puts them."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((45, 256)) * 0.1).astype(np.float32)
    kind = gguf.GGMLQuantizationType(qtype)
    raw = _q4_k_blocks(w, rng) if qtype == Q4_K else gguf.quants.quantize(w, kind)
    whole = allocate_part(qtype, 0, 45, 256)
    fill_from_blocks(whole, 0, raw)
    pieces = allocate_part(qtype, 0, 45, 256)
    for a, b in ((0, 5), (5, 37), (37, 45)):
        fill_from_blocks(pieces, a, raw[a:b])
    for name in ("qs", "d", "m"):
        if getattr(whole, name) is not None:
            assert torch.equal(getattr(whole, name), getattr(pieces, name)), name
    dense = torch.from_numpy(gguf.quants.dequantize(raw, kind).copy())
    assert torch.equal(GGUFWeight(256, [pieces]).dequantize(torch.float32), dense)


def test_a_gguf_matrix_whose_k_is_not_whole_blocks_is_refused_by_name(tmp_path):
    """An F16 matrix of 40 inputs: no block type holds it, so the packed load names it."""
    from types import SimpleNamespace

    from services.worker.models.gguf_load import GGUFFile
    path = str(tmp_path / "odd.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", np.ones((8, 40), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path, SimpleNamespace(num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(ValueError, match="^model.layers.0.mlp.down_proj.weight: 40 inputs, not "
                                         "a multiple of 32"):
        file.packed_into(GGUFWeight(40), ["model.layers.0.mlp.down_proj.weight"])


def test_a_q4_k_tensor_of_a_file_loads_packed_as_gguf_dequantizes_it(tmp_path):
    """Q4_K (most llama.cpp files' type) through the loader: a file's super-blocks become blocks
    of 32 with fp32 scales and mins, and dequantize exactly as gguf does."""
    from types import SimpleNamespace

    from services.worker.models.gguf_load import GGUFFile
    rng = np.random.default_rng(11)
    raw = _q4_k_blocks(rng.standard_normal((40, 512)).astype(np.float32), rng)
    path = str(tmp_path / "q4_k.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(path, SimpleNamespace(num_attention_heads=4, num_key_value_heads=4))
    weight = GGUFWeight(512)
    file.packed_into(weight, ["model.layers.0.mlp.down_proj.weight"])
    (part,) = weight.parts
    assert part.qtype == Q4_K and part.d.dtype == part.m.dtype == torch.float32
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    assert torch.equal(weight.dequantize(torch.float32), torch.from_numpy(dense.copy()))


def test_a_type_without_a_kernel_is_requantized_to_q8_0_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(20, 64) * torch.logspace(-3, 1, 20)[:, None]
    w[3, :32] = 0  # an all-zero block
    part = allocate_part(Q8_0, 0, 20, 64)
    fill_from_float(part, 0, w)
    back = GGUFWeight(64, [part]).dequantize(torch.float32)
    # d [panels, blocks, 16 rows] -> each weight's step [rows, 64]
    step = part.d.float().permute(0, 2, 1).reshape(-1, 2)[:20].repeat_interleave(32, dim=1)
    assert (back[3, :32] == 0).all()
    assert ((back - w).abs() <= 0.5 * step * 1.01 + 1e-12).all()


def test_gguf_quantization_config():
    path = default_model_path()
    assert EngineArgs(model=path, quantization="auto").create_engine_config() \
        .model_config.quantization == "gguf"
    with pytest.raises(ConfigError, match="^quantization: .*tensor_parallel_size"):
        EngineArgs(model=path, quantization="gguf", tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ConfigError, match="^quantization: must be .*gguf"):
        EngineArgs(model=path, quantization="q4").create_engine_config()


# --- the default model and a Q8_0 copy ------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_llm():
    llm = LLM(quantization="gguf", kv_cache_space_gib=0.25, swap_space=0.05)
    yield llm
    del llm


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    from ops.make_gguf import make_gguf
    return make_gguf(str(tmp_path_factory.mktemp("gguf") / "model.Q8_0.gguf"), "Q8_0")


def _model(llm: LLM):
    return llm.llm_engine.executor.worker.model_runner.model


def _greedy_agreement(ref_outputs, llm: LLM, label: str) -> int:
    out = greedy_outputs(llm, PROMPTS, MAX_TOKENS, TOP_K)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out)
    agreeing, lines = greedy_agreement(ref_outputs, out, TOP_K, ("dequantized", "packed"))
    print(f"\n{label}: packed vs dequantized, {agreeing}/{len(PROMPTS)} agree over "
          f"{MAX_TOKENS} tokens, {len(lines)} differ")
    for line in lines:
        print("  ", line)
    return agreeing


@pytest.fixture(scope="module")
def file_tensors() -> list[tuple[tuple[int, ...], int]]:
    """(shape, bytes) of each tensor of the default model's file, read once by gguf's reader
    (which parses the whole vocabulary too)."""
    reader = gguf.GGUFReader(default_model_path())
    return [(tuple(int(d) for d in t.shape), int(t.n_bytes)) for t in reader.tensors]


def test_the_gguf_model_holds_the_files_blocks(gguf_llm, file_tensors):
    model = _model(gguf_llm)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed.kind == "gguf" and m.weight.device.type == "meta"
                           and [p.qtype for p in m.packed.gguf.parts] == [Q4_1] for m in linears)
    embed = model.model.embed_tokens
    assert embed.weight.device.type == "meta" and embed.packed.parts[0].qtype == Q8_0
    assert model.lm_head_packed.gguf is embed.packed  # the tied head: the same blocks
    matrices = sum(n_bytes for shape, n_bytes in file_tensors if len(shape) == 2)
    held = sum(m.packed.gguf.nbytes for m in linears) + embed.packed.nbytes
    assert held == matrices  # the file's bytes per weight


def dense_once(monkeypatch) -> None:
    """Within the monkeypatch: a whole packed weight's dequantized copy is made once and kept
    (embedding lookups, which dequantize rows, are left as they are)."""
    copies: dict[tuple[int, torch.dtype], torch.Tensor] = {}
    dequantize = GGUFWeight.dequantize

    def once(self, dtype, ids=None):
        if ids is not None:
            return dequantize(self, dtype, ids)
        key = (id(self), dtype)
        if key not in copies:
            copies[key] = dequantize(self, dtype)
        return copies[key]

    monkeypatch.setattr(GGUFWeight, "dequantize", once)


def _kernel_perplexity(llm: LLM, token_ids: list[int], monkeypatch) -> float:
    """Perplexity with every matmul on the quantized kernel, the prompt's rows included (by
    default a prompt runs a dequantized temporary and the dense matmul: the same weights as
    the dequantized file, so its perplexity is that file's to rounding)."""
    with monkeypatch.context() as m:
        m.setattr(gguf_weights, "KERNEL_MAX_ROWS", {torch.float32: 1 << 30,
                                                    torch.bfloat16: 1 << 30})
        return perplexity(llm, token_ids)


def test_gguf_q4_1_greedy_and_perplexity_match_the_dequantized_file(llm, gguf_llm, tokenizer,
                                                                     monkeypatch):
    """Against the session `llm`: the same file dequantized on load (today's default path)."""
    assert _greedy_agreement(reference_greedy(llm), gguf_llm, "Q4_1") >= MIN_AGREEING
    token_ids = tokenizer.encode(TEXT)
    ref = reference_perplexity(llm, token_ids)
    q = _kernel_perplexity(gguf_llm, token_ids, monkeypatch)
    print(f"Q4_1 perplexity over {len(token_ids)} tokens: dequantized {ref:.4f}, packed "
          f"(kernel on every row) {q:.4f} ({100 * (q / ref - 1):+.2f}%)")
    assert abs(q / ref - 1) <= 0.02


def test_gguf_q8_0_copy_greedy_and_perplexity_match_the_dequantized_file(q8_file, tokenizer,
                                                                         monkeypatch):
    """The reference is the same packed model with the kernel off: each matmul then runs the
    weight dequantized exactly as gguf dequantizes it (test_gguf_dequantize_is_ggufs_own), the
    values a dequantizing load of the file holds, without loading the file a second time.
    Each weight is dequantized once for the whole reference, not at every step."""
    packed = LLM(model=q8_file, quantization="gguf", kv_cache_space_gib=0.25, swap_space=0.05)
    assert {p.qtype for m in _model(packed).modules() if isinstance(m, Linear)
            for p in m.packed.gguf.parts} == {Q8_0}
    token_ids = tokenizer.encode(TEXT)
    with monkeypatch.context() as m:
        m.setattr(gguf_weights, "KERNEL_MAX_ROWS", {})
        dense_once(m)
        dense = greedy_outputs(packed, PROMPTS, MAX_TOKENS, TOP_K)
        ref = perplexity(packed, token_ids)
    assert _greedy_agreement(dense, packed, "Q8_0") >= MIN_AGREEING
    q = _kernel_perplexity(packed, token_ids, monkeypatch)
    print(f"Q8_0 perplexity over {len(token_ids)} tokens: dequantized {ref:.4f}, packed "
          f"(kernel on every row) {q:.4f} ({100 * (q / ref - 1):+.2f}%)")
    assert abs(q / ref - 1) <= 0.02


# --- memory ----------------------------------------------------------------------------------------

_PEAK_SCRIPT = r"""
import json, sys
import torch
from pagoda_kernels import cpu as cpu_kernels
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.model_loader import load_model
from shared.config import LoadConfig, ModelConfig, load_hf_config
from shared.model_source import resolve_model

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

cpu_kernels.load()
source = resolve_model(None)
config = ModelConfig(source=source, tokenizer=source.path, dtype=torch.float32, seed=0,
                     max_model_len=2048, hf_config=load_hf_config(source),
                     quantization=sys.argv[1] or None)
try:  # start the peak afresh (Linux: 5 resets VmHWM to the current RSS)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
baseline = status("VmRSS")
model = load_model(config, LoadConfig("auto"), torch.device("cpu"), TorchAttentionBackend())
print(json.dumps({"baseline": baseline, "peak": status("VmHWM")}))
"""


def _load_peak(quantization: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, quantization], capture_output=True,
                         text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    return figures["peak"] - figures["baseline"]


def test_a_packed_load_holds_the_packed_model_and_at_most_one_tensor_in_fp32(file_tensors):
    packed = sum(n_bytes for _, n_bytes in file_tensors)  # norms: F32 in the file and model
    largest_fp32 = max(int(np.prod(shape)) * 4 for shape, _ in file_tensors)
    margin = 48 << 20  # allocator and huge-page rounding, the model's small buffers
    grown = _load_peak("gguf")
    mib = 2 ** 20
    # (The dequantizing path, `_load_peak("")`, measured 745 MiB: docs/quantization.md.)
    print(f"\npeak RSS growth loading the default model: --quantization gguf {grown / mib:.0f} "
          f"MiB (limit {(packed + largest_fp32 + margin) / mib:.0f} = packed {packed / mib:.0f} "
          f"+ largest tensor in fp32 {largest_fp32 / mib:.0f} + margin {margin / mib:.0f})")
    assert grown <= packed + largest_fp32 + margin
