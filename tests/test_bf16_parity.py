"""The default model (SmolLM2-135M-Instruct) in bfloat16 against transformers in bfloat16: greedy
tokens on prompts of 3 to 400 tokens, with the compiled CPU kernels on (AMX / AVX-512 where the
CPU has them) and off (the torch ops).

bf16 logits are coarse (0.125 apart near 16), so two candidates can be a rounding apart; the
two sides must agree token for token except at a genuine near-tie: at the first position where
they differ, each side's token is in the other's top-5 there (vLLM's `check_logprobs_close`).
After such a divergence the contexts differ, so the rest of that sequence is not compared.
The near-ties are printed (`-s`): about half the prompts need the allowance, since a few ops
round at other points than transformers' (docs/architecture.md, "Kernels on the CPU")."""
import time

import pytest
import torch

from pagoda import LLM, SamplingParams

MAX_TOKENS = 32
TOP_K = 5
# Of 12 prompts: about half reach a near-tie today (see the docstring); nearly all doing so would
# mean the two sides no longer compute the same thing, only close things.
MAX_NEAR_TIES = 9

SHORT_PROMPTS = [
    "Water boils at",
    "The capital of Japan is",
    "Q: How many legs does a spider have?\nA:",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "My favourite season is autumn, because the leaves turn red and gold and",
]
TEXT = (
    "Tea was first drunk in China, where for centuries it was pressed into bricks, ground and "
    "whisked with hot water. Traders carried those bricks along mountain paths to Tibet and "
    "Mongolia, and by the seventeenth century Dutch ships were bringing loose leaves to Europe. "
    "In England tea was at first a costly medicine sold by apothecaries; within a hundred years "
    "it had become the everyday drink of farm workers and factory hands alike, and the tax on it "
    "was large enough to pay for a good part of the navy.\n\n"
    "A bicycle stays upright mostly because the rider steers it. When it starts to lean to the "
    "left, the rider turns the front wheel a little to the left, which moves the wheels back "
    "under the centre of mass. The shape of the fork helps: the wheel touches the ground behind "
    "the point where the steering axis meets it, so a leaning bicycle turns its own wheel into "
    "the lean. This is why a bicycle pushed along without a rider can travel a surprising "
    "distance before it falls over.\n\n"
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt, "
    "seven grams of dried yeast and about three hundred and fifty millilitres of warm water. "
    "Knead the dough for ten minutes until it is smooth and springs back when pressed. Leave it "
    "covered in a warm place for an hour, until it has doubled in size, then shape it, let it "
    "rise again for half an hour and bake it at two hundred and twenty degrees for thirty "
    "minutes. The loaf is done when it sounds hollow as you tap its base.\n\n"
    "The river rises in the hills above the town, where a dozen small streams run together in a "
    "marshy valley. For the first few miles it is narrow and fast, turning the wheels of the old "
    "mills that once ground corn for the whole county. Below the bridge it widens and slows, and "
    "in summer children swim in the deep pool under the willows while their parents sit on the "
    "bank. Herons stand in the shallows, perfectly still, waiting for a fish to come within "
    "reach of their beaks.\n\n"
    "Most modern computers store numbers in binary. A thirty-two bit floating point number keeps "
    "one bit for the sign, eight for the exponent and twenty-three for the fraction, which gives "
    "about seven decimal digits of precision. The bfloat16 format keeps the same eight exponent "
    "bits but only seven fraction bits, so it covers the same range of magnitudes with much less "
    "precision; neural networks tolerate this well, and it halves the memory their weights take."
)
# Windows of TEXT for the long prompts, starting at different places (so no two share a cached
# prefix) and crossing block (16) and chunk boundaries.
LONG_PROMPTS = [(11, 24), (37, 61), (3, 130), (52, 197), (29, 290), (0, 400), (80, 350)]


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    text = tokenizer.encode(TEXT)
    assert len(text) >= 430, len(text)
    return ([tokenizer.encode(p) for p in SHORT_PROMPTS]
            + [text[start:start + n] for start, n in LONG_PROMPTS])


@pytest.fixture(scope="module")
def expected(reference_bf16, prompts):
    """transformers' greedy tokens and the top-5 at each step, one prompt at a time (padding a
    batch would change its bf16 arithmetic)."""
    out = []
    for p in prompts:
        gen = reference_bf16.model.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
            return_dict_in_generate=True)
        tokens = gen.sequences[0, len(p):].tolist()
        tops = [step[0].float().topk(TOP_K).indices.tolist() for step in gen.logits]
        out.append((tokens, tops))
    return out


