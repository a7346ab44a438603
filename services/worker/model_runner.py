"""ModelRunner: turns one ExecuteModelRequest into batched tensors, runs the model, samples.

It keeps each sequence's tokens and block table between steps (`SequenceState`), so the engine
sends only what changed (proto.SequenceData) and the runner appends the tokens it samples itself.
On a tensor-parallel group every rank runs the same steps on its part of the model; the leader
alone gets the logits, samples, and broadcasts the sampled tokens, which every rank keeps.
"""
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from proto.messages import (PLACEHOLDER, ExecuteModelRequest, PromptLogprobs, SamplerOutput,
                            SequenceData, SequenceGroupMetadata)
from shared.config import PagodaConfig
from shared.sampling_params import SamplingParams
from services.worker.attention import get_attn_backend
from services.worker.grammar import SequenceMatcher
from services.worker.model_loader import load_model
from services.worker.models.plain_rows import plain_step_rows
from services.worker.profile_pass import profile_forward
from services.worker.spec_decode import SpecDecoder
from shared.tensor_parallel import TensorParallelShard, shard_for
from services.worker.sampler import compute_prompt_logprobs
from services.worker.staging import StagingBuffer
from services.worker.step_inputs import prepare_inputs
from services.worker.step_sampler import Draw, StepSampler


@dataclass
class RequestState:
    request_id: str
    params: SamplingParams
    seed: int
    prompt_len: int
    eos_token_ids: list[int]
    grammar: Future | None = None  # the compiled structured-output grammar, once compiled
    # Anything to do to this request's logits before sampling (grammar, bias, allowed ids).
    edits_logits: bool = False

    @property
    def stop_token_ids(self) -> list[int]:
        """What may follow a finished grammar: every id that ends the request."""
        return sorted(set(self.eos_token_ids) | set(self.params.stop_token_ids))


@dataclass
class SequenceState:
    request: RequestState
    sample_index: int
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # Where the output is in the request's grammar; rebuilt from the output tokens when None.
    matcher: SequenceMatcher | None = None
    num_draft_computed: int = 0  # leading tokens with KV in the draft model's cache
    # Samples of launched, unfinished steps, by position in token_ids (PLACEHOLDER there):
    # (the step's sampled-token tensor on the device, this sequence's row in it).
    pending_tokens: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)


@dataclass
class _Row:
    """One sequence's slice of the step's flat token layout."""
    group: SequenceGroupMetadata
    seq: SequenceData
    state: SequenceState
    start: int  # first position computed this step (== tokens already cached)
    num_tokens: int
    # Speculative decoding: the tokens proposed after the decode's token, verified in this
    # step (its num_tokens counts them); None for a row that does not speculate.
    proposals: list[int] | None = None


