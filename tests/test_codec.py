"""The wire codec: every message round-trips, every bad frame raises a typed CodecError."""
import os
import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto import codec
from proto.control import Register, WorkerCall, WorkerReply
from proto.codec import (CodecError, FrameTooLarge, MalformedMessage, UnexpectedMessageType,
                         UnknownMessageType, UnsupportedVersion, decode, encode)
from proto.messages import (ExecuteModelRequest, PromptLogprobs, SamplerOutput, SequenceData,
                            SequenceGroupMetadata)
from proto.requests import (AbortRequest, ChatMessage, EngineRequest, ErrorResponse,
                            FinishRequest, GenerateRequest, HealthRequest, HealthResponse,
                            RequestAccepted, RequestTextDelta, RequestTokenDelta, SequenceTextDelta,
                            SequenceTokenDelta, TextDeltas, TokenDeltas, Usage)
from shared.sampling_params import SamplingParams

FULL_PARAMS = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=1234,
                             stop=["\n\n", "ストップ"], stop_token_ids=[2, 7], max_tokens=None,
                             logprobs=5, prompt_logprobs=0, presence_penalty=0.5)


def decode_step(seq_len: int, n: int = 64, new_block: bool = False) -> ExecuteModelRequest:
    """A steady-state decode step: the worker already holds every sequence."""
    return ExecuteModelRequest(step_id=90210, seq_group_metadata_list=[
        SequenceGroupMetadata(
            request_id=f"cmpl-{i:032x}", is_prompt=False, token_chunk_size=1,
            prompt_len=seq_len // 2, seed=i,
            seq_data=[SequenceData(seq_id=5000 + i, num_computed_tokens=seq_len,
                                   block_ids=[seq_len // 16] if new_block else [])])
        for i in range(n)])


def sampler_output(n: int = 64) -> SamplerOutput:
    return SamplerOutput(step_id=90210, seq_ids=list(range(5000, 5000 + n)),
                         token_ids=[(i * 7919) % 49152 for i in range(n)],
                         logprobs=[-0.125 * (i % 9) for i in range(n)], model_time_s=0.0123)


ROUND_TRIP_CASES = {
    "generate_text": GenerateRequest("req-1", "gw-a", "Once upon a time", SamplingParams(), 1.5),
    "generate_unicode": GenerateRequest("req-ü", "gw-a", "héllo 🌸 世界\x00", FULL_PARAMS, 2.),
    "generate_token_ids": GenerateRequest("req-2", "gw-a", [1, 2, 2**31 - 1], SamplingParams(), 0.),
    "generate_empty_token_ids": GenerateRequest("req-3", "gw-a", [], SamplingParams(), 0.0),
    "generate_chat": GenerateRequest("req-4", "gw-b", [
        ChatMessage("system", "Be brief."), ChatMessage("user", "Qu'est-ce que c'est ? 🤔")],
        SamplingParams(temperature=0, max_tokens=64), 3.25),
    "engine_request": EngineRequest("req-5", "gw-a", "hi", [1, 42, 0], FULL_PARAMS, [2, 0], 9.5),
    "engine_request_no_text": EngineRequest("req-6", "gw-a", None, [], SamplingParams(), [], 0.0),
    "abort": AbortRequest(["req-1", "req-2"], "client disconnected"),
    "abort_none": AbortRequest([], ""),
    "finish": FinishRequest(["req-7"], "stop"),
    "token_deltas": TokenDeltas(step_id=3, requests=[
        RequestTokenDelta("req-1", "gw-a", 12, [
            SequenceTokenDelta(0, [5, 6], [-0.5, -1.25], [[5, 9], [6, 1]],
                               [[-0.5, -2.0], [-1.25, -1.5]], num_output_tokens=2),
            SequenceTokenDelta(1, [7], finish_reason="stop", stop_reason=7, num_output_tokens=9)]),
        RequestTokenDelta("req-2", "gw-b", 3, [
            SequenceTokenDelta(0, [], finish_reason="stop", stop_reason="\n\n")])]),
    "token_deltas_empty": TokenDeltas(step_id=0),
    "text_deltas": TextDeltas([
        RequestTextDelta("req-1", [SequenceTextDelta(
            0, " wörld🌍", [5, 6], token_texts=[" wö", "rld🌍"],
            logprobs=[-0.5, float("-inf")],
            top_token_ids=[[5], [6, 2]], top_token_texts=[[" wö"], ["rld🌍", "</s>"]],
            top_logprobs=[[-0.5], [-0.25, -3.0]], finish_reason="length", text_offset=41,
            token_offset=9)], Usage(12, 2), queue_time_s=0.5, num_cached_tokens=0),
        RequestTextDelta("req-2", [], Usage(0, 0))]),
    "text_deltas_empty": TextDeltas(),
    "request_accepted": RequestAccepted(["req-1", "req-ü"]),
    "request_accepted_none": RequestAccepted([]),
    "error": ErrorResponse("req-9", 400, "prompt is 9000 tokens, over the 8192 limit"),
    "error_no_request": ErrorResponse(None, 500, ""),
    "health_request": HealthRequest(),
    "health_response": HealthResponse("engine", "ok", {"running": 3, "kv_usage": 0.25,
                                                       "model": "smollm2", "draining": False,
                                                       "last_error": None}),
    "execute_prefill": ExecuteModelRequest(step_id=1, seq_group_metadata_list=[
        SequenceGroupMetadata("req-1", True, [SequenceData(7, 0, [1, 2, 3], [0, 5], reset=True)],
                              token_chunk_size=3, prompt_len=3, sampling_params=FULL_PARAMS,
                              eos_token_ids=[2], seed=99),
        SequenceGroupMetadata("req-2", True, [SequenceData(8, 0, [4] * 20, [1, 2], reset=True),
                                              SequenceData(9, 0, [], [], parent_seq_id=8,
                                                           sample_index=1)],
                              token_chunk_size=16, do_sample=False, prompt_len=20)],
        blocks_to_swap_in=[(1, 2)], blocks_to_swap_out=[(3, 4), (5, 6)],
        blocks_to_copy=[(7, 8)], finished_seq_ids=[2**40, 3]),
    "execute_empty": ExecuteModelRequest(step_id=0, seq_group_metadata_list=[]),
    "execute_decode": decode_step(1000, n=4, new_block=True),
    "sampler_output": SamplerOutput(
        step_id=4, seq_ids=[7, 8], token_ids=[11, 12], logprobs=[-0.5, -0.75],
        top_token_ids=[[11, 3], []], top_logprobs=[[-0.5, -1.0], []],
        prompt_logprobs=[PromptLogprobs(7, 1, [-2.5, -0.125], [[4], [5]], [[-2.0], [-0.125]])],
        model_time_s=0.01),
    "sampler_output_empty": SamplerOutput(step_id=0),
    "register": Register("worker", "host-123", rank=1),
    "worker_call": WorkerCall(5, "initialize_cache", [1024, 64]),
    "worker_reply": WorkerReply(5, [1024, 64]),
    "worker_reply_error": WorkerReply(6, [], "ValueError: no"),
    "token_deltas_first": TokenDeltas(step_id=1, requests=[RequestTokenDelta(
        "req-3", "gw-a", 4, [SequenceTokenDelta(0, [9])], sampling_params=FULL_PARAMS,
        prompt_tail_token_ids=[1, 2, 3], queue_time_s=0.25, num_cached_tokens=32)]),
}


@pytest.mark.parametrize("name", ROUND_TRIP_CASES)
def test_message_round_trips_equal(name):
    msg = ROUND_TRIP_CASES[name]
    assert decode(encode(msg)) == msg


def test_every_registered_message_type_has_a_round_trip_case():
    covered = {type(m) for m in ROUND_TRIP_CASES.values()}
    assert covered == set(codec._MESSAGES)


def test_message_tags_are_the_documented_ones():
    # Tags are the contract between deployed processes: renumbering one breaks a mixed rollout.
    assert {cls.__name__: codec.message_tag(cls) for cls in codec._MESSAGES} == {
        "GenerateRequest": 1, "EngineRequest": 2, "AbortRequest": 3, "FinishRequest": 4,
        "TokenDeltas": 5, "TextDeltas": 6, "ErrorResponse": 7, "HealthRequest": 8,
        "HealthResponse": 9, "RequestAccepted": 10, "ExecuteModelRequest": 16, "SamplerOutput": 17,
        "Register": 32, "WorkerCall": 33, "WorkerReply": 34}


def test_frame_is_a_compact_array_with_tag_and_version():
    frame = msgpack.unpackb(encode(AbortRequest(["r"], "x")))
    assert frame == [3, 1, ["r"], "x"]


def test_token_ids_travel_as_packed_little_endian_int32():
    frame = msgpack.unpackb(encode(SamplerOutput(step_id=1, seq_ids=[1], token_ids=[258],
                                                 logprobs=[-1.0])))
    assert frame[4] == b"\x02\x01\x00\x00"
    assert frame[5] == np.array([-1.0], dtype="<f4").tobytes()


def test_numpy_arrays_encode_like_lists():
    as_list = SamplerOutput(step_id=1, seq_ids=[3, 4], token_ids=[10, 20], logprobs=[-0.5, -1.5])
    as_numpy = SamplerOutput(step_id=1, seq_ids=np.array([3, 4]), token_ids=np.array([10, 20]),
                             logprobs=np.array([-0.5, -1.5], dtype=np.float32))
    assert encode(as_numpy) == encode(as_list)


def test_numpy_top_k_matrices_encode_like_lists_of_rows():
    as_lists = SamplerOutput(step_id=1, seq_ids=[3, 4], token_ids=[10, 20], logprobs=[-0.5, -1.5],
                             top_token_ids=[[10, 11], [20, 21]],
                             top_logprobs=[[-0.5, -2.0], [-1.5, -1.75]])
    as_numpy = SamplerOutput(step_id=1, seq_ids=[3, 4], token_ids=[10, 20], logprobs=[-0.5, -1.5],
                             top_token_ids=np.array([[10, 11], [20, 21]]),  # [samples, k]
                             top_logprobs=np.array([[-0.5, -2.0], [-1.5, -1.75]]))
    assert encode(as_numpy) == encode(as_lists)


def test_logprobs_are_rounded_to_float32():
    out = decode(encode(SamplerOutput(step_id=1, seq_ids=[1], token_ids=[1], logprobs=[-0.1])))
    assert out.logprobs == [float(np.float32(-0.1))]


def test_decode_with_expected_type_accepts_it():
    assert decode(encode(sampler_output(2)), expected=SamplerOutput) == sampler_output(2)
    either = (SamplerOutput, HealthRequest)
    assert decode(encode(HealthRequest()), expected=either) == HealthRequest()


def test_decode_of_other_than_expected_type_raises_unexpected():
    with pytest.raises(UnexpectedMessageType):
        decode(encode(HealthRequest()), expected=SamplerOutput)


# ---- steady decode step: size and speed ----------------------------------------------------------

def test_decode_step_bytes_do_not_depend_on_sequence_length():
    assert len(encode(decode_step(100))) == len(encode(decode_step(1000)))
    assert len(encode(decode_step(100, new_block=True))) == len(
        encode(decode_step(1000, new_block=True)))


def token_deltas(n: int = 64) -> TokenDeltas:
    return TokenDeltas(step_id=90210, requests=[
        RequestTokenDelta(f"cmpl-{i:032x}", "gw-0", 200,
                          [SequenceTokenDelta(0, [1000 + i], num_output_tokens=57)])
        for i in range(n)])


def test_per_step_message_timing():
    for name, msg in [("ExecuteModelRequest (64 groups, decode)", decode_step(1000)),
                      ("SamplerOutput (64 samples)", sampler_output(64)),
                      ("TokenDeltas (64 requests, 1 token)", token_deltas(64))]:
        reps = 300
        t0 = time.perf_counter()
        for _ in range(reps):
            data = encode(msg)
        t1 = time.perf_counter()
        for _ in range(reps):
            decoded = decode(data)
        t2 = time.perf_counter()
        assert decoded == msg
        print(f"\n{name}: {len(data)} bytes, encode {(t1 - t0) / reps * 1e6:.0f} us, "
              f"decode {(t2 - t1) / reps * 1e6:.0f} us")


# ---- bad frames ----------------------------------------------------------------------------------

def frame_of(*items) -> bytes:
    return msgpack.packb(list(items), use_bin_type=True)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\xff" * 7, b"\x00", b"hello world",
                                  bytes(range(256)), os.urandom(64)])
def test_random_bytes_raise_codec_error(data):
    with pytest.raises(CodecError):
        decode(data)


def test_every_truncation_of_a_frame_raises_malformed():
    data = encode(ROUND_TRIP_CASES["execute_prefill"])
    for cut in range(len(data)):
        with pytest.raises(MalformedMessage):
            decode(data[:cut])


def test_trailing_bytes_raise_malformed():
    with pytest.raises(MalformedMessage, match="msgpack"):
        decode(encode(HealthRequest()) + b"\x00")


def test_frame_that_is_not_an_array_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb({"tag": 3}))
    with pytest.raises(MalformedMessage):
        decode(msgpack.packb(3))


def test_frame_that_is_not_bytes_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode("not bytes")


def test_unknown_tag_raises_unknown_message_type():
    with pytest.raises(UnknownMessageType):
        decode(frame_of(99, 1, ["r1"], "gone"))


def test_tag_of_wrong_type_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode(frame_of("3", 1, ["r1"], "gone"))


def test_other_version_raises_unsupported_version():
    with pytest.raises(UnsupportedVersion):
        decode(frame_of(3, 2, ["r1"], "gone"))


@pytest.mark.parametrize("fields", [[["r1"]], [["r1"], "gone", "extra"], []])
def test_wrong_field_count_raises_malformed(fields):
    with pytest.raises(MalformedMessage, match="AbortRequest has 2 fields"):
        decode(frame_of(3, 1, *fields))


def test_wrong_field_type_raises_malformed_naming_the_field():
    with pytest.raises(MalformedMessage) as err:
        decode(frame_of(3, 1, ["r1", 7], "gone"))
    assert err.value.field == "request_ids[1]"


def test_wrong_nested_field_type_names_the_path():
    frame = msgpack.unpackb(encode(decode_step(100, n=3)))
    frame[3][2][2][0][0] = "seven"  # seq_group_metadata_list[2].seq_data[0].seq_id
    with pytest.raises(MalformedMessage) as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "seq_group_metadata_list[2].seq_data[0].seq_id"


def test_bool_for_int_field_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode(frame_of(7, 1, "r", True, "msg"))


def test_oversized_frame_raises_frame_too_large_before_unpacking():
    data = encode(GenerateRequest("r", "g", "x" * 5000, SamplingParams(), 0.0))
    with pytest.raises(FrameTooLarge):
        decode(data, max_frame_bytes=4096)
    with pytest.raises(FrameTooLarge):
        decode(b"\xc1" * 4097, max_frame_bytes=4096)  # would be malformed, but size comes first


def test_encoding_an_oversized_message_raises_frame_too_large():
    with pytest.raises(FrameTooLarge):
        encode(GenerateRequest("r", "g", "x" * 5000, SamplingParams(), 0.0), max_frame_bytes=4096)


def test_packed_array_of_bad_length_raises_malformed():
    frame = msgpack.unpackb(encode(sampler_output(4)))
    frame[4] = frame[4][:-1]  # token_ids: 15 bytes is not whole int32s
    with pytest.raises(MalformedMessage, match="multiple of 4") as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "token_ids"


def test_packed_lists_whose_lengths_do_not_match_values_raise_malformed():
    frame = msgpack.unpackb(encode(ROUND_TRIP_CASES["sampler_output"]))
    frame[6][0] = np.array([2, 5], dtype="<i4").tobytes()  # top_token_ids: 7 rows over 2 values
    with pytest.raises(MalformedMessage) as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "top_token_ids"


def test_packed_pairs_of_odd_length_raise_malformed():
    frame = msgpack.unpackb(encode(ROUND_TRIP_CASES["execute_prefill"]))
    frame[4] = np.array([1, 2, 3], dtype="<i4").tobytes()  # blocks_to_swap_in
    with pytest.raises(MalformedMessage, match="odd"):
        decode(msgpack.packb(frame, use_bin_type=True))


def test_fixed_width_count_of_wrong_size_raises_malformed():
    frame = msgpack.unpackb(encode(decode_step(100, n=1)))
    frame[3][0][2][0][1] = b"\x01\x00"  # num_computed_tokens
    with pytest.raises(MalformedMessage) as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "seq_group_metadata_list[0].seq_data[0].num_computed_tokens"


def test_invalid_sampling_params_raise_malformed_naming_the_parameter():
    frame = msgpack.unpackb(encode(GenerateRequest("r", "g", "hi", SamplingParams(), 0.0)))
    frame[5][4] = -1.0  # temperature
    with pytest.raises(MalformedMessage, match="temperature") as err:
        decode(msgpack.packb(frame, use_bin_type=True))
    assert err.value.field == "sampling_params.temperature"


def test_deep_nesting_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode(b"\x91" * 100_000 + b"\xc0")


def test_huge_declared_lengths_raise_malformed():
    for header in (b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                   b"\xdf\xff\xff\xff\xff"):
        with pytest.raises(MalformedMessage):
            decode(b"\x94\x03\x01" + header)


def test_ext_types_raise_malformed():
    with pytest.raises(MalformedMessage):
        decode(b"\x94\x03\x01\xd4\x05\x00\xa0")


def test_invalid_utf8_raises_malformed():
    with pytest.raises(MalformedMessage):
        decode(b"\x94\x03\x01\x91\xa2\xff\xfe\xa0")


def test_encoding_out_of_range_token_id_raises_malformed():
    with pytest.raises(MalformedMessage) as err:
        encode(SamplerOutput(step_id=1, seq_ids=[1], token_ids=[2**31], logprobs=[0.0]))
    assert err.value.field == "token_ids"


def test_encoding_a_field_of_wrong_type_raises_malformed():
    with pytest.raises(MalformedMessage) as err:
        encode(AbortRequest("r1", "gone"))  # a string, not a list of ids
    assert err.value.field == "request_ids"


def test_encoding_an_unregistered_class_raises_unknown_message_type():
    with pytest.raises(UnknownMessageType):
        encode(SequenceData(seq_id=1, num_computed_tokens=0))


# ---- properties ----------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_nothing_but_codec_error(data):
    try:
        decode(data)
    except CodecError:
        pass


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(ROUND_TRIP_CASES)), st.data())
def test_corrupted_valid_frames_raise_nothing_but_codec_error(name, data):
    frame = bytearray(encode(ROUND_TRIP_CASES[name]))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    try:
        decode(bytes(frame))
    except CodecError:
        pass


