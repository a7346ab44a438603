"""The C layer blocks (pagoda_kernels/cpu/blocks.c, services/worker/models/layer_blocks.py): a tiny
Llama with each kind of packed weight (bf16 or fp32 panels, int8, w8a8, GGUF Q8_0 / Q4_0 / Q4_1)
and bf16 or fp32 activations gives the same logits, to the bit, whether a decode step runs as one
C call, its layers as two calls each, or module by module; and what does not fit is refused before the
C code reads it."""
import numpy as np
import pytest
import torch

from pagoda_kernels import cpu as cpu_kernels
from pagoda_kernels.reference import cache_row_width
from services.worker.attention.base import get_attn_backend
from services.worker.models.gguf_weights import GGUFWeight, allocate_part, fill_from_blocks
from services.worker.models.layer_blocks import LayerBlocks
from services.worker.models import linear as linear_module
from services.worker.models.linear import Linear, PackedWeight, drop_plain_weight
from services.worker.models.llama import LlamaForCausalLM
from tests.helpers import PagedBatchPlanner, PagedSequence, new_kv_caches, tiny_llama_config
from tests.test_gguf_weights import _q4_k_blocks

gguf = pytest.importorskip("gguf")

if cpu_kernels.load() is None:
    pytest.skip(f"cpu kernels unavailable: {cpu_kernels.unavailable_reason()}",
                allow_module_level=True)

# bf16: the default loop; f32: fp32 panels.
KINDS = ["bf16", "bf16-dot", "f32", "int8", "w8a8", "Q8_0", "Q4_0", "Q4_1", "Q4_K"]
CONFIG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
K_CONFIG = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2)  # Q4_K: K of 256s


def _to_gguf(module: Linear, qtype_name: str) -> None:
    """Replace a loaded module's dense weight by GGUF blocks of it, as a GGUF load packs them."""
    qtype = gguf.GGMLQuantizationType[qtype_name]
    w = np.ascontiguousarray(module.weight.detach().float().numpy())
    n, k = w.shape
    part = allocate_part(int(qtype), 0, n, k)
    # gguf's Python package cannot quantize to Q4_K: random blocks of the weight's magnitude
    raw = (_q4_k_blocks(w, np.random.default_rng(n + k)) if qtype_name == "Q4_K"
           else gguf.quants.quantize(w, qtype))
    fill_from_blocks(part, 0, raw)
    module.packed = PackedWeight("gguf", part.qs, n, gguf=GGUFWeight(k, [part]))
    drop_plain_weight(module)


def tiny_model(kind: str, dtype: torch.dtype, bias: bool = False,
               num_layers: int = 2) -> LlamaForCausalLM:
    """A random Llama (2 layers unless asked) on the CPU attention backend with its matmuls
    packed as `kind`."""
    shapes = dict(K_CONFIG if kind == "Q4_K" else CONFIG, num_hidden_layers=num_layers)
    c = tiny_llama_config(**shapes, attention_bias=bias, mlp_bias=bias)
    head_dim = c.hidden_size // c.num_attention_heads
    backend = get_attn_backend("cpu", dtype=dtype, num_heads=c.num_attention_heads,
                               num_kv_heads=c.num_key_value_heads, head_dim=head_dim,
                               block_size=16)
    model = LlamaForCausalLM(c, backend, dtype)
    g = torch.Generator().manual_seed(KINDS.index(kind))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(("norm" in name) + 0.1 * torch.randn(p.shape, generator=g))
    if kind.startswith("Q"):
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name != "lm_head":
                _to_gguf(module, kind)
        model.pack_weights("gguf")
    else:
        model.pack_weights(None if kind in ("bf16", "f32") else kind)
    return model


def run_steps(model: LlamaForCausalLM, mode: str, prompts: list[list[int]], steps: int,
              cache_dtype: torch.dtype | None = None):
    """Prefills the prompts together, then `steps` decode steps of them all, the last one beside
    a new prompt's prefill (a mixed step) -> logits per step. mode: "step" (decode steps as one
    call), "blocks" (two calls a layer), "modules". The KV cache in the model's dtype, or in
    `cache_dtype` (an 8-bit format)."""
    c = model.config
    m = model.model
    m.use_blocks, m.use_decode_step = mode != "modules", mode == "step"
    planner = PagedBatchPlanner(64, 16, seed=3)
    head_dim = c.hidden_size // c.num_attention_heads
    cache_dtype = cache_dtype or model.dtype
    shape = (64, 16, c.num_key_value_heads, cache_row_width(cache_dtype, head_dim))
    caches = [(torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype))
              for _ in range(c.num_hidden_layers)]
    seqs = [PagedSequence(list(p)) for p in prompts]
    step = planner.plan_step([(s, len(s.token_ids)) for s in seqs], [])
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    with torch.inference_mode():
        logits = [model.compute_logits(model(step.input_ids, step.positions, caches,
                                             step.meta))[ends]]
        for i in range(steps):
            for seq, token in zip(seqs, logits[-1][-len(seqs):].float().argmax(-1).tolist()):
                seq.token_ids.append(token)
            late = [(PagedSequence([7, 8, 9]), 3)] if i == steps - 1 else []
            step = planner.plan_step(late, seqs)
            logits.append(model.compute_logits(model(step.input_ids, step.positions, caches,
                                                     step.meta)))
    return logits


