"""What a GPU check run measures: the targets docs/benchmarks.md states, the model shapes, and
the plan of each mode (cuda_plan for the run on a GPU, cpu_plan for the smoke mode)."""
from dataclasses import dataclass, field, replace

# The targets docs/benchmarks.md states.
DECODE_TARGET = 0.70  # of the copy bandwidth, decode attention at long contexts
LONG_CONTEXT = 16384  # contexts from here on count as long
SPEEDUP_TARGET = 5.0  # over transformers' static batching, 8B shape
ROOFLINE_TARGET = 0.50  # of the roofline, 8B shape
GRAPHS_TARGET = 1.5  # decode step time, --enforce-eager over CUDA graphs, small batches
TOP_K = 5  # near-tie allowance of the parity checks

# Llama-3.2-1B and Llama-3.1-8B as published (LlamaConfig kwargs); the weights are random.
LLAMA_3_2_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
LLAMA_3_1_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192))
# The smoke mode's stand-in (tests/helpers.py's tiny Llama).
TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5,
    tie_word_embeddings=False)


@dataclass
class ModelSpec:
    name: str
    config: dict  # LlamaConfig kwargs
    num_prompts: int
    input_len: int
    output_len: int
    hf_prompts: int  # transformers runs this many of the prompts (its rate does not depend on it)
    hf_batch_size: int
    has_targets: bool  # the speedup and roofline targets are stated for this shape


@dataclass
class Plan:
    device: str
    # env
    copy_bytes: int
    matmul_n: int
    env_iters: int
    # kernels
    timing_iters: int
    warmup: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_batches: list
    decode_contexts: list
    decode_check_lens: list  # sequence lengths of the correctness check
    prefill_check: tuple  # (query_lens, context_lens)
    prefill_timings: list  # [(query_lens, context_lens)]
    elementwise_tokens: int
    hidden: int
    sampling_batches: list  # rows of the top-k / top-p kernel's check (the largest) and timings
    sampling_vocab: int
    # parity
    parity_cases: list  # [(architecture, dtype name)]
    parity_config: dict  # size of the random models (config kwargs)
    parity_prompt_lens: list
    parity_new_tokens: int
    # throughput and serve
    models: list  # [ModelSpec]
    serve: bool
    serve_prompts: int
    serve_input_len: int
    serve_output_len: int
    # CUDA graphs against --enforce-eager: decode steps at these batch sizes
    graphs_batches: list
    graphs_decode_steps: int
    graphs_input_len: int
    # every LLM of the run gets these
    engine_kwargs: dict = field(default_factory=dict)
    # a section starts only with this many seconds left before the deadline
    min_left_s: dict = field(default_factory=dict)
    # --quantization int8 / w8a8 (int8_checks.py): kernel check and timing shapes (M, N, K),
    # and whether the parity section runs the engine with each
    int8_check_shapes: list = field(default_factory=list)
    int8_timings: list = field(default_factory=list)
    int8_engine: bool = False


def cuda_plan(quick: bool) -> Plan:
    one_b = ModelSpec("1B", LLAMA_3_2_1B, 512, 512, 256, 128, 64, False)
    eight_b = ModelSpec("8B", LLAMA_3_1_8B, 512, 512, 256, 64, 64, True)
    if quick:
        one_b = replace(one_b, num_prompts=128, input_len=256, output_len=64, hf_prompts=64)
        eight_b = replace(eight_b, num_prompts=128, input_len=256, output_len=64)
    return Plan(
        device="cuda", copy_bytes=2 << 30, matmul_n=8192, env_iters=30,
        timing_iters=50, warmup=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        decode_batches=[64, 256],
        decode_contexts=[4096, 32768] if quick else [1024, 4096, 16384, 32768],
        decode_check_lens=[1, 17, 511, 513, 4000, 16384, 32765],
        prefill_check=([1, 300, 1024, 77], [4000, 0, 2048, 513]),
        prefill_timings=[([2048] * 8, [0] * 8), ([512] * 4, [16384] * 4)],
        elementwise_tokens=16384, hidden=4096,
        sampling_batches=[1, 64, 256], sampling_vocab=128256,
        parity_cases=([("llama", "float32"), ("qwen2", "bfloat16")] if quick else
                      [("llama", "float32"), ("llama", "bfloat16"), ("qwen2", "float32"),
                       ("qwen2", "bfloat16")]),
        parity_config=dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=4096,
                           max_position_embeddings=2048),
        parity_prompt_lens=[5, 37, 130, 600], parity_new_tokens=24,
        models=[one_b, eight_b], serve=True,
        serve_prompts=64 if quick else 256, serve_input_len=256 if quick else 512,
        serve_output_len=64 if quick else 128,
        graphs_batches=[1, 4, 16], graphs_decode_steps=32 if quick else 64, graphs_input_len=32,
        min_left_s={"kernels": 45, "parity": 45, "throughput 1B": 75, "graphs": 50,
                    "throughput 8B": 150, "serve": 90},
        # Not multiples of the kernels' blocks; then the 8B gate/up and down projections at
        # decode (1, 64 rows) and one prompt chunk.
        int8_check_shapes=[(1, 4100, 2056), (17, 1000, 4100), (300, 2048, 8192)],
        int8_timings=[(1, 28672, 4096), (1, 4096, 14336), (64, 28672, 4096),
                      (2048, 28672, 4096)],
        int8_engine=True)


def cpu_plan() -> Plan:
    tiny = ModelSpec("tiny", TINY_LLAMA, 6, 16, 6, 4, 4, False)
    return Plan(
        device="cpu", copy_bytes=64 << 20, matmul_n=256, env_iters=5,
        timing_iters=2, warmup=1, num_heads=8, num_kv_heads=2, head_dim=32, block_size=16,
        decode_batches=[2], decode_contexts=[40, 600],  # 600: split over two partitions
        decode_check_lens=[1, 37, 600],
        prefill_check=([1, 9, 20], [17, 0, 30]),
        prefill_timings=[([16, 16], [0, 0])],
        elementwise_tokens=8, hidden=128,
        sampling_batches=[2], sampling_vocab=300,
        parity_cases=[("llama", "float32"), ("qwen2", "bfloat16")],
        parity_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                           max_position_embeddings=512),
        parity_prompt_lens=[5, 23], parity_new_tokens=6,
        models=[tiny], serve=False, serve_prompts=4, serve_input_len=8, serve_output_len=4,
        graphs_batches=[2], graphs_decode_steps=2, graphs_input_len=8,
        # The Triton kernels in the engine too (interpreted), so the smoke run reaches them.
        engine_kwargs=dict(attention_backend="triton"),
        int8_check_shapes=[(3, 40, 70)], int8_timings=[(1, 64, 128)])


def serve_model(plan: Plan) -> ModelSpec:
    return next((m for m in plan.models if m.name == "1B"), plan.models[0])
