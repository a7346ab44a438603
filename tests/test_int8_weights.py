"""int8 weights (`--quantization int8`, weight-only, and `w8a8`, activations quantized per row
too; services/worker/models/int8.py): the layers against a dequantized reference, then the
default model in each mode against the same model unquantized (the session `llm`, default
dtype): greedy tokens up to near-ties, and perplexity on a text. The kernels' own paths and
shapes: tests/test_int8_kernels.py."""
import pytest
import torch

from pagoda import LLM
from services.worker.models.int8 import int8_rows
from services.worker.models.linear import Linear, SiluAndMulLinear
from tests.helpers import greedy_agreement, greedy_outputs, once_per_model, perplexity

def _layer(cls, k: int, n: int, bias: bool, dtype: torch.dtype,
           quantization: str = "int8") -> Linear:
    torch.manual_seed(k * 1000 + n)
    layer = cls(k, n, bias, dtype)
    # Rows of very different sizes, so that one scale for all would not do.
    layer.weight.copy_(torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None])
    if bias:
        layer.bias.copy_(torch.randn(n))
    layer.pack(quantization=quantization)
    return layer


def _q(layer: Linear) -> torch.Tensor:
    packed = layer.packed
    return int8_rows(packed.data, packed.out_features, layer.weight.shape[1], packed.gate_up)


def _dequantized(layer: Linear) -> torch.Tensor:
    """q * s[:, None] in fp32."""
    return _q(layer).float() * layer.packed.scale.float()[:, None]


def _activations(x: torch.Tensor, quantization: str) -> torch.Tensor:
    """x in fp32 as the matmul sees it: w8a8 rounds each row to int8 steps of its own scale."""
    xf = x.float()
    if quantization == "w8a8":
        s = xf.abs().amax(dim=1, keepdim=True) / 127.0
        xf = torch.round(xf * (1.0 / s)).clamp(-127, 127) * s
    return xf


# The layer's wiring (packing, bias, dtype, the dropped weight) on a padded and a model-sized
# shape, on the vector paths (1 row) and AMX's (64); the kernels' own grid of shapes and rows
# is tests/test_int8_kernels.py's.
@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k,n", [(100, 33), (576, 1536)])
@pytest.mark.parametrize("m", [1, 64])
def test_int8_linear_matches_the_dequantized_weight(m, k, n, dtype, quantization):
    layer = _layer(Linear, k, n, bias=(m != 1), dtype=dtype, quantization=quantization)
    assert layer.packed.kind == quantization and layer.packed.data.dtype == torch.int8
    assert layer.packed.scale.dtype == torch.float32
    assert layer.weight.device.type == "meta"  # the plain weight is dropped
    x = torch.randn(m, k).to(dtype)
    ref = _activations(x, quantization) @ _dequantized(layer).T
    if layer.bias is not None:
        ref += layer.bias.float()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (m, n)
    # bf16: the output's rounding, 2^-8 of its size; fp32 w8a8: a q now and then one step off
    # (x * (1 / s) against torch's rounding); fp32 weight-only: the summation order.
    tol = (8e-3 if dtype == torch.bfloat16 else 1e-3 if quantization == "w8a8" else 1e-5)
    tol *= ref.abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_rows_are_the_weight_to_half_a_step_of_their_own_scale(dtype):
    torch.manual_seed(0)
    weight = (torch.randn(40, 100) * torch.logspace(-3, 1, 40)[:, None]).to(dtype)
    weight[5] = 0  # an all-zero row quantizes to zeros
    layer = Linear(100, 40, False, dtype)
    layer.weight.copy_(weight)
    layer.pack(quantization="int8")
    q, s = _q(layer), layer.packed.scale
    assert (q[5] == 0).all()
    assert (q.abs().amax(dim=1)[torch.arange(40) != 5] >= 126).all()  # each row uses its range
    err = (q.float() * s[:, None] - weight.float()).abs()
    assert (err <= 0.5 * s[:, None] * 1.01).all()
    # Whatever the layout pads with is zeros.
    assert layer.packed.data.abs().sum() == q.abs().sum()


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_int8_gate_up_applies_silu_gate_times_up(m, quantization):
    layer = _layer(SiluAndMulLinear, 64, 2 * 96, bias=False, dtype=torch.bfloat16,
                   quantization=quantization)
    # The kernel's epilogue, where the C kernels run (else SiLU * up after the matmul).
    assert layer.packed.gate_up == (layer.packed.data.dim() == 1)
    x = torch.randn(m, 64).to(torch.bfloat16)
    gate, up = (_activations(x, quantization) @ _dequantized(layer).T).chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = layer(x)
    assert out.shape == (m, 96)
    assert (out.float() - ref).abs().max().item() <= 1.5e-2 * ref.abs().max().item()


# --- the default model ---------------------------------------------------------------------------

MAX_TOKENS = 32
TOP_K = 5
MIN_AGREEING = 10  # of 12 prompts

