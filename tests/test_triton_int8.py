"""`--quantization int8` / `w8a8` on CUDA: the Triton kernels of pagoda_kernels/triton/int8_matmul.py,
the model wired to them, and the configuration that lets them run.

No GPU ran these tests where none is present: without CUDA the kernels run in Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, set here before triton is imported), the path
forced on there (services.worker.models.int8.TRITON_INT8). The interpreter checks what the
kernels compute (masking, indexing, scales, rounding), not the GPU compiler's code: a GPU run is
ops/bench/gpu_check's int8 check. (bf16 operands reach tl.dot as float32 under the interpreter,
whose bf16 dot is wrong: see pagoda_kernels/triton/int8_matmul.py `_interpreted_bf16`.)"""
import dataclasses
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import shared.engine_args as engine_args_module  # noqa: E402
from pagoda_kernels.triton import int8_matmul  # noqa: E402
from services.worker.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from services.worker.model_loader import load_model  # noqa: E402
from services.worker.models import int8  # noqa: E402
from services.worker.models.int8 import quantize_rows  # noqa: E402
from services.worker.models.linear import Linear  # noqa: E402
from shared.config import ConfigError  # noqa: E402
from shared.engine_args import EngineArgs  # noqa: E402
from tests.helpers import (PagedBatchPlanner, PagedSequence, load_config,  # noqa: E402
                           model_config_for, new_kv_caches, save_random_model,
                           tiny_llama_config)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda")
# Half an ulp of each output dtype, relative: the kernels round their float32 result once.
HALF_ULP = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def case(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * 0.1
    w[min(2, n - 1)] = 0  # an all-zero row: scale 1, q 0
    q, s = quantize_rows(w)
    b = (torch.randn(n, generator=g) * 0.5).to(dtype) if bias else None
    return x, q, s, b


def to_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def check_close(got: torch.Tensor, ref: torch.Tensor, abs_terms: torch.Tensor, k: int,
                dtype: torch.dtype):
    """got within half an ulp of its dtype of the float64 reference, plus float32 rounding of a
    sum of k terms whose magnitudes sum to abs_terms (2 k 2^-24 of it: any summation order)."""
    assert got.dtype == dtype
    got = got.double().cpu()
    assert torch.isfinite(got).all()
    bound = HALF_ULP[dtype] * ref.abs() + (2 * k + 4) * 2.0 ** -24 * abs_terms + 1e-30
    excess = ((got - ref).abs() - bound).max().item()
    assert excess <= 0, f"error beyond the bound by {excess}"


# N, K: neither a multiple of any block; K over several steps of every tile's depth (64-512).
SHAPES = [(40, 70), (130, 600)]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_weight_only_kernel_is_the_dequantized_product(m, n, k, dtype, bias):
    """Interpreter only where no GPU is present (module docstring)."""
    x, q, s, b = case(m, n, k, dtype, bias, seed=m * 1000 + n + k)
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.T + (0 if b is None else b.double())
    abs_terms = x.double().abs() @ w.abs().T + (0 if b is None else b.double().abs())
    xd, qd, sd, bd = to_device(x, q, s, b)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    got = int8_matmul.int8_linear(xd, qd, sd, bd, out=out)
    assert got.data_ptr() == out.data_ptr()
    check_close(got, ref, abs_terms, k, dtype)
    check_close(int8_matmul.int8_linear(xd, qd, sd, bd), ref, abs_terms, k, dtype)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_kernel_is_the_int8_product_of_the_quantized_rows(m, n, k, dtype, bias):
    """The activations quantized as quantize_rows does (the reference's own quantization);
    interpreter only where no GPU is present."""
    x, q, s, b = case(m, n, k, dtype, bias, seed=m * 1000 + n + k + 1)
    x[0, 1] = 0.0
    if m > 1:
        x[1] = 0  # an all-zero row of activations
    xq, xs = quantize_rows(x)
    scaled = (xq.double() @ q.double().T) * xs.double()[:, None] * s.double()
    ref = scaled + (0 if b is None else b.double())
    abs_terms = scaled.abs() + (0 if b is None else b.double().abs())
    xd, qd, sd, bd = to_device(x, q, s, b)
    got_q, got_s = int8_matmul.quantize_rows_int8(xd)
    assert torch.equal(got_q.cpu(), xq) and torch.equal(got_s.cpu(), xs)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)  # poisoned
    got = int8_matmul.w8a8_linear(xd, qd, sd, bd, out=out)
    assert got.data_ptr() == out.data_ptr()
    check_close(got, ref, abs_terms, 0, dtype)


