"""Shared test helpers: a small paged-batch planner, tiny random models, and a model's greedy
tokens and perplexity against a reference model's."""
import math
import random
import weakref
from dataclasses import dataclass, field

import torch

from services.worker.attention.base import AttentionMetadata
from shared.config import LoadConfig, ModelConfig
from shared.model_source import ModelSource


@dataclass
class PagedSequence:
    token_ids: list[int]
    num_computed: int = 0  # tokens whose K/V is in the cache
    block_ids: list[int] = field(default_factory=list)


@dataclass
class StepInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata


class PagedBatchPlanner:
    """Stands in for the scheduler and the model runner's input preparation: hands out cache
    blocks in shuffled order (so a sequence's blocks are never contiguous) and builds the
    AttentionMetadata of a step."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)

    def _ensure_blocks(self, seq: PagedSequence, num_tokens: int) -> None:
        while len(seq.block_ids) * self.block_size < num_tokens:
            seq.block_ids.append(self.free_blocks.pop())

    def plan_step(self, prefills: list[tuple[PagedSequence, int]],
                  decodes: list[PagedSequence]) -> StepInput:
        """`prefills`: (sequence, number of its next tokens to compute); `decodes`: sequences of
        which one next token is computed. Marks the tokens computed."""
        work = list(prefills) + [(seq, 1) for seq in decodes]
        input_ids, positions, slots = [], [], []
        seq_lens, context_lens, query_lens = [], [], []
        for seq, n in work:
            start, end = seq.num_computed, seq.num_computed + n
            assert end <= len(seq.token_ids)
            self._ensure_blocks(seq, end)
            for pos in range(start, end):
                positions.append(pos)
                input_ids.append(seq.token_ids[pos])
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size
                             + pos % self.block_size)
            context_lens.append(start)
            seq_lens.append(end)
            query_lens.append(n)
            seq.num_computed = end
        max_blocks = max(len(seq.block_ids) for seq, _ in work)
        block_tables = [seq.block_ids + [0] * (max_blocks - len(seq.block_ids)) for seq, _ in work]
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        num_prefill_tokens = sum(n for _, n in prefills)
        meta = AttentionMetadata(
            num_prefills=len(prefills), num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=len(decodes),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            context_lens=torch.tensor(context_lens, dtype=torch.int64),
            block_tables=torch.tensor(block_tables, dtype=torch.int64),
            max_query_len=max((n for _, n in prefills), default=1),
            max_seq_len=max(seq_lens), block_size=self.block_size,
            seq_lens_list=seq_lens, query_lens_list=query_lens)
        return StepInput(torch.tensor(input_ids, dtype=torch.int64),
                         torch.tensor(positions, dtype=torch.int64), meta)


def profile_metadata(query_lens: list[int]) -> AttentionMetadata:
    """Metadata of a run without a KV cache: whole prompts only."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    lens = torch.tensor(query_lens, dtype=torch.int64)
    return AttentionMetadata(
        num_prefills=len(query_lens), num_prefill_tokens=sum(query_lens), num_decode_tokens=0,
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int64), seq_lens=lens,
        context_lens=torch.zeros_like(lens), block_tables=torch.zeros(len(lens), 0, dtype=torch.int64),
        max_query_len=max(query_lens), max_seq_len=max(query_lens), block_size=16,
        seq_lens_list=list(query_lens), query_lens_list=list(query_lens))


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig
    values = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=3, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  initializer_range=0.1)
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config
    values = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, vocab_size=256,
                  max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  initializer_range=0.1, rope_theta=1000000.0)
    values.update(overrides)
    return Qwen2Config(**values)


def save_random_model(hf_config, folder, seed: int = 0):
    """A transformers model with random weights, saved as safetensors in `folder`."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def model_config_for(folder, hf_config, dtype=torch.float32) -> ModelConfig:
    return ModelConfig(source=ModelSource(str(folder), None, "tiny"), tokenizer=str(folder),
                       dtype=dtype, seed=0, max_model_len=hf_config.max_position_embeddings,
                       hf_config=hf_config)


def load_config() -> LoadConfig:
    return LoadConfig(load_format="auto")


def new_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            for _ in range(num_layers)]


# --- a model against a reference: greedy tokens up to near-ties, perplexity ----------------------

_remembered: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def once_per_model(llm, key, compute):
    """compute(), remembered for `llm` (held weakly) under `key`: the session's reference
    model's outputs serve several tests and modules, and are the same each time."""
    per_model = _remembered.setdefault(llm, {})
    if key not in per_model:
        per_model[key] = compute()
    return per_model[key]


def greedy_outputs(llm, prompts: list[str], max_tokens: int, top_k: int):
    """Greedy completions of `max_tokens` (end of text ignored) with each step's top-k logprobs."""
    from pagoda import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top_k,
                            ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def greedy_agreement(ref_outputs, outputs, top_k: int, names: tuple[str, str]
                     ) -> tuple[int, list[str]]:
    """How many sequences agree: identical, or first differing at a near-tie (each side's token
    in the other's top-k there); and a line for each that differs."""
    agreeing, lines = 0, []
    for i, (a, b) in enumerate(zip(ref_outputs, outputs)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ta) == len(tb), (len(ta), len(tb))
        pos = first_difference(ta, tb)
        if pos is None:
            agreeing += 1
            continue
        # Each side's logprobs at pos hold its top-k (and its sampled token).
        top_a, top_b = (sorted(lp, key=lp.get, reverse=True)[:top_k]
                        for lp in (a.outputs[0].logprobs[pos], b.outputs[0].logprobs[pos]))
        near_tie = ta[pos] in top_b and tb[pos] in top_a
        agreeing += near_tie
        lines.append(f"prompt {i}, position {pos}: {names[0]} {ta[pos]} top-{top_k} {top_a}, "
                     f"{names[1]} {tb[pos]} top-{top_k} {top_b} "
                     f"({'near-tie' if near_tie else 'DIVERGED'})")
    return agreeing, lines


def perplexity(llm, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of every token after the first."""
    from pagoda import SamplingParams
    out = llm.generate(prompt_token_ids=[token_ids], use_tqdm=False,
                       sampling_params=SamplingParams(prompt_logprobs=1, max_tokens=1))[0]
    nll = [-lp[t] for t, lp in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll))
