"""What a step samples, in the worker: the rows that sample and their parameters, planned
before the forward pass (so that the parameters cross to the device with the step's inputs);
the draw on the step's logits, after the logit edits a request asks for (allowed ids, bias, a
grammar's mask) and the early-stop mask; and the samples read back into the sequences and the
SamplerOutput. Between the draw and the read-back each sampled sequence holds a PLACEHOLDER
whose value is still on the device (ModelRunner.launch / finish)."""
from dataclasses import dataclass, field

import torch

from proto.messages import PLACEHOLDER, SamplerOutput
from services.worker.grammar import feed, new_matcher
from services.worker.logit_edits import (allows_other_than, apply_allowed_token_ids,
                                          apply_logit_bias)
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import SamplingArrays, SamplingRow, SamplingTensors


class StepSampler:
    def __init__(self, model_config, device: torch.device, seqs: dict, fan_out: dict):
        """`seqs`, `fan_out`: the runner's sequences and pending fan-out samples (shared)."""
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self.device = device
        self.seqs = seqs
        self.fan_out = fan_out
        self.sampler = Sampler()
        # Structured output, set up when the first request that asks for it arrives.
        self.grammar_compiler = None  # GrammarCompilerPool
        self.grammar_masker = None  # GrammarMasker

    def prepare_request(self, req) -> None:
        """Note what the request does to its logits; start compiling its grammar, if any."""
        p = req.params
        req.edits_logits = bool(p.structured_outputs or p.logit_bias or p.allowed_token_ids)
        if p.structured_outputs is not None:
            if self.grammar_compiler is None:
                from services.worker.grammar import GrammarMasker
                from services.worker.grammar_compiler import GrammarCompilerPool
                self.grammar_compiler = GrammarCompilerPool(self.model_config)
                self.grammar_masker = GrammarMasker(self.model_config.vocab_size, self.device)
            req.grammar = self.grammar_compiler.submit(p.structured_outputs)

    def _edit_logits(self, logits: torch.Tensor, edited: list[int], owners: list
                     ) -> list[int]:
        """allowed_token_ids, logit_bias and the grammar's mask, in place on the rows listed in
        `edited`; returns the rows under a grammar."""
        allowed, biased, constrained = [], [], []
        for i in edited:
            req = owners[i].state.request
            if req.params.allowed_token_ids:
                allowed.append(i)
            if req.params.logit_bias:
                biased.append(i)
            if req.grammar is not None:
                constrained.append(i)
        if allowed:
            apply_allowed_token_ids(logits, allowed, [owners[i].state.request.params
                                                      for i in allowed])
        if biased:
            apply_logit_bias(logits, biased, [owners[i].state.request.params for i in biased])
        if constrained:
            for i in constrained:
                state = owners[i].state
                if state.matcher is None:
                    state.matcher = new_matcher(state.request.grammar,
                                                state.request.stop_token_ids)
                feed(state.matcher, state.token_ids[state.request.prompt_len:])
            self.grammar_masker.mask(logits, constrained,
                                     [owners[i].state.matcher for i in constrained],
                                     [owners[i].state.request.stop_token_ids for i in constrained])
        return constrained

    @staticmethod
    def _mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow], owners: list
                          ) -> None:
        """Before min_tokens, EOS and stop token ids cannot be sampled, except on a row whose
        edits (a grammar that has ended, allowed_token_ids) leave nothing else: masking them
        there would leave no token at all, and a token outside the grammar would be drawn."""
        mask_rows, mask_ids = [], []
        for i, (r, owner) in enumerate(zip(rows, owners)):
            if r.output_index < r.params.min_tokens:
                ids = set(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    ids.update(owner.state.request.eos_token_ids)
                narrowed = (owner.state.request.grammar is not None
                            or r.params.allowed_token_ids)  # a bias alone leaves every token
                if narrowed and ids and not allows_other_than(logits[i], ids):
                    continue
                mask_rows.extend([i] * len(ids))
                mask_ids.extend(ids)
        if mask_rows:
            logits[mask_rows, mask_ids] = float("-inf")

    def plan(self, rows: list, samples: bool) -> "Draw":
        """What the step samples, before its forward pass: one sampling row per row (n at an
        n > 1 prompt step) and, where this rank samples, their parameters as arrays that cross
        to the device with the step's inputs."""
        sampling_rows, owners, logit_index = [], [], []
        draw = Draw(owners)
        for i, row in enumerate(rows):
            req = row.state.request
            params = req.params
            num_out = len(row.state.token_ids) - req.prompt_len
            # The prompt step of an n > 1 request samples all n children from one distribution.
            fan_out = params.n if (row.group.is_prompt and num_out == 0 and params.n > 1) else 1
            penalties = params.uses_penalties
            for j in range(fan_out):
                if req.edits_logits:
                    draw.edited.append(len(sampling_rows))
                sampling_rows.append(SamplingRow(
                    params=params, seed=req.seed,
                    sample_index=row.state.sample_index + j, output_index=num_out,
                    prompt_token_ids=row.state.token_ids[:req.prompt_len] if penalties else [],
                    output_token_ids=row.state.token_ids[req.prompt_len:] if penalties else []))
                owners.append(row)
                logit_index.append(i)
        draw.sampling_rows = sampling_rows
        draw.logit_index = logit_index if len(logit_index) != len(rows) else None
        if samples:
            draw.arrays = SamplingArrays.from_rows(sampling_rows, self.vocab_size)
        return draw

    def draw(self, draw: "Draw", logits: torch.Tensor | None,
              staged: dict[str, torch.Tensor]) -> None:
        """Samples the planned rows and starts reading them back; each sequence's next token is
        a PLACEHOLDER meanwhile. logits: [rows, vocab], the model's dtype; None on a
        tensor-parallel follower, which receives the leader's samples. `staged`: the plan's
        arrays on the device."""
        owners = draw.owners
        if logits is not None:
            if draw.logit_index is not None:
                logits = logits[draw.logit_index]
            if draw.edited:
                draw.constrained = self._edit_logits(logits, draw.edited, owners)
            self._mask_early_stops(logits, draw.sampling_rows, owners)
            if draw.arrays.vocab_size == logits.shape[-1]:
                tensors = draw.arrays.to_tensors(staged, logits.device)
            else:  # a head wider than the vocabulary: the tensors for its width
                tensors = SamplingTensors.from_rows(draw.sampling_rows, logits.shape[-1],
                                                    logits.device)
            result = self.sampler(logits, tensors)
            draw.token_ids = result.token_ids
            draw.host, draw.ready = start_to_host(result)
        seen = set()
        for i, row in enumerate(owners):
            if row.seq.seq_id in seen:
                continue  # a fan-out's extra samples wait for the children (`_record`)
            seen.add(row.seq.seq_id)
            state = row.state
            draw.positions.append(len(state.token_ids))
            if draw.token_ids is not None:
                state.pending_tokens[len(state.token_ids)] = (draw.token_ids, i)
            state.token_ids.append(PLACEHOLDER)

    def record(self, draw: "Draw", out: SamplerOutput, group) -> None:
        """Reads the samples back (waiting for the device) into `out` and their sequences'
        tokens. `group`: the tensor-parallel group, or None; its leader sends the samples,
        the others receive them."""
        owners = draw.owners
        if draw.host is None:  # the leader samples; every rank keeps what it sampled
            token_ids = group.broadcast_ints(None, len(owners))
            logprobs = top_ids = top_lps = None
        else:
            token_ids, logprobs, top_ids, top_lps = finish_to_host(draw.host, draw.ready)
            if group is not None:
                group.broadcast_ints(token_ids, len(owners))
        self._keep_samples(owners, token_ids, draw.positions)
        if logprobs is None:
            return
        for i, row in enumerate(owners):
            seq_id = row.seq.seq_id
            out.seq_ids.append(seq_id)
            out.token_ids.append(token_ids[i])
            out.logprobs.append(logprobs[i])
            k = row.state.request.params.logprobs
            if k is not None and top_ids is not None:
                out.top_token_ids.append(top_ids[i][:k])
                out.top_logprobs.append(top_lps[i][:k])
            else:
                out.top_token_ids.append([])
                out.top_logprobs.append([])
        if draw.constrained:
            self.grammar_masker.advance([owners[i].state.matcher for i in draw.constrained],
                                        [token_ids[i] for i in draw.constrained])

    def _keep_samples(self, owners: list, token_ids: list[int], positions: list[int]
                      ) -> None:
        """Put each sequence's sample where its PLACEHOLDER is (`positions`, one per sequence
        in order), so the next step needs no round trip through the engine; the extra fan-out
        samples wait for the children the engine forks."""
        seen = {}
        for row, token_id in zip(owners, token_ids):
            seq_id = row.seq.seq_id
            state = row.state
            if seq_id not in seen:
                position = positions[len(seen)]
                seen[seq_id] = token_id
                state.token_ids[position] = token_id
                state.pending_tokens.pop(position, None)
            elif self.seqs.get(seq_id) is state:  # (not for a parent dropped meanwhile)
                self.fan_out.setdefault(seq_id, [seen[seq_id]]).append(token_id)



@dataclass
class Draw:
    """A step's samples from `plan` to `record`."""
    owners: list  # one per sample, in order
    sampling_rows: list[SamplingRow] = field(default_factory=list)  # one per sample
    logit_index: list[int] | None = None  # each sample's row of logits (None: one per row)
    edited: list[int] = field(default_factory=list)  # samples whose request edits its logits
    arrays: SamplingArrays | None = None  # the samples' parameters (where this rank samples)
    positions: list[int] = field(default_factory=list)  # each sequence's PLACEHOLDER, in order
    token_ids: torch.Tensor | None = None  # [samples], on the device
    host: tuple | None = None  # the sampler's tensors on their way to the host
    ready: object = None  # torch.cuda.Event recorded after the copies (CUDA only)
    constrained: list[int] = field(default_factory=list)  # samples under a grammar


def start_to_host(result) -> tuple[tuple, object]:
    """Starts reading the sampler's token ids, logprobs and top alternatives (None where not
    asked) back to the host. On CUDA they cross into page-locked host memory in non-blocking
    copies behind one event (a `.tolist()` per tensor would be a blocking copy each); on the
    CPU they are there already. -> (host tensors, the event or None)."""
    tensors = (result.token_ids, result.logprobs, result.top_token_ids, result.top_logprobs)
    if result.token_ids.device.type != "cuda":
        return tensors, None
    tensors = tuple(None if t is None else
                    torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                        t, non_blocking=True) for t in tensors)
    ready = torch.cuda.Event()
    ready.record()
    return tensors, ready


def finish_to_host(tensors: tuple, ready) -> tuple[list, list, list | None, list | None]:
    """`start_to_host`'s tensors as lists, once the event says they have arrived: the one
    wait on the device in a step."""
    if ready is not None:
        ready.synchronize()
    return tuple(None if t is None else t.tolist() for t in tensors)
