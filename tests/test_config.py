"""EngineArgs -> PagodaConfig: defaults, every invalid value failing at creation with its field
named, and the command-line flags."""
import argparse
import dataclasses

import pytest
import structlog
import torch

from shared.config import ConfigError
from shared.engine_args import EngineArgs
from tests.helpers import tiny_llama_config


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> str:
    """A folder with only a config.json: enough for configuration, which loads no weights."""
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama_config(max_position_embeddings=512).save_pretrained(folder)
    return str(folder)


def test_defaults_of_the_default_model():
    config = EngineArgs().create_engine_config()
    assert config.model_config.source.gguf_file.endswith(".gguf")
    hf_config = config.model_config.hf_config
    assert hf_config.model_type == "llama"
    assert config.model_config.max_model_len == hf_config.max_position_embeddings
    assert config.model_config.tokenizer == config.model_config.source.path
    assert config.scheduler_config.max_num_batched_tokens == 2048  # chunked prefill is on
    assert config.cache_config.enable_prefix_caching


def test_values_reach_their_component_configs(model_folder):
    config = EngineArgs(model=model_folder, dtype="bfloat16", seed=5, max_model_len=256,
                        block_size=32, kv_cache_space_gib=0.5, swap_space=0.25,
                        num_gpu_blocks_override=40, enable_prefix_caching=False,
                        max_num_seqs=7, max_num_batched_tokens=64, preemption_mode="swap",
                        device="cpu", attention_backend="cpu").create_engine_config()
    m, c, s = config.model_config, config.cache_config, config.scheduler_config
    assert (m.dtype, m.seed, m.max_model_len, m.tokenizer) == (torch.bfloat16, 5, 256, model_folder)
    assert (c.block_size, c.kv_cache_space_gib, c.swap_space_gib, c.num_gpu_blocks_override,
            c.enable_prefix_caching) == (32, 0.5, 0.25, 40, False)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len, s.enable_chunked_prefill,
            s.preemption_mode) == (7, 64, 256, True, "swap")
    assert config.device_config.device == torch.device("cpu")
    assert config.device_config.attention_backend == "cpu"
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.vocab_size) == (3, 2, 16, 256)


# --- the KV cache budget of each device --------------------------------------------------------

@pytest.fixture
def on_cuda(monkeypatch):
    """Configuration as on a CUDA host (nothing in it touches the device)."""
    monkeypatch.setattr(EngineArgs, "_device", lambda self: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)


def budget_of(args: EngineArgs) -> tuple[tuple, list[dict]]:
    """((gpu_memory_utilization, kv_cache_space_gib) as configured, the warnings logged)."""
    with structlog.testing.capture_logs() as logs:
        cache = args.create_engine_config().cache_config
    warnings = [e for e in logs if e["log_level"] == "warning"]
    return (cache.gpu_memory_utilization, cache.kv_cache_space_gib), warnings


def test_each_device_defaults_its_own_budget_and_leaves_the_other_unset(model_folder, on_cuda):
    assert budget_of(EngineArgs(model=model_folder)) == ((0.9, None), [])
    assert budget_of(EngineArgs(model=model_folder, gpu_memory_utilization=0.5)) == ((0.5, None), [])


def test_async_scheduling_is_on_for_cuda_and_off_on_the_cpu_unless_asked(model_folder,
                                                                          monkeypatch):
    def async_scheduling(**kwargs) -> bool:
        return EngineArgs(model=model_folder, **kwargs).create_engine_config() \
            .scheduler_config.async_scheduling
    assert async_scheduling(device="cpu") is False
    assert async_scheduling(device="cpu", async_scheduling=True) is True
    on_cuda.__wrapped__(monkeypatch)  # configuration as on a CUDA host (no GPU here)
    assert async_scheduling() is True
    assert async_scheduling(async_scheduling=False) is False


