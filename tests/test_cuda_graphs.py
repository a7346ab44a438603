"""CUDA graphs for decode steps (services/worker/cuda_graphs.py): the parts that need no GPU.
The capture and replay themselves need a GPU (ops/bench/gpu_check's "cuda graphs" section
checks them there, against --enforce-eager); here: the batch sizes captured and the padding a
step gets, the persistent buffers' layout and filling, the forward a graph captures run on the
CPU (Triton's interpreter) over padded buffers, which must give the eager step's rows and write
nothing for its padding rows, and the whole engine with a stand-in for the capture."""
import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.worker.cuda_graphs import (PAD_SLOT, BufferLayout, DecodeGraphs,  # noqa: E402
                                         DecodeInputBuffers, capture_sizes, graphs_apply,
                                         padded_size)
from shared.engine_args import EngineArgs  # noqa: E402
from tests.helpers import PagedBatchPlanner, PagedSequence  # noqa: E402


def test_capture_sizes_double_to_eight_then_step_by_eight_up_past_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # padded up: 20 sequences fit the last
    sizes = capture_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[4:], sizes[5:]))
    assert capture_sizes(4096, limit=64)[-1] == 64


def test_a_step_replays_the_smallest_size_that_holds_it():
    sizes = capture_sizes(32)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [
        1, 2, 4, 8, 8, 16, 24, 32]
    assert padded_size(33, sizes) is None  # runs eagerly
    assert padded_size(0, sizes) is None


def test_graphs_only_on_cuda_with_the_triton_backend_and_not_with_enforce_eager():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_apply(cuda, False, "triton")
    assert not graphs_apply(cuda, True, "triton")
    assert not graphs_apply(cuda, False, "torch")  # its cache write would take slot -1
    assert not graphs_apply(cpu, False, "triton")
    assert EngineArgs().enforce_eager is False
    args = EngineArgs.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
        ["--enforce-eager"])
    assert EngineArgs.from_cli_args(args).enforce_eager is True


def test_buffer_layout_is_as_wide_as_the_longest_context():
    layout = BufferLayout.for_model(max_batch=24, max_model_len=1000, block_size=16)
    assert layout.max_blocks == 63
    shapes = layout.shapes()
    assert shapes["block_tables"] == (24, 63) and shapes["query_start_loc"] == (25,)
    assert {shapes[n] for n in ("input_ids", "positions", "slot_mapping", "seq_lens",
                                "context_lens")} == {(24,)}


def decode_step(planner, seqs):
    return planner.plan_step([], seqs)


def test_fill_copies_the_rows_and_pads_the_rest_also_after_a_larger_step():
    planner = PagedBatchPlanner(num_blocks=64, block_size=16)
    seqs = [PagedSequence(list(range(1, n + 1))) for n in (20, 35, 3)]
    planner.plan_step([(s, len(s.token_ids) - 1) for s in seqs], [])
    step = decode_step(planner, seqs)
    buffers = DecodeInputBuffers(BufferLayout.for_model(8, 512, 16), torch.device("cpu"))
    assert buffers.query_start_loc.tolist() == list(range(9))
    buffers.fill(step.input_ids, step.positions, step.meta, batch_size=4)
    width = step.meta.block_tables.shape[1]
    assert buffers.input_ids[:3].tolist() == step.input_ids.tolist()
    assert buffers.positions[:3].tolist() == step.positions.tolist()
    assert buffers.slot_mapping[:3].tolist() == step.meta.slot_mapping.tolist()
    assert buffers.seq_lens[:3].tolist() == [20, 35, 3]
    assert buffers.context_lens[:3].tolist() == [19, 34, 2]
    assert torch.equal(buffers.block_tables[:3, :width], step.meta.block_tables)
    # Row 3 pads the batch of 4: nothing written, one token of block 0 read.
    assert buffers.slot_mapping[3].item() == PAD_SLOT
    assert (buffers.input_ids[3].item(), buffers.positions[3].item()) == (0, 0)
    assert (buffers.seq_lens[3].item(), buffers.block_tables[3, 0].item()) == (1, 0)

    # A smaller step next: the rows the first one filled are padding again.
    seqs[0].token_ids.append(5)
    step = decode_step(planner, seqs[:1])
    buffers.fill(step.input_ids, step.positions, step.meta, batch_size=2)
    assert buffers.seq_lens[:2].tolist() == [21, 1]
    assert buffers.slot_mapping[1].item() == PAD_SLOT
    meta = buffers.metadata(2, max_model_len=512, block_size=16)
    assert (meta.num_decode_tokens, meta.num_prefills, meta.max_seq_len) == (2, 0, 512)
    assert meta.seq_lens_list == [512, 512] and meta.block_tables.shape == (2, 32)
    assert meta.seq_lens.data_ptr() == buffers.seq_lens.data_ptr()  # views, not copies


def test_steps_a_graph_cannot_take_run_the_model():
    calls = []

    def model(*args):
        calls.append(args)
        return "eager"
    graphs = DecodeGraphs(model, kv_caches=[], sizes=[1, 2], max_model_len=64, block_size=16,
                          device=torch.device("cpu"))  # nothing captured: that needs a GPU
    planner = PagedBatchPlanner(num_blocks=8, block_size=16)
    seqs = [PagedSequence([1, 2, 3]) for _ in range(3)]
    prefill = planner.plan_step([(s, 3) for s in seqs], [])
    assert graphs(prefill.input_ids, prefill.positions, [], prefill.meta) == "eager"
    assert len(calls) == 1


