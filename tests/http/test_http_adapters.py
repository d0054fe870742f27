"""The conversions without a server: validation errors → params, sampling names, finishes."""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest

from app.http.errors import ApiError, from_validation
from app.http.native_adapter import NativeAnswer
from app.http.outputs import check_finish, unpack_logprobs
from app.http.sampling import make_sampling
from app.http.schemas import ChatCompletionRequest
from app.ipc.messages import Finish, FinishReason, SamplingParams, TextOutput, TokenLogprobs, pack_tokens


def _validation_error(body: dict) -> ApiError:
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)
    return from_validation(caught.value)


def test_validation_error_names_nested_fields():
    wrong_type = _validation_error({"messages": [{"role": "user", "content": 5}]})
    missing = _validation_error({"messages": [{}]})

    assert (wrong_type.status, wrong_type.param) == (400, "messages[0].content")
    assert wrong_type.message.startswith("Expected `str | array | null`, got `int`")
    assert missing.param == "messages[0].role" and "missing required field `role`" in missing.message


def test_sampling_errors_use_the_clients_names():
    with pytest.raises(ApiError) as caught:
        make_sampling(SamplingParams(), {"max_new_tokens": -3}, client_names={"max_new_tokens": "max_tokens"}, vocab_size=10)

    assert caught.value.param == "max_tokens"
    assert caught.value.message == "max_tokens must be in [0, 2**31 - 1], got -3"


def test_sampling_keeps_defaults_for_fields_not_sent():
    defaults = SamplingParams(temperature=0.6, top_p=0.9)
    params = make_sampling(defaults, {"temperature": None, "top_p": 0.5}, client_names={}, vocab_size=None)

    assert (params.temperature, params.top_p) == (0.6, 0.5)


def test_stop_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ApiError) as caught:
        make_sampling(SamplingParams(), {"stop_token_ids": (12,)}, client_names={}, vocab_size=10)

    assert caught.value.param == "stop_token_ids" and "outside the vocabulary" in caught.value.message


def test_only_aborts_with_an_error_status_are_errors():
    check_finish(Finish(FinishReason.STOP))
    check_finish(Finish(FinishReason.ABORT, message="client asked", status_code=499))
    check_finish(Finish(FinishReason.ABORT))
    with pytest.raises(ApiError) as caught:
        check_finish(Finish(FinishReason.ABORT, message="The request queue is full.", status_code=503))

    assert (caught.value.status, caught.value.message) == (503, "The request queue is full.")


def test_unpack_logprobs_without_alternatives():
    packed = TokenLogprobs(chosen=array("f", [-1.0, -2.0]).tobytes())
    assert [tuple(lp) for lp in unpack_logprobs([5, 6], packed)] == [(5, -1.0, []), (6, -2.0, [])]
    assert unpack_logprobs([5], None) == []


def test_native_produced_at_is_null_when_the_backend_does_not_say():
    answer = NativeAnswer("r", arrival=0.0, want_logprobs=False)

    unknown = answer.add(TextOutput("r", "a", pack_tokens([97])))
    known = answer.add(TextOutput("r", "b", pack_tokens([98]), Finish(FinishReason.STOP), produced_at=12.5))

    assert (unknown.meta_info.produced_at, known.meta_info.produced_at) == (None, 12.5)