def test_the_cpu_budget_is_the_kv_cache_space(model_folder):
    assert budget_of(EngineArgs(model=model_folder, device="cpu")) == ((None, 2.0), [])
    assert budget_of(EngineArgs(model=model_folder, device="cpu",
                                kv_cache_space_gib=0.5)) == ((None, 0.5), [])


def test_gpu_memory_utilization_on_the_cpu_is_warned_about(model_folder):
    budget, warnings = budget_of(EngineArgs(model=model_folder, device="cpu",
                                            gpu_memory_utilization=0.5, kv_cache_space_gib=0.25))
    assert budget == (None, 0.25)
    assert len(warnings) == 1
    assert warnings[0]["event"].startswith("gpu_memory_utilization has no effect on the CPU")
    assert "kv_cache_space_gib sizes the KV cache" in warnings[0]["event"]
    assert warnings[0]["gpu_memory_utilization"] == 0.5


def test_kv_cache_space_on_cuda_is_warned_about(model_folder, on_cuda):
    budget, warnings = budget_of(EngineArgs(model=model_folder, kv_cache_space_gib=0.5))
    assert budget == (0.9, None)
    assert len(warnings) == 1
    assert warnings[0]["event"].startswith("kv_cache_space_gib has no effect on CUDA")
    assert "gpu_memory_utilization size the KV cache" in warnings[0]["event"]
    assert warnings[0]["kv_cache_space_gib"] == 0.5


def test_swap_space_without_swap_preemption_is_accepted_silently(model_folder):
    budget, warnings = budget_of(EngineArgs(model=model_folder, device="cpu", swap_space=4.0,
                                            preemption_mode="recompute"))
    assert warnings == []


def test_the_help_states_each_budgets_device_and_default():
    text = " ".join(parser().format_help().split())
    assert "CUDA: the share of device memory" in text and "(default 0.9); no effect on the CPU" in text
    assert "CPU: GiB of KV cache (default 2.0); no effect on CUDA" in text
    assert "allocated only with --preemption-mode swap (default 1.0)" in text


def test_auto_dtype_is_float32_on_the_cpu(model_folder):
    config = EngineArgs(model=model_folder, device="cpu").create_engine_config()
    assert config.model_config.dtype == torch.float32


def test_without_chunked_prefill_the_token_budget_covers_a_whole_prompt(model_folder):
    config = EngineArgs(model=model_folder, enable_chunked_prefill=False).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens >= 512


INVALID = [
    ("model", dict(model="/no/such/model")),
    ("tokenizer", dict(tokenizer="/no/such/tokenizer")),
    ("dtype", dict(dtype="float8")),
    ("dtype", dict(dtype=32)),
    ("seed", dict(seed=-1)),
    ("seed", dict(seed=2 ** 64)),
    ("seed", dict(seed="7")),
    ("max_model_len", dict(max_model_len=0)),
    ("max_model_len", dict(max_model_len=-8)),
    ("max_model_len", dict(max_model_len=513)),  # past the model's max_position_embeddings
    ("block_size", dict(block_size=12)),
    ("block_size", dict(block_size=16.0)),
    ("kv_cache_dtype", dict(kv_cache_dtype="fp16")),
    ("kv_cache_dtype", dict(kv_cache_dtype=8)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=0.0)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=1.5)),
    ("gpu_memory_utilization", dict(gpu_memory_utilization=float("nan"))),
    ("kv_cache_space_gib", dict(kv_cache_space_gib=0)),
    ("kv_cache_space_gib", dict(kv_cache_space_gib=float("inf"))),
    ("swap_space", dict(swap_space=-1.0)),
    ("swap_space", dict(swap_space=float("nan"))),
    ("swap_space", dict(preemption_mode="swap", swap_space=0)),
    ("num_gpu_blocks_override", dict(num_gpu_blocks_override=0)),
    ("enable_prefix_caching", dict(enable_prefix_caching="yes")),
    ("enable_chunked_prefill", dict(enable_chunked_prefill=1)),
    ("max_num_seqs", dict(max_num_seqs=0)),
    ("max_num_seqs", dict(max_num_seqs=True)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens=0)),
    ("max_num_batched_tokens", dict(max_num_batched_tokens="64")),
    ("max_num_batched_tokens", dict(enable_chunked_prefill=False, max_num_batched_tokens=256)),
    ("preemption_mode", dict(preemption_mode="drop")),
    ("async_scheduling", dict(async_scheduling="yes")),
    ("tensor_parallel_size", dict(tensor_parallel_size=0)),
    ("tensor_parallel_size", dict(tensor_parallel_size=3)),  # 2 KV heads do not share 3 ways
    ("data_parallel_size", dict(data_parallel_size=0)),
    ("data_parallel_size", dict(data_parallel_size=True)),
    ("device", dict(device="tpu")),
    ("device", dict(device="not a device")),
    ("device", dict(device="cuda:99")),
    ("attention_backend", dict(attention_backend="bogus")),
    ("attention_backend", dict(attention_backend="CPU")),
    ("enforce_eager", dict(enforce_eager="yes")),
    ("load_format", dict(load_format="pt")),
    ("load_format", dict(load_format="gguf")),  # the model is a safetensors folder
    ("quantization", dict(quantization="fp8")),
    ("quantization", dict(quantization="INT8")),
    ("speculative_config", dict(speculative_config='{"method": "eagle", "num_speculative_tokens": 2}')),
    ("speculative_config", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 0})),
]


