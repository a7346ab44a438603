"""What the sampler needs for one step: the rows to sample and their parameters as device tensors.

The ModelRunner builds one `SamplingRow` per row of logits that samples in this step, then
`SamplingArrays.from_rows` turns them into a few [num_rows] arrays once per step, which cross to
the device with the step's inputs (or `SamplingTensors.from_rows` in one go). Work a batch
does not need is left out here (no penalty tensors when no row uses penalties, no top-k tensor when
no sampled row limits top-k, ...) so the sampler can skip it by testing for `None`.
"""
import math
from dataclasses import dataclass

import numpy as np
import torch

from shared.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1  # seeds are folded into a non-negative int64


@dataclass
class SamplingRow:
    """One row to sample, built by the ModelRunner on the host."""
    params: SamplingParams
    seed: int  # the request's seed: SamplingParams.seed, or one the engine drew for it
    sample_index: int  # which of the request's n samples this row is
    output_index: int  # tokens this sequence generated before this sample
    prompt_token_ids: list[int]  # read only when params use penalties
    output_token_ids: list[int]  # idem


@dataclass
class PenaltyTensors:
    prompt_mask: torch.Tensor  # [N, V] bool, token occurs in the prompt
    output_counts: torch.Tensor  # [N, V] float32, occurrences in the output so far
    repetition: torch.Tensor  # [N] float32, 1.0 = off
    presence: torch.Tensor  # [N] float32, 0.0 = off
    frequency: torch.Tensor  # [N] float32, 0.0 = off


@dataclass
class SamplingTensors:
    """Per-step device tensors. Values on rows a filter does not apply to are neutral."""
    vocab_size: int  # width of the logits these tensors are for
    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows (unused there)
    is_greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    all_random: bool
    # Filters, None when no sampled row uses them.
    top_k: torch.Tensor | None  # [N] int64, vocab_size = no limit
    max_top_k: int  # largest limited k in the batch (0 when top_k is None)
    top_p: torch.Tensor | None  # [N] float32, +inf = no limit (so rounding never cuts a token)
    min_p: torch.Tensor | None  # [N] float32, 0.0 = off
    penalties: PenaltyTensors | None
    # What each row's random numbers derive from.
    seeds: torch.Tensor  # [N] int64, request seed folded to 63 bits
    sample_indices: torch.Tensor  # [N] int64
    output_indices: torch.Tensor  # [N] int64
    max_num_logprobs: int  # top alternatives to return per row (0: none asked)

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int,
                  device: torch.device | str) -> "SamplingTensors":
        arrays = SamplingArrays.from_rows(rows, vocab_size)
        return arrays.to_tensors({name: torch.from_numpy(a).to(device, non_blocking=True)
                                  for name, a in arrays.arrays.items()}, device)