int32s = st.integers(-2**31, 2**31 - 1)
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=8)
float32s = st.floats(width=32, allow_nan=False)
sampling_params = st.builds(
    SamplingParams, n=st.just(1), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100), seed=st.none() | st.integers(0, 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=4), max_size=2), stop_token_ids=token_ids,
    max_tokens=st.none() | st.integers(1, 4096), logprobs=st.none() | st.integers(0, 20))
sequence_data = st.builds(
    SequenceData, seq_id=st.integers(0, 2**63 - 1), num_computed_tokens=st.integers(0, 2**31 - 1),
    new_token_ids=token_ids, block_ids=st.lists(int32s, max_size=8), reset=st.booleans(),
    parent_seq_id=st.integers(-1, 2**40), sample_index=st.integers(0, 8))
seq_group_metadata = st.builds(
    SequenceGroupMetadata, request_id=st.text(max_size=40), is_prompt=st.booleans(),
    seq_data=st.lists(sequence_data, max_size=3), token_chunk_size=st.integers(0, 2**31 - 1),
    do_sample=st.booleans(), prompt_len=st.integers(0, 2**31 - 1),
    sampling_params=st.none() | sampling_params, eos_token_ids=token_ids,
    seed=st.integers(-2**63, 2**64 - 1))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(seq_group_metadata, max_size=4),
       st.lists(st.tuples(int32s, int32s), max_size=3))
