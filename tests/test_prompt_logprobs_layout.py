"""How the gateway lays out a prompt's logprobs (services/gateway/extensions.py) when the engine
computed more alternatives than one of the fields asked for: echo's `logprobs` and
`prompt_logprobs` share one engine request, asked for the larger of the two."""
from shared.outputs import RequestOutput
from services.gateway.extensions import echo_logprobs, vllm_prompt_logprobs


def _output() -> RequestOutput:
    # Prompt [5, 7, 9]; the engine's top 3 at each scored position, plus the prompt's token
    # when it is not among them (9 at position 2).
    out = RequestOutput("r", None, [5, 7, 9], [None, {7: -0.1, 1: -2.0, 2: -3.0},
                                               {1: -0.5, 2: -1.0, 3: -1.5, 9: -4.0}], [], True)
    texts = {t: f"t{t}" for t in (1, 2, 3, 5, 7, 9)}
    out.prompt_logprob_texts = [{5: "t5"}, texts, texts]
    return out


def test_prompt_logprobs_keep_their_own_k_and_the_ranks_of_the_computed_top():
    entries = vllm_prompt_logprobs(_output(), k=1, computed=3)
    assert entries[0] is None
    assert entries[1] == {"7": {"logprob": -0.1, "rank": 1, "decoded_token": "t7"}}
    assert entries[2] == {"9": {"logprob": -4.0, "rank": None, "decoded_token": "t9"},
                          "1": {"logprob": -0.5, "rank": 1, "decoded_token": "t1"}}
    assert list(vllm_prompt_logprobs(_output(), k=3)[1]) == ["7", "1", "2"]


def test_echo_logprobs_keep_the_requests_logprobs_and_the_prompts_token():
    lp = echo_logprobs(_output(), k=1)
    assert lp.tokens == ["t5", "t7", "t9"] and lp.token_logprobs == [None, -0.1, -4.0]
    assert lp.top_logprobs == [None, {"t7": -0.1}, {"t1": -0.5, "t9": -4.0}]
    assert list(echo_logprobs(_output()).top_logprobs[2]) == ["t1", "t2", "t3", "t9"]
