"""SamplingParams: bad values are rejected naming their field, and nothing but a
SamplingParamsError ever escapes, whatever the values."""
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.sampling_params import SamplingParams, SamplingParamsError

FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def test_defaults_are_valid():
    params = SamplingParams()
    assert params.n == 1 and params.max_tokens == 16 and not params.is_greedy
    assert params.stop == [] and params.stop_token_ids == []


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


def test_top_k_minus_one_means_no_limit():
    assert SamplingParams(top_k=-1).top_k == 0


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy


def test_penalties_are_noticed():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.2).uses_penalties
    assert SamplingParams(presence_penalty=-0.5).uses_penalties


BAD = [
    ("n", dict(n=0)), ("n", dict(n=2.0)), ("n", dict(n=True)),
    ("n", dict(n=2, temperature=0.0)),  # n identical greedy completions
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=float("nan"))),
    ("frequency_penalty", dict(frequency_penalty=-2.01)),
    ("frequency_penalty", dict(frequency_penalty="0.5")),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=float("inf"))),
    ("temperature", dict(temperature=-0.5)), ("temperature", dict(temperature=None)),
    ("top_p", dict(top_p=0.0)), ("top_p", dict(top_p=1.01)),
    ("top_k", dict(top_k=-2)), ("top_k", dict(top_k=3.0)),
    ("min_p", dict(min_p=-0.1)), ("min_p", dict(min_p=1.5)),
    ("seed", dict(seed=1.5)), ("seed", dict(seed="7")),
    ("max_tokens", dict(max_tokens=0)), ("max_tokens", dict(max_tokens=1.0)),
    ("min_tokens", dict(min_tokens=-1)), ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("logprobs", dict(logprobs=-1)), ("logprobs", dict(logprobs=21)),
    ("logprobs", dict(logprobs=True)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)), ("prompt_logprobs", dict(prompt_logprobs=100)),
    ("stop", dict(stop=[""])), ("stop", dict(stop=["ok", 3])), ("stop", dict(stop=5)),
    ("stop_token_ids", dict(stop_token_ids=[-1])), ("stop_token_ids", dict(stop_token_ids=["2"])),
    ("stop_token_ids", dict(stop_token_ids=7)), ("stop_token_ids", dict(stop_token_ids=[True])),
]


@pytest.mark.parametrize("field,values", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_a_bad_value_is_rejected_naming_its_field(field, values):
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**values)
    assert error.value.field == field
    assert str(error.value).startswith(f"{field}: ")


def test_a_value_changed_after_creation_is_caught_by_verify():
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(SamplingParamsError, match="^top_p: "):
        params.verify()


# Any value of any type for a handful of fields, valid ones included.
ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(), st.floats(),
    st.floats(-3.0, 3.0), st.text(max_size=3),
    st.lists(st.one_of(st.integers(-2, 5), st.text(max_size=2), st.none()), max_size=3),
    st.dictionaries(st.text(max_size=1), st.integers(), max_size=1), st.binary(max_size=2),
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted(FIELDS)), ANY_VALUE, max_size=6))
def test_any_values_either_validate_or_raise_a_sampling_params_error(values):
    try:
        params = SamplingParams(**values)
    except SamplingParamsError as error:
        assert error.field in FIELDS
        return
    # Whatever validated is usable as is, and still valid.
    params.verify()
    assert isinstance(params.n, int) and params.n >= 1
    assert all(isinstance(s, str) and s for s in params.stop)
    assert all(isinstance(t, int) and t >= 0 for t in params.stop_token_ids)
    assert isinstance(params.is_greedy, bool) and isinstance(params.uses_penalties, bool)