# bf16 panels hold bf16 weights, for bf16 activations only; "bf16-dot" runs them on the
# vdpbf16ps loop where AMX would run (the same loop as "bf16" on CPUs without AMX; skipped on
# CPUs without AVX512-BF16, where "bf16" runs the AVX2 loop). fp32 panels
# likewise for fp32 only.
CASES = [(kind, dtype) for kind in KINDS for dtype in (torch.float32, torch.bfloat16)
         if not (kind.startswith("bf16") and dtype != torch.bfloat16)
         and not (kind == "f32" and dtype != torch.float32)]


def use_panels(kind: str, request) -> str:
    """Skips where the CPU lacks the panels `kind` names; sets up their path for this test (put
    back after it). Returns the kind tiny_model takes ("bf16-dot" is "bf16" on the dot loop)."""
    if kind.startswith("bf16") and not cpu_kernels.bf16_matmul_available():
        pytest.skip("bf16 panels need a CPU with AVX512-BF16, or AVX2 and FMA")
    if kind == "bf16-dot":
        if "dot" not in cpu_kernels.bf16_matmul_paths():
            pytest.skip("the vdpbf16ps loop needs AVX512-BF16 (the AVX2 loop runs as \"bf16\")")
        cpu_kernels.set_bf16_matmul_path("dot")
        request.addfinalizer(lambda: cpu_kernels.set_bf16_matmul_path("amx"))
        return "bf16"
    if kind == "f32":
        if not cpu_kernels.f32_matmul_available():
            pytest.skip("fp32 panels need a CPU with AVX-512 or AVX2 and FMA")
        before = linear_module._fp32_layout
        linear_module.set_fp32_layout("panels")
        request.addfinalizer(lambda: linear_module.set_fp32_layout(before))
    return kind


@pytest.mark.parametrize("kind,dtype", CASES,
                         ids=[f"{k}-{str(d)[6:]}" for k, d in CASES])
def test_a_decode_step_in_one_call_blocks_and_modules_give_the_same_logits(kind, dtype,
                                                                           monkeypatch, request):
    kind = use_panels(kind, request)
    model = tiny_model(kind, dtype, bias=kind in ("int8", "Q4_0", "f32"))
    assert model.model.use_blocks and model.model.layer_blocks is not None
    if kind in ("bf16", "f32"):
        assert model.model.layers[0].mlp.gate_up_proj.packed.kind == kind
    calls = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers",
                        lambda *a: calls.append(a[1].shape[0]) or decode_layers(*a))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 1)]
    steps = 4
    logits = {mode: run_steps(model, mode, prompts, steps) for mode in ("step", "blocks",
                                                                        "modules")}
    assert calls == [3] * (steps - 1)  # every decode-only step, not the prefills or mixed one
    for mode in ("blocks", "modules"):
        assert all(torch.equal(a, b) for a, b in zip(logits["step"], logits[mode])), mode
    assert not any(t.isnan().any() for t in logits["step"])


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_decode_step_in_one_call_writes_and_reads_an_8_bit_cache_as_the_backend(cache_dtype,
                                                                                   monkeypatch):
    model = tiny_model("Q4_0", torch.bfloat16)
    calls = []
    decode_layers = cpu_kernels.decode_layers
    monkeypatch.setattr(cpu_kernels, "decode_layers",
                        lambda *a: calls.append(a[1].shape[0]) or decode_layers(*a))
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    step, blocks = (run_steps(model, mode, prompts, 3, cache_dtype) for mode in ("step",
                                                                                 "blocks"))
    assert calls == [2, 2]
    assert all(torch.equal(a, b) for a, b in zip(step, blocks))


def test_a_model_with_a_matmul_the_blocks_do_not_take_runs_module_by_module():
    model = tiny_model("int8", torch.float32)
    assert model.model.use_blocks
    layer = model.model.layers[1]
    layer.mlp.down_proj.packed = None  # as a weight left to oneDNN or dense fp32 would be
    assert LayerBlocks.of(layer) is None
    model.model.set_up_blocks()
    assert not model.model.use_blocks and model.model.decode_step is None


