"""The offline API: `LLM.generate` / `LLM.chat` on the default model."""
import pytest

from pagoda import CompletionOutput, RequestOutput, SamplingParams
from shared.sampling_params import SamplingParamsError

PROMPTS = ["Once upon a time, in a land far away, there was a dragon who",
           "The capital of Italy is",
           "1, 2, 3, 4,"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def test_outputs_come_in_input_order_with_every_field(llm, tokenizer):
    # The longest prompt asks for the most tokens and so finishes last.
    params = [SamplingParams(temperature=0.0, max_tokens=n, logprobs=1) for n in (12, 3, 6)]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    assert len({o.request_id for o in outputs}) == 3
    for out, p, max_tokens in zip(outputs, PROMPTS, (12, 3, 6)):
        assert isinstance(out, RequestOutput) and out.finished and out.error is None
        assert out.prompt_token_ids == tokenizer.encode(p)
        assert out.prompt_logprobs is None
        [completion] = out.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert len(completion.token_ids) == max_tokens and completion.finish_reason == "length"
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert len(completion.logprobs) == max_tokens
        assert completion.cumulative_logprob == pytest.approx(
            sum(lp[t] for t, lp in zip(completion.token_ids, completion.logprobs)), abs=1e-4)
        assert completion.cumulative_logprob < 0
        m = out.metrics
        assert (m.arrival_time <= m.first_scheduled_time <= m.first_token_time
                <= m.last_token_time <= m.finished_time)
        assert m.time_in_queue >= 0


def test_prompt_token_ids_give_the_same_output_as_the_text(llm, tokenizer):
    by_text = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ids = [tokenizer.encode(p) for p in PROMPTS]
    by_ids = llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in by_ids] == ids
    assert all(o.prompt is None for o in by_ids)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in by_text]
    assert [o.outputs[0].text for o in by_ids] == [o.outputs[0].text for o in by_text]
    [single] = llm.generate(prompt_token_ids=ids[1], sampling_params=GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == by_text[1].outputs[0].token_ids


def test_a_single_prompt_string_gives_one_output(llm):
    outputs = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert len(outputs) == 1 and outputs[0].prompt == PROMPTS[1]


def test_each_prompt_gets_its_own_sampling_params(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=2),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=1, stop_token_ids=[0])]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in outputs] == [[2], [4, 4], [1]]
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(PROMPTS, params[:2], use_tqdm=False)


def test_chat_applies_the_chat_template(llm, tokenizer):
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": "Name a colour."}]]
    outputs = llm.chat(conversations, GREEDY, use_tqdm=False)
    for conversation, out in zip(conversations, outputs):
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 return_dict=False)
        assert out.prompt_token_ids == list(expected)
        assert out.outputs[0].token_ids
    [single] = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_chat_continues_a_final_assistant_message_and_renders_tools_with_a_named_template(
        llm, tokenizer):
    start = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": "My favourite colour is"}]
    [out] = llm.chat(start, GREEDY, add_generation_prompt=False, continue_final_message=True,
                     use_tqdm=False)
    # The prompt stops inside the assistant's message: no end-of-turn after its text.
    assert out.prompt.endswith("My favourite colour is")
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    [with_tools] = llm.chat(start[:1], GREEDY, chat_template="hermes_tools", tools=tools,
                            use_tqdm=False)
    assert "get_weather" in with_tools.prompt and "get_weather" not in out.prompt
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(start[:1], GREEDY, add_generation_prompt=False, continue_final_message=True,
                 use_tqdm=False)


def test_a_bad_sampling_value_is_a_clear_error_and_the_engine_keeps_working(llm):
    with pytest.raises(SamplingParamsError, match="^temperature: "):
        SamplingParams(temperature=-1.0)
    changed = SamplingParams(max_tokens=4)
    changed.max_tokens = 0  # changed after creation: caught when the request is added
    with pytest.raises(SamplingParamsError, match="^max_tokens: "):
        llm.generate(PROMPTS, [GREEDY, changed, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS[0], {"temperature": 0.0}, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-added is left behind
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [8, 8, 8]


def test_a_bad_prompt_is_a_clear_error_and_the_engine_keeps_working(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match="out of range"):
        llm.generate(prompt_token_ids=[[1, 2, 3], [5, vocab]], sampling_params=GREEDY,
                     use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], sampling_params=GREEDY, use_tqdm=False)
    max_len = llm.llm_engine.config.scheduler_config.max_model_len
    with pytest.raises(ValueError, match="prompt tokens"):
        llm.generate(prompt_token_ids=[[1] * max_len], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="never fit"):
        llm.generate(PROMPTS[0], SamplingParams(n=1000, temperature=1.0), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    [out] = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8
