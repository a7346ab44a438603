"""The offline entry point: `LLM(model).generate(prompts, sampling_params)` (seed's LLM class)."""
import itertools
import json
from collections.abc import Sequence as SequenceLike

from tqdm.auto import tqdm

from proto.requests import ChatOptions
from shared.chat_template import load_chat_template, render_chat
from shared.engine_args import EngineArgs
from shared.sampling_params import SamplingParams
from services.engine.llm_engine import LLMEngine
from shared.outputs import RequestOutput


class LLM:
    def __init__(self, model: str | None = None, **engine_args):
        self.engine_args = EngineArgs(model=model, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self.request_counter = itertools.count()

    def close(self) -> None:
        """Stop the engine's other processes (the ranks of tensor_parallel_size > 1) and give
        back what it took of this process (threads, CPUs); nothing to do on one rank. The LLM
        cannot generate afterwards. Also `with LLM(...) as llm:`."""
        self.llm_engine.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if prompts is None and prompt_token_ids is None:
            raise ValueError("give prompts or prompt_token_ids")
        if isinstance(prompts, str):
            prompts = [prompts]
        if prompt_token_ids is not None and prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        num = len(prompts) if prompts is not None else len(prompt_token_ids)
        if prompts is not None and prompt_token_ids is not None and len(prompt_token_ids) != num:
            raise ValueError("prompts and prompt_token_ids differ in length")
        params = self._params_list(sampling_params, num)
        ids = []
        try:
            for i in range(num):
                request_id = str(next(self.request_counter))
                self.llm_engine.add_request(
                    request_id, prompts[i] if prompts is not None else None, params[i],
                    prompt_token_ids=prompt_token_ids[i] if prompt_token_ids is not None else None)
                ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(ids)  # all prompts or none: a bad one runs nothing
            raise
        return self._run_engine(ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Chat conversations (OpenAI-shaped message dicts), rendered with the model's chat
        template, or `chat_template` (a path, a shipped name or Jinja text), as the served
        stack renders them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        options = ChatOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=load_chat_template(chat_template),
            chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else None,
            tools=json.dumps(tools) if tools else None)
        tokenizer = self.get_tokenizer()
        rendered = [render_chat(tokenizer, c, options) for c in conversations]
        return self.generate([r.text for r in rendered], sampling_params,
                             prompt_token_ids=[r.token_ids for r in rendered], use_tqdm=use_tqdm)

    @staticmethod
    def _params_list(sampling_params, num: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * num
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num
        if isinstance(sampling_params, SequenceLike) and len(sampling_params) == num:
            return list(sampling_params)
        raise ValueError(f"sampling_params must be one SamplingParams or a list of {num}")

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                   disable=not use_tqdm)
        out_tokens = 0
        step = (engine.step_async if engine.config.scheduler_config.async_scheduling
                else engine.step)
        try:
            while engine.has_unfinished_requests() or engine.has_steps_in_flight():
                for out in step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"output {out_tokens / elapsed:.1f} tok/s")
        finally:
            bar.close()
        return [finished[r] for r in request_ids]