@pytest.mark.parametrize("field,values", INVALID, ids=[f"{f}-{i}" for i, (f, _) in
                                                       enumerate(INVALID)])
def test_an_invalid_value_fails_at_creation_naming_its_field(model_folder, field, values):
    args = EngineArgs(**{"model": model_folder, **values})
    with pytest.raises(ConfigError) as error:
        args.create_engine_config()
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")


def test_an_unsupported_architecture_fails_naming_the_model(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="^model: architecture 'gpt2' is not supported"):
        EngineArgs(model=str(tmp_path)).create_engine_config()


def test_every_invalid_field_is_an_engine_args_field():
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    assert {field for field, _ in INVALID} == names


# --- command line ----------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def to_argv(args: EngineArgs) -> list[str]:
    argv = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is not None:
            argv += [f"--{flag}", str(value)]
    return argv


def test_every_field_round_trips_through_its_flag():
    args = EngineArgs(model="/models/m", tokenizer="/models/t", dtype="bfloat16", seed=3,
                      max_model_len=1024, block_size=32, kv_cache_dtype="int8",
                      gpu_memory_utilization=0.5,
                      kv_cache_space_gib=1.5, swap_space=2.5, num_gpu_blocks_override=100,
                      enable_prefix_caching=False, enable_chunked_prefill=False, max_num_seqs=8,
                      max_num_batched_tokens=2048, preemption_mode="swap", async_scheduling=True,
                      tensor_parallel_size=2, data_parallel_size=2, device="cpu",
                      attention_backend="torch",
                      enforce_eager=True, load_format="gguf", quantization="int8",
                      speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert all(getattr(args, f.name) != f.default for f in dataclasses.fields(args))
    parsed = EngineArgs.from_cli_args(parser().parse_args(to_argv(args)))
    assert parsed == args
    assert parsed.to_dict() == args.to_dict()


def test_no_flags_give_the_defaults():
    assert EngineArgs.from_cli_args(parser().parse_args([])) == EngineArgs()


def test_flags_turn_booleans_on_and_off():
    on = EngineArgs.from_cli_args(parser().parse_args(["--enable-prefix-caching"]))
    off = EngineArgs.from_cli_args(parser().parse_args(["--no-enable-chunked-prefill"]))
    assert on.enable_prefix_caching and not off.enable_chunked_prefill


def test_a_flag_value_of_the_wrong_type_is_refused(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["--max-num-seqs", "many"])
    assert "--max-num-seqs" in capsys.readouterr().err