@pytest.mark.parametrize("n,block_n", [(70, 32), (130, 64)])
def test_decode_tiles_of_wide_outputs(n, block_n, monkeypatch):
    """One row with the 32- and 64-column decode tiles, which need N of thousands (the grid
    above gets the narrow 16): chosen here for small N by lowering the programs they must
    give; interpreter only where no GPU is present."""
    monkeypatch.setattr(int8_matmul, "_DECODE_MIN_PROGRAMS", 3)
    assert int8_matmul._blocks(1, n, int8_dot=False)[1] == block_n
    for quantization, fn in (("int8", int8_matmul.int8_linear), ("w8a8", int8_matmul.w8a8_linear)):
        x, q, s, b = case(1, n, 40, torch.bfloat16, True, seed=n)
        if quantization == "w8a8":
            xq, xs = quantize_rows(x)
            terms = (xq.double() @ q.double().T) * xs.double()[:, None] * s.double()
            k = 0
        else:
            terms = x.double() @ (q.double() * s.double()[:, None]).T
            k = 40
        ref = terms + b.double()
        abs_terms = (x.double().abs() @ (q.double().abs() * s.double()[:, None]).T
                     + b.double().abs())
        check_close(fn(*to_device(x, q, s, b)), ref, abs_terms, k, torch.bfloat16)


def test_w8a8_row_quantization_rounds_half_to_even_and_clamps():
    """Values exactly half way between two steps (x / scale = k + 0.5) go to the even one, as
    torch.round; interpreter only where no GPU is present."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -127.0, 3.49]])
    q, s = int8_matmul.quantize_rows_int8(x.to(DEVICE))
    assert s.item() == 1.0
    assert q.cpu().tolist() == [[127, 0, 2, 2, 0, -2, -2, 126, -127, 3]]


def test_the_kernels_refuse_what_they_do_not_take_by_name():
    x, q, s, b = to_device(*case(2, 8, 32, torch.float32, True, seed=0))
    with pytest.raises(ValueError, match="^int8_linear: q must be contiguous"):
        int8_matmul.int8_linear(x, q[:, :16], s)
    with pytest.raises(ValueError, match="^w8a8_linear: s must be"):
        int8_matmul.w8a8_linear(x, q, s.double())
    with pytest.raises(ValueError, match="^int8_linear: bias must be"):
        int8_matmul.int8_linear(x, q, s, b.bfloat16())
    with pytest.raises(ValueError, match="^int8_linear: out must be"):
        int8_matmul.int8_linear(x, q, s, out=torch.empty(2, 9, device=DEVICE))


def test_a_linear_packed_for_triton_keeps_int8_rows_and_sends_x_to_the_kernel(monkeypatch):
    """pack_weight with the Triton path forced: the PackedWeight holds q [out, in] and s as
    quantize_rows gives them, and linear() returns the kernel's product (SiLU * up is the
    model's, after it); interpreter only where no GPU is present."""
    monkeypatch.setattr(int8, "TRITON_INT8", True)
    for quantization in ("int8", "w8a8"):
        layer = Linear(48, 24, bias=True, dtype=torch.float32)
        g = torch.Generator().manual_seed(3)
        layer.weight.data = torch.randn(24, 48, generator=g).to(DEVICE)
        layer.bias.data = torch.randn(24, generator=g).to(DEVICE)
        q, s = quantize_rows(layer.weight.data.cpu())
        layer.pack(quantization=quantization)
        packed = layer.packed
        assert packed.kind == f"triton_{quantization}" and not packed.gate_up
        assert torch.equal(packed.data.cpu(), q) and torch.equal(packed.scale.cpu(), s)
        assert layer.weight.is_meta
        x = torch.randn(2, 3, 48, generator=g).to(DEVICE)
        fn = int8_matmul.w8a8_linear if quantization == "w8a8" else int8_matmul.int8_linear
        want = fn(x.reshape(6, 48), packed.data, packed.scale, layer.bias.data).view(2, 3, 24)
        assert torch.equal(layer(x), want)


# --- a tiny model on the Triton int8 path -------------------------------------------------------

PROMPTS = [[5, 17, 200, 3, 9, 41, 77, 8, 100, 12, 6, 90, 33, 2, 71, 140, 18], [250, 1, 2]]
NEW_TOKENS = 5