class ModelRunner:
    def __init__(self, config: PagodaConfig, shard: TensorParallelShard | None = None):
        self.config = config
        self.model_config = config.model_config
        self.device = config.device_config.device
        self.block_size = config.cache_config.block_size
        mc = self.model_config
        self.shard = shard or shard_for(mc.hf_config)
        # The tensor-parallel group, set by the worker once it has joined it (None: one rank).
        self.group = None
        self.attn_backend = get_attn_backend(
            config.device_config.attention_backend, dtype=mc.dtype, device=self.device,
            num_heads=self.shard.num_heads, num_kv_heads=self.shard.num_kv_heads,
            head_dim=mc.head_dim, block_size=self.block_size)
        self.model = None
        # On a GPU the step's integer inputs cross in one pinned, non-blocking copy.
        self.staging = StagingBuffer(self.device) if self.device.type == "cuda" else None
        # Decode steps replayed as CUDA graphs, once the worker has captured them
        # (services/worker/cuda_graphs.py); None: every step runs the model eagerly.
        self.decode_graphs = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.requests: dict[str, RequestState] = {}
        self.seqs: dict[int, SequenceState] = {}
        # Prompt-step samples of n > 1 requests, by parent seq id, until the children arrive.
        self.fan_out: dict[int, list[int]] = {}
        # What a step samples, the draw, and the samples read back (step_sampler.py).
        self.step_sampler = StepSampler(self.model_config, self.device, self.seqs, self.fan_out)
        # Speculative decoding (services/worker/spec_decode.py); None: off.
        self.spec = SpecDecoder(config) if config.speculative_config is not None else None

    @property
    def draft(self):
        """The speculative draft model's DraftProposer, if there is one."""
        return None if self.spec is None else self.spec.draft

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.config.load_config, self.device,
                                self.attn_backend, self.shard, self.group)
        if self.spec is not None:
            self.spec.load_draft()

    @property
    def samples(self) -> bool:
        """Whether this rank samples: the only one, or a tensor-parallel group's leader."""
        return self.group is None or self.group.is_leader

    # -- state updates -------------------------------------------------------------------------
    def apply_deltas(self, request: ExecuteModelRequest) -> None:
        for group in request.seq_group_metadata_list:
            req = self.requests.get(group.request_id)
            if group.sampling_params is not None:
                req = RequestState(group.request_id, group.sampling_params, group.seed,
                                   group.prompt_len, group.eos_token_ids)
                if self.samples:
                    self.step_sampler.prepare_request(req)
                self.requests[group.request_id] = req
            assert req is not None, f"request {group.request_id} was never sent with its parameters"
            for sd in group.seq_data:
                old = self.seqs.get(sd.seq_id)
                if sd.parent_seq_id >= 0:
                    # A forked child: the parent's prompt, then the fan-out sample that is its own.
                    parent = self.seqs[sd.parent_seq_id]
                    first = self.fan_out[sd.parent_seq_id][sd.sample_index]
                    state = SequenceState(req, sd.sample_index,
                                          parent.token_ids[:req.prompt_len] + [first])
                elif sd.reset or old is None:
                    state = SequenceState(req, sd.sample_index)
                else:
                    state = old
                self.seqs[sd.seq_id] = state
                if sd.reset and PLACEHOLDER in sd.new_token_ids:
                    # The engine had not read some samples yet when it sent this; we have them.
                    assert old is not None, f"seq {sd.seq_id}: placeholders with no state to fill"
                    sd.new_token_ids = [old.token_ids[i] if t == PLACEHOLDER else t
                                        for i, t in enumerate(sd.new_token_ids)]
                state.token_ids.extend(sd.new_token_ids)
                state.block_table.extend(sd.block_ids)
        # Last: a forked child above may still have needed its finished parent's prompt.
        for seq_id in request.finished_seq_ids:
            state = self.seqs.pop(seq_id, None)
            self.fan_out.pop(seq_id, None)
            if (state is not None and self.requests.get(state.request.request_id) is state.request
                    and not any(s.request is state.request for s in self.seqs.values())):
                # (A later request may reuse the id: its state is not this one's to drop.)
                del self.requests[state.request.request_id]

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, request: ExecuteModelRequest) -> SamplerOutput:
        return self.finish(self.launch(request))

    def can_launch_ahead(self, request: ExecuteModelRequest) -> bool:
        """Whether `request` may be launched while earlier steps are unfinished (their samples
        still on the device). It may when all it needs of those samples is their value as a
        decode's input, which is gathered on the device (step_inputs.py); not when the host
        needs them: penalties or logit edits (a grammar) over a sequence whose sample is
        pending, a sequence re-sent from its tokens or forked from a parent's samples,
        speculation, or a tensor-parallel group (whose ranks receive the samples from the
        leader)."""
        if self.group is not None or self.spec is not None:
            return False
        for group in request.seq_group_metadata_list:
            for sd in group.seq_data:
                if sd.reset or sd.parent_seq_id >= 0:
                    return False
                state = self.seqs.get(sd.seq_id)
                if state is not None and state.pending_tokens and (
                        state.request.edits_logits or state.request.params.uses_penalties):
                    return False
        return True

    @torch.inference_mode()
    def launch(self, request: ExecuteModelRequest) -> "LaunchedStep":
        """Runs the step's forward pass and draws its samples, leaving them on the device (a
        GPU computes on after this returns): each sampled sequence holds a PLACEHOLDER that the
        next step's inputs gather from the device, until `finish` reads the values back. A
        step launched before the previous one is finished must pass `can_launch_ahead`."""
        t0 = time.perf_counter()
        step = LaunchedStep(SamplerOutput(step_id=request.step_id))
        try:
            self._launch(request, step)
        finally:
            step.out.model_time_s += time.perf_counter() - t0
        return step

    def _launch(self, request: ExecuteModelRequest, step: "LaunchedStep") -> None:
        self.apply_deltas(request)
        rows = self._plan_rows(request.seq_group_metadata_list)
        if not rows:
            return
        sample_rows = [row for row in rows if row.group.do_sample and not row.proposals]
        draw = self.step_sampler.plan(sample_rows, self.samples) if sample_rows else None
        heads = _plan_logit_rows(rows)
        extra = dict(draw.arrays.arrays) if draw is not None and draw.arrays is not None else {}
        num_tokens = sum(row.num_tokens for row in rows)
        # The last layer for the logit rows alone (LlamaModel.forward's keep_rows): a step
        # with prompt chunks, and nothing else wanted from its hidden states.
        keep_rows = (heads.logit_rows and not heads.prompt_lp_rows
                     and len(heads.logit_rows) < num_tokens and self.model.model.can_keep_rows)
        if keep_rows:  # staged with the step's other arrays: one copy to a GPU
            extra[_KEEP_ROWS] = np.asarray(heads.logit_rows, dtype=np.int64)
        input_ids, positions, meta, staged = prepare_inputs(rows, self.block_size, self.staging,
                                                            extra or None)
        keep = staged.pop(_KEEP_ROWS, None)
        forward = (self.model if self.decode_graphs is None or keep is not None
                   else self.decode_graphs)
        # Quantized matmuls pick their path by rows: with proposals, the path of the step
        # without them (services/worker/models/plain_rows.py).
        num_proposed = sum(len(row.proposals or ()) for row in rows)
        with plain_step_rows(num_tokens - num_proposed if num_proposed else None):
            if keep is None:
                hidden = forward(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
            else:
                hidden = forward(input_ids, positions, self.kv_caches, meta, keep)  # [rows]

        sample_idx, spec_rows = heads.sample_idx, heads.spec_rows
        logits = None  # [sampled rows, then every position of the verifying rows, vocab]
        if heads.logit_rows:
            # One head call, as in a plain step, whose path it takes.
            with plain_step_rows(len(sample_rows) + len(spec_rows) if spec_rows else None):
                logits = self.model.compute_logits(hidden if keep is not None
                                                   else hidden[heads.logit_rows])
        num_sampled = len(sample_idx)
        if draw is not None:
            self.step_sampler.draw(draw, None if logits is None else logits[:num_sampled],
                                   staged)
            step.draw = draw
        if request.num_lookahead_slots or spec_rows:
            # A speculative step is read back at once: its entries follow the sampled ones.
            self._record(step)
        if request.num_lookahead_slots:
            out = step.out
            # Entries of the rows that did not speculate: nothing after their token.
            out.extra_token_ids = [[] for _ in out.seq_ids]
            out.extra_logprobs = [[] for _ in out.seq_ids]
            out.num_proposed = [0] * len(out.seq_ids)
        if spec_rows:
            self.spec.verify(logits[num_sampled:], spec_rows, step.out)
        if request.num_lookahead_slots:
            self.spec.drop_lookahead_blocks(rows)
        for row, start in heads.prompt_lp_rows:
            self._prompt_logprobs(row, hidden[start:start + row.num_tokens], step.out)

    @torch.inference_mode()
    def finish(self, step: "LaunchedStep") -> SamplerOutput:
        """The launched step's output, once its samples are back on the host (waits for them);
        every sequence it sampled then holds its token instead of the PLACEHOLDER."""
        t0 = time.perf_counter()
        self._record(step)
        step.out.model_time_s += time.perf_counter() - t0
        return step.out

    def _plan_rows(self, groups: list[SequenceGroupMetadata]) -> list[_Row]:
        prefills, verifies, decodes, candidates = [], [], [], []
        for group in groups:
            for sd in group.seq_data:
                state = self.seqs[sd.seq_id]
                row = _Row(group, sd, state, sd.num_computed_tokens, group.token_chunk_size)
                assert row.start + row.num_tokens <= len(state.token_ids), (
                    f"seq {sd.seq_id}: computing up to {row.start + row.num_tokens} "
                    f"but the worker holds {len(state.token_ids)} tokens")
                if group.num_lookahead_slots and self.spec is not None:
                    candidates.append(row)
                else:
                    (decodes if row.num_tokens == 1 else prefills).append(row)
        if self.spec is not None:
            for row in self.spec.propose(candidates):
                # Several tokens against the cache, as a prefill chunk: after the prefills.
                (verifies if row.proposals else decodes).append(row)
        return prefills + verifies + decodes

    def _record(self, step: "LaunchedStep") -> None:
        """Reads the step's samples back (once) into its output and its sequences' tokens."""
        draw, step.draw = step.draw, None
        if draw is not None:
            self.step_sampler.record(draw, step.out, self.group)

    def _prompt_logprobs(self, row: _Row, hidden: torch.Tensor, out: SamplerOutput) -> None:
        # Position p's logits predict token p + 1: this chunk scores tokens [start+1, end+1)
        # that lie inside the prompt.
        prompt_len = row.state.request.prompt_len
        end = min(row.start + row.num_tokens, prompt_len - 1)
        n = end - row.start
        if n <= 0:
            return
        logits = self.model.compute_logits(hidden[:n])
        if logits is None:  # a tensor-parallel follower: the leader reports them
            return
        targets = torch.tensor(row.state.token_ids[row.start + 1:end + 1], device=logits.device)
        lps, top_ids, top_lps = compute_prompt_logprobs(
            logits, targets, row.state.request.params.prompt_logprobs)
        out.prompt_logprobs.append(PromptLogprobs(
            seq_id=row.seq.seq_id, start=row.start + 1, token_logprobs=lps.tolist(),
            top_token_ids=top_ids.tolist(), top_logprobs=top_lps.tolist()))

    # -- profiling -----------------------------------------------------------------------------
    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_sampled_rows: int = 1) -> None:
        """One forward pass as large as a step can be, with no KV cache, to measure peak memory:
        `num_tokens` prompt tokens, logits for `num_sampled_rows` of them (a step samples at
        most one row per sequence) and the sampler's float temporaries over those rows; with a
        draft model, the draft's largest pass before it (SpecDecoder.profile_draft)."""
        # The draft's pass first (a step runs it before the target's); what it keeps for
        # verification is held while the target's runs.
        held = self.spec.profile_draft(num_tokens, num_sampled_rows) if self.spec else None
        logits = profile_forward(self.model, num_tokens, num_sampled_rows, self.device,
                                 self.block_size)
        if logits is None:  # a tensor-parallel follower: the leader samples
            return
        # What the sampler's general path allocates beside the logits: a float copy, its
        # normaliser and the top candidates it sorts instead of the whole vocabulary.
        floats = logits.float()
        floats.log_softmax(-1).topk(min(1024, floats.shape[-1]), dim=-1)
        del held