def test_seq_group_metadata_round_trips(groups, swaps):
    msg = ExecuteModelRequest(step_id=7, seq_group_metadata_list=groups, blocks_to_copy=swaps)
    assert decode(encode(msg)) == msg


@st.composite
def sampler_outputs(draw):
    n = draw(st.integers(0, 6))
    k = draw(st.integers(0, 3))
    asked = draw(st.booleans())
    return SamplerOutput(
        step_id=draw(st.integers(0, 2**63 - 1)),
        seq_ids=draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n)),
        token_ids=draw(st.lists(int32s, min_size=n, max_size=n)),
        logprobs=draw(st.lists(float32s, min_size=n, max_size=n)),
        top_token_ids=draw(st.lists(st.lists(int32s, min_size=k, max_size=k), min_size=n,
                                    max_size=n)) if asked else [],
        top_logprobs=draw(st.lists(st.lists(float32s, min_size=k, max_size=k), min_size=n,
                                   max_size=n)) if asked else [],
        prompt_logprobs=draw(st.lists(st.builds(
            PromptLogprobs, seq_id=st.integers(0, 2**40), start=st.integers(0, 2**31),
            token_logprobs=st.lists(float32s, max_size=3),
            top_token_ids=st.lists(st.lists(int32s, max_size=2), max_size=3),
            top_logprobs=st.lists(st.lists(float32s, max_size=2), max_size=3)), max_size=2)),
        model_time_s=draw(st.floats(allow_nan=False)))


@settings(max_examples=150, deadline=None)
@given(sampler_outputs())
def test_sampler_output_round_trips(msg):
    assert decode(encode(msg)) == msg