def _decode_inputs(model, rows=2):
    c = model.config
    caches = new_kv_caches(c.num_hidden_layers, 8, 16, c.num_key_value_heads, 16, model.dtype)
    x = torch.randn(rows, c.hidden_size)
    return caches, x, dict(positions=torch.arange(rows) + 3, slots=torch.arange(rows) + 3,
                           block_tables=torch.tensor([[1, 2]] * rows),
                           seq_lens=torch.full((rows,), 4))


def test_decode_layers_refuse_what_would_read_outside_the_cache_or_tables():
    model = tiny_model("w8a8", torch.float32)
    caches, x, args = _decode_inputs(model)
    weights = model.model.decode_step._weights_for(caches)
    out = torch.full_like(x, float("nan"))
    cpu_kernels.decode_layers(weights, x.clone(), out=out, **args)
    assert not out.isnan().any()
    bad = {"block_tables": torch.tensor([[1, 8]] * 2), "seq_lens": torch.full((2,), 33),
           "positions": args["positions"].int(), "slots": torch.arange(3)}
    for name, value in bad.items():
        out.fill_(float("nan"))
        with pytest.raises(ValueError, match=f"^decode layers: .*{name.split('_')[0]}"):
            cpu_kernels.decode_layers(weights, x.clone(), out=out, **{**args, name: value})
        assert out.isnan().all(), name
    with pytest.raises(IndexError, match="rotary positions"):
        cpu_kernels.decode_layers(weights, x.clone(), out=out,
                                  **{**args, "positions": torch.tensor([3, 512])})
    with pytest.raises(IndexError, match="kv cache slots"):
        cpu_kernels.decode_layers(weights, x.clone(), out=out,
                                  **{**args, "slots": torch.tensor([3, 128])})


def test_block_weights_and_activations_that_do_not_fit_are_refused():
    model = tiny_model("Q4_1", torch.float32)
    layer, blocks = model.model.layers[0], model.model.layer_blocks[0]
    part = layer.self_attn.qkv_proj.packed.gguf.parts[0]
    entry = (part.qtype, part.row0, part.rows, part.qs, part.d, part.m)
    with pytest.raises(ValueError, match="parts cover 128 rows of 130"):
        cpu_kernels.gguf_block_linear([entry], 130, 64, None, torch.float32)
    with pytest.raises(ValueError, match="gguf block weight: a type 3 weight"):
        cpu_kernels.gguf_block_linear([(*entry[:3], part.qs[:1], *entry[4:])], 128, 64, None,
                                      torch.float32)
    with pytest.raises(ValueError, match="bias must be contiguous torch.float32 \\[128\\]"):
        cpu_kernels.gguf_block_linear([entry], 128, 64, torch.zeros(128).bfloat16(),
                                      torch.float32)
    attn = layer.self_attn
    rows = 3
    x, h = torch.randn(rows, 64), torch.empty(rows, 64)
    qkv = torch.full((rows, 128), float("nan"))
    norm = layer.input_layernorm.weight
    args = dict(qkv_w=blocks.qkv, x=x, residual=None, norm_weight=norm, eps=1e-5,
                positions=torch.arange(rows), cos_sin=attn.rotary.cos_sin, rotary_heads=6,
                head_dim=16, h=h, qkv=qkv)
    for change in ({"x": x.bfloat16()}, {"positions": torch.arange(rows).int()},
                   {"qkv": torch.empty(rows, 127)}, {"head_dim": 32},
                   {"residual": torch.empty(rows + 1, 64)}):
        with pytest.raises(ValueError, match="^attention input: "):
            cpu_kernels.attention_input(**{**args, **change})
        assert qkv.isnan().all()
    with pytest.raises(IndexError, match="rotary positions"):
        cpu_kernels.attention_input(**{**args, "positions": torch.full((rows,), 512)})
    with pytest.raises(ValueError, match="needs the gu scratch"):
        cpu_kernels.attention_output_mlp(blocks.o, blocks.gate_up, blocks.down,
                                         torch.randn(rows, 64), torch.randn(rows, 64),
                                         layer.post_attention_layernorm.weight, 1e-5,
                                         torch.empty(rows, 64), None, torch.empty(rows, 96),
                                         torch.empty(rows, 64))


def test_silu_mul_is_torchs_to_rounding():
    gu = torch.randn(5, 2 * 40) * 4
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gu), F_silu(gate) * up, rtol=1e-6,
                               atol=1e-6)
    bf = gu.bfloat16()
    gate, up = bf.chunk(2, dim=-1)
    assert (cpu_kernels.silu_mul(bf).float() - (F_silu(gate) * up).float()).abs().max() <= \
        0.01 * (F_silu(gate) * up).float().abs().max()


def F_silu(x):
    return torch.nn.functional.silu(x)