@dataclass
class LaunchedStep:
    """A step whose forward pass and draw are launched (ModelRunner.launch), until `finish`."""
    out: SamplerOutput  # its model_time_s: the host's time in launch and finish
    draw: Draw | None = None

    def done(self) -> bool:
        """Whether `finish` would return without waiting for the device."""
        return self.draw is None or self.draw.ready is None or self.draw.ready.query()


_KEEP_ROWS = "keep_rows"  # the logit rows' name among the arrays a step stages


@dataclass
class _LogitRows:
    """Which of a step's hidden rows need logits (flat token indices)."""
    sample_idx: list[int]  # the last token of every row that samples
    spec_rows: list  # rows that verify proposals ...
    spec_idx: list[int]  # ... and every position of theirs
    prompt_lp_rows: list  # (row, its first index): prompt chunks whose request wants logprobs

    @property
    def logit_rows(self) -> list[int]:
        """The rows the LM head takes, in the order its logits are read."""
        return self.sample_idx + self.spec_idx


def _plan_logit_rows(rows) -> _LogitRows:
    heads = _LogitRows([], [], [], [])
    offset = 0
    for row in rows:
        if row.proposals:
            heads.spec_rows.append(row)
            heads.spec_idx.extend(range(offset, offset + row.num_tokens))
        elif row.group.do_sample:
            heads.sample_idx.append(offset + row.num_tokens - 1)
        if row.group.is_prompt and row.state.request.params.prompt_logprobs is not None:
            heads.prompt_lp_rows.append((row, offset))
        offset += row.num_tokens
    return heads