@dataclass
class SamplingArrays:
    """SamplingTensors' per-row values on the host, as numpy arrays that can cross to the
    device with the step's other inputs (services/worker/staging.py); the penalties' tensors
    are made on the device from their rows (`to_tensors`)."""
    vocab_size: int
    arrays: dict[str, np.ndarray]  # SamplingTensors' field name -> [N] values
    all_greedy: bool
    all_random: bool
    max_top_k: int
    max_num_logprobs: int
    rows: list[SamplingRow]
    penalised: bool  # some row uses penalties: their tensors are made in `to_tensors`

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int) -> "SamplingArrays":
        assert rows, "a step samples at least one row"
        temperature, is_greedy, top_k, top_p, min_p = [], [], [], [], []
        seeds, sample_indices, output_indices = [], [], []
        max_num_logprobs = 0
        use_top_k = use_top_p = use_min_p = penalised = False
        for row in rows:
            p = row.params
            greedy = p.is_greedy
            is_greedy.append(greedy)
            temperature.append(1.0 if greedy else p.temperature)
            # Filters never change an argmax, so greedy rows skip them.
            k = p.top_k if (not greedy and 0 < p.top_k < vocab_size) else vocab_size
            top_k.append(k)
            use_top_k |= k < vocab_size
            tp = p.top_p if (not greedy and p.top_p < 1.0) else math.inf
            top_p.append(tp)
            use_top_p |= tp < 1.0
            mp = p.min_p if not greedy else 0.0
            min_p.append(mp)
            use_min_p |= mp > 0.0
            penalised |= p.uses_penalties
            seeds.append(row.seed & _SEED_MASK)
            sample_indices.append(row.sample_index)
            output_indices.append(row.output_index)
            if p.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs, p.logprobs)
        arrays = {"temperature": np.asarray(temperature, dtype=np.float32),
                  "is_greedy": np.asarray(is_greedy, dtype=np.bool_),
                  "seeds": np.asarray(seeds, dtype=np.int64),
                  "sample_indices": np.asarray(sample_indices, dtype=np.int64),
                  "output_indices": np.asarray(output_indices, dtype=np.int64)}
        if use_top_k:
            arrays["top_k"] = np.asarray(top_k, dtype=np.int64)
        if use_top_p:
            arrays["top_p"] = np.asarray(top_p, dtype=np.float32)
        if use_min_p:
            arrays["min_p"] = np.asarray(min_p, dtype=np.float32)
        num_greedy = sum(is_greedy)
        return cls(vocab_size=vocab_size, arrays=arrays, all_greedy=num_greedy == len(rows),
                   all_random=num_greedy == 0,
                   max_top_k=max(k for k in top_k if k < vocab_size) if use_top_k else 0,
                   max_num_logprobs=min(max_num_logprobs, vocab_size), rows=rows,
                   penalised=penalised)

    def to_tensors(self, tensors: dict[str, torch.Tensor], device) -> SamplingTensors:
        """`tensors`: `arrays` on the device, by the same names."""
        return SamplingTensors(
            vocab_size=self.vocab_size,
            temperature=tensors["temperature"],
            is_greedy=tensors["is_greedy"],
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            top_k=tensors.get("top_k"),
            max_top_k=self.max_top_k,
            top_p=tensors.get("top_p"),
            min_p=tensors.get("min_p"),
            penalties=(_penalty_tensors(self.rows, self.vocab_size, device) if self.penalised
                       else None),
            seeds=tensors["seeds"],
            sample_indices=tensors["sample_indices"],
            output_indices=tensors["output_indices"],
            max_num_logprobs=self.max_num_logprobs,
        )


def _to_device(values: list, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _penalty_tensors(rows: list[SamplingRow], vocab_size: int, device) -> PenaltyTensors:
    # Flatten every penalised row's tokens into (row, token) pairs and scatter them in one go;
    # rows without penalties contribute nothing.
    prompt_rows, prompt_tokens, output_rows, output_tokens = [], [], [], []
    repetition, presence, frequency = [], [], []
    for i, row in enumerate(rows):
        p = row.params
        repetition.append(p.repetition_penalty)
        presence.append(p.presence_penalty)
        frequency.append(p.frequency_penalty)
        if not p.uses_penalties:
            continue
        if p.repetition_penalty != 1.0:  # only the repetition penalty looks at the prompt
            prompt_rows += [i] * len(row.prompt_token_ids)
            prompt_tokens += row.prompt_token_ids
        output_rows += [i] * len(row.output_token_ids)
        output_tokens += row.output_token_ids

    # Only the (row, token) pairs cross to the device; the [N, V] tensors are filled there.
    num_rows = len(rows)
    prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    prompt_index = (_to_device(prompt_rows, torch.int64, device),
                    _to_device(prompt_tokens, torch.int64, device))
    prompt_mask[prompt_index] = True
    output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=device)
    output_index = (_to_device(output_rows, torch.int64, device),
                    _to_device(output_tokens, torch.int64, device))
    output_counts.index_put_(output_index, torch.ones(len(output_tokens), device=device),
                             accumulate=True)
    return PenaltyTensors(
        prompt_mask=prompt_mask,
        output_counts=output_counts,
        repetition=_to_device(repetition, torch.float32, device),
        presence=_to_device(presence, torch.float32, device),
        frequency=_to_device(frequency, torch.float32, device),
    )