PROMPTS = [
    "Water boils at",
    "The capital of Japan is",
    "Q: How many legs does a spider have?\nA:",
    "def fibonacci(n):\n",
    "The three primary colours are",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
    "The main difference between a virus and a bacterium is",
    "Here is a list of five fruits:\n1.",
    "The French Revolution began in",
    "Photosynthesis is the process by which",
    "import numpy as np\n\n# Compute the mean of an array\n",
]

TEXT = (
    "The lighthouse stood on a rock a mile from the shore, and for most of the year the keeper "
    "saw nobody but the men who brought his oil and flour once a fortnight. He kept a diary, "
    "which is how we know what his days were like. He rose before dawn to put out the lamp and "
    "trim the wick, then polished the great lens until not a single smear remained on its "
    "glass. In the afternoons he mended nets, painted the iron railings against the salt, and "
    "wrote down the weather every three hours: the wind, the height of the waves, how far he "
    "could see. On clear nights he counted the ships that passed, and on foggy ones he wound "
    "the clockwork of the horn every half hour until morning.\n\n"
    "A good map leaves things out. If it showed every tree, fence and puddle it would be as "
    "large and as confusing as the land itself, so the mapmaker chooses what matters for the "
    "people who will use it. A walker needs paths, streams and the shape of the hills; a driver "
    "needs roads and the towns they join; a sailor needs the depth of the water and the rocks "
    "beneath it. The same valley can therefore be drawn in many honest ways, each of them "
    "correct and none of them complete.\n\n"
    "Bees find their way home using the sun. A worker that has found a field of flowers returns "
    "to the hive and dances on the comb, running in a straight line while shaking her body, then "
    "circling back to run again. The angle of the straight run, measured from the vertical, "
    "tells the other bees the direction of the flowers relative to the sun, and the length of "
    "the run tells them how far away they are. Because the sun moves across the sky, the bees "
    "must adjust the angle as the day goes on, and they do.\n\n"
    "When you borrow money from a bank, you pay interest: a share of the loan for each year "
    "that you keep it. With compound interest, the interest that is not paid is added to the "
    "loan, and next year's interest is charged on the larger sum. Over a few years the "
    "difference is small, but over decades it grows quickly, which is why a debt that seems "
    "modest can double in size if it is left alone for long enough."
)


@pytest.fixture(scope="module", params=["int8", "w8a8"])
def int8_llm(request):
    """The default model in each mode, one at a time."""
    llm = LLM(quantization=request.param, kv_cache_space_gib=0.25, swap_space=0.05)
    yield llm
    del llm


def _mode(llm: LLM) -> str:
    return llm.llm_engine.model_config.quantization


def test_the_int8_model_holds_int8_matmul_weights_and_a_plain_embedding(int8_llm):
    model = int8_llm.llm_engine.executor.worker.model_runner.model
    kind = _mode(int8_llm)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed.kind == kind and m.packed.data.dtype == torch.int8
                           and m.weight.device.type == "meta" for m in linears)
    embed = model.model.embed_tokens.weight
    assert embed.device.type == "cpu" and embed.dtype == model.dtype
    if model.tie_word_embeddings:
        assert model.lm_head_packed.kind == kind


def reference_greedy(llm: LLM):
    """The session model's greedy outputs for PROMPTS, generated once for every module."""
    return once_per_model(llm, ("greedy", MAX_TOKENS, TOP_K),
                          lambda: greedy_outputs(llm, PROMPTS, MAX_TOKENS, TOP_K))


def reference_perplexity(llm: LLM, token_ids: list[int]) -> float:
    return once_per_model(llm, ("perplexity", tuple(token_ids)),
                          lambda: perplexity(llm, token_ids))


def test_int8_greedy_tokens_agree_with_the_unquantized_model(llm, int8_llm):
    out = greedy_outputs(int8_llm, PROMPTS, MAX_TOKENS, TOP_K)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in out)
    agreeing, lines = greedy_agreement(reference_greedy(llm), out, TOP_K,
                                       ("unquantized", _mode(int8_llm)))
    print(f"\n{_mode(int8_llm)} vs unquantized: {agreeing}/{len(PROMPTS)} agree over "
          f"{MAX_TOKENS} tokens, {len(lines)} differ")
    for line in lines:
        print("  ", line)
    assert agreeing >= MIN_AGREEING, "\n".join(lines)


def test_int8_perplexity_is_within_two_percent_of_the_unquantized_model(llm, int8_llm, tokenizer):
    token_ids = tokenizer.encode(TEXT)
    assert len(token_ids) >= 300, len(token_ids)
    ref, q = reference_perplexity(llm, token_ids), perplexity(int8_llm, token_ids)
    print(f"\nperplexity over {len(token_ids)} tokens: unquantized {ref:.4f}, "
          f"{_mode(int8_llm)} {q:.4f} "
          f"({100 * (q / ref - 1):+.2f}%)")
    assert abs(q / ref - 1) <= 0.02
