"""The front end <-> engine core messages: every type survives a round trip field for field,
frames are plain msgpack maps (no pickle), and bad frames raise WireError saying what is wrong."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.channel import Encoder, WireError, WireVersionError
from sluice.core.outputs import EngineCoreOutput
from sluice.core.request import EngineCoreRequest, Request
from sluice.engine.stats import SchedulerStats
from sluice.engine.wire import (
    WIRE_VERSION,
    AbortRequests,
    AddRequest,
    EngineCoreOutputs,
    EngineDead,
    FinishRequests,
    Ready,
    RequestDecoder,
    ResponseDecoder,
    UtilityReply,
    UtilityRequest,
)
from sluice.sampling_params import SamplingParams

STATS = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25,
                       prefix_cache_queries=100, prefix_cache_hits=40,
                       num_preemptions_total=1, num_free_blocks=30, num_blocks=40)


def every_field_params() -> SamplingParams:
    params = SamplingParams(
        n=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, seed=11, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, stop=["END", "\n\n"],
        stop_token_ids=[7, 9], ignore_eos=True, max_tokens=33, min_tokens=2, logprobs=4,
        prompt_logprobs=1, skip_special_tokens=False, include_stop_str_in_output=True)
    params.all_stop_token_ids |= {2, 151645}
    return params


def round_trip_request(message: object) -> object:
    return RequestDecoder().decode(Encoder().encode(message))


def round_trip_response(message: object) -> object:
    return ResponseDecoder().decode(Encoder().encode(message))


def test_sampling_params_survive_the_wire_field_for_field() -> None:
    params = every_field_params()
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back == params  # struct equality: every field
    assert back.all_stop_token_ids == {2, 7, 9, 151645}
    assert back.stop == ["END", "\n\n"]


def test_bad_sampling_params_on_the_wire_fail_validation_naming_the_value() -> None:
    frame = msgspec.msgpack.encode({"temperature": -1.0})
    with pytest.raises(msgspec.ValidationError, match="temperature must be >= 0"):
        msgspec.msgpack.decode(frame, type=SamplingParams)


def test_engine_core_request_round_trip_rebuilds_the_request() -> None:
    sent = EngineCoreRequest(request_id="0_req-1", prompt_token_ids=[5, 6, 7],
                             sampling_params=every_field_params(), eos_token_ids={2, 3},
                             arrival_time=123.5, max_tokens=33,
                             kv_transfer_params={"do_remote_decode": True})
    message = round_trip_request(AddRequest(request=sent))
    assert isinstance(message, AddRequest)
    assert message.version == WIRE_VERSION
    assert message.request == sent
    rebuilt = Request.from_engine_core_request(message.request)
    assert rebuilt.request_id == "0_req-1"
    assert rebuilt.prompt_token_ids == [5, 6, 7]
    assert rebuilt.sampling_params == sent.sampling_params
    assert rebuilt.sampling_params.all_stop_token_ids == {2, 7, 9, 151645}
    assert rebuilt.eos_token_ids == {2, 3}
    assert rebuilt.arrival_time == 123.5 and rebuilt.max_tokens == 33
    assert rebuilt.kv_transfer_params == {"do_remote_decode": True}


@pytest.mark.parametrize("message", [
    AbortRequests(request_ids=["a", "0_b", "1_b"]),
    FinishRequests(request_ids=["x"]),
    UtilityRequest(call_id=7, name="stats"),
])
def test_control_messages_round_trip(message: object) -> None:
    assert round_trip_request(message) == message


@pytest.mark.parametrize("message", [
    Ready(num_blocks=8191, block_size=16, max_model_len=4096, pid=1234),
    EngineDead(error="IndexError: index out of range", traceback="Traceback ...\n"),
    UtilityReply(call_id=1, result=STATS),
    UtilityReply(call_id=2, result=True),
    UtilityReply(call_id=3, result=False),
    UtilityReply(call_id=4, result=None, error="check_integrity failed: block 3 ..."),
    EngineCoreOutputs(outputs=[], scheduler_stats=STATS, timestamp=1.5),
    EngineCoreOutputs(outputs=[], scheduler_stats=None),
])
def test_response_messages_round_trip(message: object) -> None:
    back = round_trip_response(message)
    assert back == message and type(back) is type(message)


def test_engine_core_outputs_round_trip_logprobs_and_stats() -> None:
    outputs = [
        EngineCoreOutput("a", [11, 12], new_logprobs=[{11: (-0.5, 1), 40: (-1.5, 2)},
                                                      {12: (-3.25, 4), 40: (-0.1, 1)}],
                         new_prompt_logprobs=[None, {6: (-2.0, 3), 1: (-0.25, 1)}],
                         num_cached_tokens=16, first_scheduled_time=10.25),
        EngineCoreOutput("b", [2], finish_reason="stop", stop_reason=None),
        EngineCoreOutput("c", [9], finish_reason="stop", stop_reason=9),
        EngineCoreOutput("d", [], finish_reason="stop", stop_reason="END"),
        EngineCoreOutput("e", [], finish_reason="abort"),
        EngineCoreOutput("f", [], finish_reason="error", stop_reason="KV load failed",
                         kv_transfer_params={"remote_block_ids": [1, 2]}),
    ]
    message = EngineCoreOutputs(outputs=outputs, scheduler_stats=STATS, timestamp=99.0)
    back = round_trip_response(message)
    assert isinstance(back, EngineCoreOutputs)
    assert back.outputs == outputs
    assert back.scheduler_stats == STATS
    assert back.scheduler_stats.prefix_cache_hit_rate == 0.4
    # Logprob dicts keep the engine's order (the chosen token need not rank first).
    assert list(back.outputs[0].new_logprobs[1]) == [12, 40]


position = st.dictionaries(st.integers(0, 200_000),
                           st.tuples(st.floats(-1e4, 0.0), st.integers(1, 200_000)),
                           min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(req_id=st.text(min_size=1, max_size=20), tokens=st.lists(st.integers(0, 2**31 - 1)),
       logprobs=st.none() | st.lists(position, max_size=4),
       prompt_logprobs=st.none() | st.lists(st.none() | position, max_size=4),
       finish=st.sampled_from([None, "stop", "length", "abort"]),
       stop_reason=st.none() | st.integers(0, 10**6) | st.text(min_size=1, max_size=5))
def test_any_engine_core_output_round_trips(req_id, tokens, logprobs, prompt_logprobs,  # noqa: ANN001
                                            finish, stop_reason) -> None:  # noqa: ANN001
    out = EngineCoreOutput(req_id, tokens, finish_reason=finish, stop_reason=stop_reason,
                           new_logprobs=logprobs, new_prompt_logprobs=prompt_logprobs)
    message = EngineCoreOutputs(outputs=[out])
    assert round_trip_response(message).outputs[0] == out


def test_frames_are_plain_msgpack_maps_with_type_and_version() -> None:
    frame = Encoder().encode(AbortRequests(request_ids=["a"]))
    assert msgspec.msgpack.decode(frame) == {"type": "abort", "version": WIRE_VERSION,
                                             "request_ids": ["a"]}


def _frame(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


def test_another_schema_version_is_refused_with_both_versions_named() -> None:
    same_shape = _frame(type="abort", version=WIRE_VERSION + 1, request_ids=["a"])
    with pytest.raises(WireVersionError, match=rf"version {WIRE_VERSION + 1}.*version "
                                               rf"{WIRE_VERSION}"):
        RequestDecoder().decode(same_shape)
    # A newer schema that also changed the message's fields still reads as a version error.
    new_shape = _frame(type="abort", version=WIRE_VERSION + 1, ids=["a"], reason="x")
    with pytest.raises(WireVersionError, match="different sluice versions"):
        RequestDecoder().decode(new_shape)
    old = _frame(type="ready", version=0, num_blocks=1, block_size=16, max_model_len=8, pid=1)
    with pytest.raises(WireVersionError, match="version 0"):
        ResponseDecoder().decode(old)


@pytest.mark.parametrize(("frame", "match"), [
    (b"", "malformed request frame"),
    (b"\xc1garbage", "malformed request frame"),
    (Encoder().encode(AbortRequests(request_ids=["a"]))[:-3], "malformed request frame"),
    (_frame(type="launch_missiles", version=WIRE_VERSION), r"Invalid value 'launch_missiles'"),
    (_frame(type="abort", version=WIRE_VERSION, request_ids=[1, 2]), r"Expected `str`"),
    (_frame(type="abort", version=WIRE_VERSION), "missing required field `request_ids`"),
    (_frame(type="abort", version=WIRE_VERSION, request_ids=[], extra=1), "unknown field"),
    (msgspec.msgpack.encode([1, 2, 3]), "malformed request frame"),
    # A response is not a request.
    (Encoder().encode(Ready(num_blocks=1, block_size=1, max_model_len=1, pid=1)),
     "Invalid value 'ready'"),
])
def test_malformed_frames_raise_wire_error_saying_what_is_wrong(frame: bytes,
                                                                match: str) -> None:
    with pytest.raises(WireError, match=match):
        RequestDecoder().decode(frame)


def test_malformed_logprobs_are_refused_at_decode() -> None:
    frame = _frame(type="outputs", version=WIRE_VERSION,
                   outputs=[{"req_id": "a", "new_token_ids": [1],
                             "new_logprobs": [{1: [-0.5]}]}])
    with pytest.raises(WireError, match="malformed response frame"):
        ResponseDecoder().decode(frame)