def test_the_captured_forward_over_padded_buffers_gives_the_eager_rows(tmp_path, monkeypatch):
    """What a graph replays, run without one: the model over the buffers of a padded batch
    with the longest-context metadata. The capture itself needs a GPU."""
    pytest.importorskip("triton")
    from pagoda_kernels import cpu as cpu_kernels
    from services.worker.attention.triton_backend import TritonAttentionBackend
    from services.worker.model_loader import load_model
    from tests.helpers import (load_config, model_config_for, new_kv_caches, save_random_model,
                               tiny_llama_config)
    monkeypatch.setattr(cpu_kernels, "available_for", lambda x: False)  # as on a GPU
    hf_config = tiny_llama_config(num_hidden_layers=2, max_position_embeddings=128)
    save_random_model(hf_config, tmp_path)
    model = load_model(model_config_for(tmp_path, hf_config), load_config(),
                       torch.device("cpu"), TritonAttentionBackend())
    head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    caches = new_kv_caches(2, 16, 16, hf_config.num_key_value_heads, head_dim)
    planner = PagedBatchPlanner(num_blocks=15, block_size=16)  # block 15 is never handed out
    seqs = [PagedSequence([(7 * i + j) % 256 for j in range(n)]) for i, n in
            enumerate((9, 30, 17))]
    prefill = planner.plan_step([(s, len(s.token_ids) - 1) for s in seqs], [])
    model(prefill.input_ids, prefill.positions, caches, prefill.meta)
    step = decode_step(planner, seqs)
    before = [(k.clone(), v.clone()) for k, v in caches]
    eager = model(step.input_ids, step.positions, caches, step.meta)
    after_eager = [(k.clone(), v.clone()) for k, v in caches]
    for (k, v), (k0, v0) in zip(caches, before):  # back to the cache before the step
        k.copy_(k0)
        v.copy_(v0)

    buffers = DecodeInputBuffers(BufferLayout.for_model(4, 128, 16), torch.device("cpu"))
    buffers.input_ids.fill_(99)  # stale rows of an earlier step
    buffers.fill(step.input_ids, step.positions, step.meta, batch_size=4)
    meta = buffers.metadata(4, max_model_len=128, block_size=16)
    padded = model(buffers.input_ids[:4], buffers.positions[:4], caches, meta)
    torch.testing.assert_close(padded[:3], eager, rtol=1e-5, atol=1e-5)
    for (k, v), (k1, v1), (k0, v0) in zip(caches, after_eager, before):
        # The real rows' K/V as the eager step's, up to the matmul's rounding at 4 rows
        # against 3; the padding row (slot -1) wrote nothing, not even to the last block,
        # which no sequence holds and where a slot of -1 taken as an index would land.
        torch.testing.assert_close(k, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v1, rtol=1e-5, atol=1e-5)
        assert torch.equal(k[-1], k0[-1]) and torch.equal(v[-1], v0[-1])



class StandInGraph:
    """torch.cuda.CUDAGraph's place on the CPU: `replay` re-runs the forward that was captured
    into the tensor the capture returned (the test sets it up after capture). A real capture
    needs a GPU."""
    replays = 0

    def __init__(self):
        self.rerun = None

    def replay(self):
        StandInGraph.replays += 1
        self.rerun()


@contextlib.contextmanager
def stand_in_capture(graph, pool=None):
    yield


def test_the_engine_on_stand_in_graphs_gives_the_eager_tokens(tmp_path, monkeypatch):
    """The whole path on the CPU: the worker captures after the cache (graphs forced on, a
    stand-in for the capture), decode steps of 3, 2 and 1 sequences replay the sizes 4, 2 and 1
    through ModelRunner.execute_model, prefill steps run eagerly; the greedy tokens equal those
    of an engine without graphs."""
    pytest.importorskip("triton")
    from ops.bench.gpu_check.random_models import word_tokenizer
    from pagoda import LLM, SamplingParams
    from services.worker import worker as worker_module
    from tests.helpers import save_random_model, tiny_llama_config
    hf_config = tiny_llama_config(num_hidden_layers=2, max_position_embeddings=128)
    save_random_model(hf_config, tmp_path)
    word_tokenizer(hf_config.vocab_size).save_pretrained(tmp_path)
    prompts = [[5, 17, 200, 3, 9], [250, 1, 2, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 40],
               [77, 78]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 5, 7)]

    def generate():
        llm = LLM(model=str(tmp_path), device="cpu", attention_backend="triton",
                  num_gpu_blocks_override=32, max_num_seqs=4)
        graphs = llm.llm_engine.executor.worker.model_runner.decode_graphs
        if graphs is not None:
            for size, (graph, hidden) in graphs.graphs.items():
                meta = graphs.buffers.metadata(size, graphs.max_model_len, graphs.block_size)
                graph.rerun = (lambda size=size, hidden=hidden, meta=meta: hidden.copy_(
                    graphs.model(graphs.buffers.input_ids[:size],
                                 graphs.buffers.positions[:size], graphs.kv_caches, meta)))
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], graphs

    eager, _ = generate()
    monkeypatch.setattr(worker_module, "graphs_apply", lambda *args: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", StandInGraph)
    monkeypatch.setattr(torch.cuda, "graph", stand_in_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    replayed = []
    fill = DecodeInputBuffers.fill

    def counted_fill(self, input_ids, positions, meta, batch_size):
        replayed.append((meta.num_decode_tokens, batch_size))
        fill(self, input_ids, positions, meta, batch_size)
    monkeypatch.setattr(DecodeInputBuffers, "fill", counted_fill)
    StandInGraph.replays = 0
    with_graphs, graphs = generate()
    assert sorted(graphs.graphs) == [1, 2, 4]
    assert with_graphs == eager
    # 2 decode steps of 3 sequences, 2 of 2, 2 of 1 (the first token comes from the prefill).
    assert replayed == [(3, 4)] * 2 + [(2, 2)] * 2 + [(1, 1)] * 2
    assert StandInGraph.replays == len(replayed)