def greedy(model, hf_config) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Both prompts in one prefill step (20 rows), then decode steps of both (2 rows): greedy
    tokens and each step's logits of the last rows."""
    planner = PagedBatchPlanner(num_blocks=8, block_size=16)
    caches = new_kv_caches(hf_config.num_hidden_layers, 8, 16, hf_config.num_key_value_heads,
                           hf_config.hidden_size // hf_config.num_attention_heads)
    seqs = [PagedSequence(list(p)) for p in PROMPTS]
    step = planner.plan_step([(s, len(s.token_ids)) for s in seqs], [])
    all_logits = []
    for _ in range(NEW_TOKENS):
        hidden = model(step.input_ids, step.positions, caches, step.meta)
        logits = model.compute_logits(hidden[step.meta.query_start_loc[1:] - 1])
        all_logits.append(logits.float().clone())
        for seq, token in zip(seqs, logits.argmax(-1).tolist()):
            seq.token_ids.append(token)
        step = planner.plan_step([], seqs)
    return [s.token_ids[len(p):] for s, p in zip(seqs, PROMPTS)], all_logits


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_a_tiny_llama_on_the_triton_kernels_decodes_as_the_cpu_int8_path(tmp_path, monkeypatch,
                                                                         quantization):
    """The same float32 model loaded twice with `quantization`: on the CPU's int8 path (its C
    kernels and layer blocks where built, else torch) and with the Triton kernels forced on for
    every matmul. Both hold the same q and s (quantize_rows), so they differ only in how the
    float32 sums are rounded (and, weight-only, the CPU's 24-bit fixed point for activations):
    the greedy tokens must be identical and the logits agree to float32 rounding. Interpreter
    only where no GPU is present."""
    hf_config = tiny_llama_config()
    save_random_model(hf_config, tmp_path)
    model_config = dataclasses.replace(model_config_for(tmp_path, hf_config),
                                       quantization=quantization)

    def load():
        return load_model(model_config, load_config(), torch.device("cpu"),
                          TorchAttentionBackend())

    cpu_model = load()
    want, want_logits = greedy(cpu_model, hf_config)

    monkeypatch.setattr(int8, "TRITON_INT8", True)
    calls = []
    fn_name = "w8a8_linear" if quantization == "w8a8" else "int8_linear"
    fn = getattr(int8_matmul, fn_name)
    monkeypatch.setattr(int8_matmul, fn_name, lambda *a, **kw: calls.append(1) or fn(*a, **kw))
    triton_model = load()
    kinds = {m.packed.kind for m in triton_model.modules() if isinstance(m, Linear)}
    assert kinds == {f"triton_{quantization}"}
    got, got_logits = greedy(triton_model, hf_config)

    # Four matmuls a layer and the head, every step.
    assert len(calls) == NEW_TOKENS * (4 * hf_config.num_hidden_layers + 1)
    assert got == want
    # w8a8: one activation off by a step after a last-bit difference upstream moves a logit by
    # about a 127th of one product: 1e-3 covers that, a wrong scale or row would not fit.
    tol = 1e-3 if quantization == "w8a8" else 1e-4
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --- configuration ----------------------------------------------------------------------------

@pytest.fixture
def on_cuda(monkeypatch):
    """Configuration as on a CUDA host (nothing in it touches the device): as tests/test_config.py."""
    monkeypatch.setattr(EngineArgs, "_device", lambda self: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama_config(max_position_embeddings=512).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_the_config_accepts_int8_and_w8a8_on_cuda(model_folder, on_cuda, quantization):
    config = EngineArgs(model=model_folder, quantization=quantization).create_engine_config()
    assert config.device_config.device.type == "cuda"
    assert config.model_config.quantization == quantization


def test_the_config_refuses_int8_on_cuda_without_triton(model_folder, on_cuda, monkeypatch):
    monkeypatch.setattr(engine_args_module, "_has_triton", lambda: False)
    with pytest.raises(ConfigError, match="^quantization: 'int8' on cuda needs triton"):
        EngineArgs(model=model_folder, quantization="int8").create_engine_config()


def test_the_config_still_refuses_gguf_on_cuda(on_cuda):
    with pytest.raises(ConfigError, match="^quantization: 'gguf' runs on the cpu device only"):
        EngineArgs(quantization="gguf").create_engine_config()