def turn_kernels_off(monkeypatch) -> None:
    """PAGODA_CPU_KERNELS=0: `load()` decides once per process, so its decision and the bound
    functions are reset for it to read the variable again."""
    from pagoda_kernels.cpu import bind, build
    monkeypatch.setenv("PAGODA_CPU_KERNELS", "0")
    monkeypatch.setattr(build, "_lib", None)
    monkeypatch.setattr(build, "_failed", None)
    monkeypatch.setattr(bind, "_bound", {})
    assert build.load() is None


@pytest.fixture(scope="module", params=["on", "off"])
def pagoda(request, prompts):
    """(kernels mode, pagoda's outputs, its outputs of the same prompts again, what ran): one
    bf16 LLM per mode, built and run with the kernels in that state; the switch is undone
    afterwards (the outputs are all that is kept). The second run finds each prompt's whole
    blocks in the prefix cache and computes only the rest, which sums attention in another
    order: its tokens are checked against transformers' the same way."""
    from pagoda_kernels import cpu
    kernels = request.param
    with pytest.MonkeyPatch.context() as mp:
        if kernels == "off":
            turn_kernels_off(mp)
        elif not cpu.available_for(torch.zeros(1, dtype=torch.bfloat16)):
            pytest.skip(f"cpu kernels unavailable: {cpu.unavailable_reason()}")
        start = time.perf_counter()
        llm = LLM(dtype="bfloat16", kv_cache_space_gib=0.25, swap_space=0.05)
        runner = llm.llm_engine.executor.worker.model_runner
        packed = runner.model.model.layers[0].self_attn.qkv_proj.packed
        # Both sides stop at the end-of-sequence token, if one is the greedy choice.
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP_K)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        ran = (f"linear {packed.kind if packed else 'F.linear'}, attention "
               f"{runner.attn_backend.name}, {time.perf_counter() - start:.1f}s")
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return kernels, outputs, again, ran


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(kernels, outputs, expected) -> tuple[list[str], list[str]]:
    """(divergences that are not near-ties, near-ties), one line each."""
    errors, near_ties = [], []
    for i, (out, (ref_tokens, ref_tops)) in enumerate(zip(outputs, expected)):
        tokens = out.outputs[0].token_ids
        pos = first_difference(tokens, ref_tokens)
        if pos is None:
            if len(tokens) != len(ref_tokens):
                errors.append(f"kernels {kernels}, prompt {i}: {len(tokens)} tokens, "
                              f"transformers {len(ref_tokens)} (one side stopped early)")
            continue
        # pagoda's logprobs at pos hold its top-5 (and the sampled token).
        lps = out.outputs[0].logprobs[pos]
        top = sorted(lps, key=lps.get, reverse=True)[:TOP_K]
        line = (f"kernels {kernels}, prompt {i} ({len(out.prompt_token_ids)} tokens), position "
                f"{pos}: pagoda {tokens[pos]} top-5 {top}, transformers {ref_tokens[pos]} "
                f"top-5 {ref_tops[pos]}")
        near_tie = tokens[pos] in ref_tops[pos] and ref_tokens[pos] in top
        (near_ties if near_tie else errors).append(line)
    return errors, near_ties


def test_bf16_greedy_tokens_match_transformers_bf16_up_to_near_ties(pagoda, prompts, expected):
    kernels, outputs, _, ran = pagoda
    check_near_ties(kernels, outputs, prompts, expected, ran)


def test_bf16_greedy_tokens_on_prefix_cache_hits_match_transformers_bf16_up_to_near_ties(
        pagoda, prompts, expected):
    kernels, _, again, ran = pagoda
    assert [out.num_cached_tokens for out in again] == [(len(p) - 1) // 16 * 16 for p in prompts]
    check_near_ties(f"{kernels}, prefix cache hits", again, prompts, expected, ran)


def check_near_ties(kernels: str, outputs, prompts, expected, ran: str) -> None:
    errors, near_ties = compare(kernels, outputs, expected)
    print(f"\nbf16, kernels {kernels} ({ran}): {len(prompts)} prompts of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} tokens, {len(near_ties)} near-ties")
    for line in near_ties:
        print("  near-tie:", line)
    assert not errors, "not a near-tie:\n" + "\n".join(errors)
    assert len(near_ties) <= MAX_NEAR_TIES, "near-ties at most prompts:\n" + "\n".join(near_ties)
