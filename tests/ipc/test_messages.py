"""The protocol: every message round-trips, each channel decodes only its own union."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.ipc import messages as m

token_lists = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300)
sampling = st.builds(
    m.SamplingParams,
    max_new_tokens=st.integers(0, 4096),
    temperature=st.floats(0, 2),
    top_p=st.floats(0.01, 1),
    top_k=st.integers(-1, 100),
    seed=st.none() | st.integers(0, 2**62),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3).map(tuple),
    stop_token_ids=st.lists(st.integers(0, 1000), max_size=3).map(tuple),
)
finishes = st.none() | st.builds(
    m.Finish,
    reason=st.sampled_from(list(m.FinishReason)),
    matched=st.none() | st.text(max_size=4) | st.integers(0, 10**6),
    message=st.none() | st.text(max_size=20),
)
to_scheduler = st.one_of(
    st.builds(m.TokenizedRequest, rid=st.text(max_size=40), input_ids=token_lists.map(m.pack_tokens), sampling=sampling),
    st.builds(m.AbortRequest, rid=st.none() | st.text(max_size=10)),
    st.builds(m.ControlRequest, id=st.integers(0, 2**40), kind=st.sampled_from(list(m.ControlKind))),
    st.builds(m.StopStringHit, rid=st.text(max_size=10), stop=st.text(min_size=1, max_size=5)),
)
to_ingress = st.one_of(
    st.builds(
        m.TextBatch,
        outputs=st.lists(
            st.builds(m.TextOutput, rid=st.text(max_size=8), text=st.text(max_size=50),
                      token_ids=token_lists.map(m.pack_tokens), finish=finishes),
            max_size=5,
        ).map(tuple),
    ),
    st.builds(m.RequestRejected, rid=st.text(max_size=8), message=st.text(max_size=30)),
)


@settings(max_examples=200, deadline=None)
@given(message=to_scheduler)
def test_scheduler_messages_round_trip(message):
    decoder = msgspec.msgpack.Decoder(m.ToScheduler)
    assert decoder.decode(msgspec.msgpack.encode(message)) == message


@settings(max_examples=100, deadline=None)
@given(message=to_ingress)
def test_ingress_messages_round_trip(message):
    decoder = msgspec.msgpack.Decoder(m.ToIngress)
    assert decoder.decode(msgspec.msgpack.encode(message)) == message


@given(tokens=token_lists)
def test_token_ids_pack_as_four_bytes_each(tokens):
    packed = m.pack_tokens(tokens)
    assert len(packed) == 4 * len(tokens)
    assert m.unpack_tokens(packed) == tokens


def test_unpack_rejects_a_partial_token():
    with pytest.raises(ValueError, match="multiple of 4"):
        m.unpack_tokens(b"\x01\x02\x03")


def test_a_channel_refuses_messages_of_another_channel():
    wrong = msgspec.msgpack.encode(m.RequestRejected("r", "too long"))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(m.ToScheduler).decode(wrong)


def test_unknown_tag_is_a_validation_error():
    forged = msgspec.msgpack.encode(["NoSuchMessage", "r"])
    with pytest.raises(msgspec.ValidationError, match="NoSuchMessage"):
        msgspec.msgpack.Decoder(m.ToScheduler).decode(forged)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (m.SamplingParams(temperature=-1), "temperature"),
        (m.SamplingParams(top_p=0), "top_p"),
        (m.SamplingParams(top_k=-5), "top_k"),
        (m.SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        (m.SamplingParams(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
        (m.SamplingParams(repetition_penalty=0), "repetition_penalty"),
        (m.SamplingParams(stop=("",)), "stop"),
        (m.SamplingParams(top_logprobs=50), "top_logprobs"),
    ],
)
def test_sampling_params_validation_names_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        params.validate()


def test_stop_token_ids_are_checked_against_the_vocabulary():
    m.SamplingParams(stop_token_ids=(5,)).validate(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        m.SamplingParams(stop_token_ids=(10,)).validate(vocab_size=10)


@given(ids=st.lists(st.integers(-(2**40), 2**40), max_size=60), vocab=st.integers(1, 2**31))
def test_first_outside_vocab_names_the_first_id_a_loop_would(ids, vocab):
    expected = next((t for t in ids if not 0 <= t < vocab), None)
    assert m.first_outside_vocab(ids, vocab) == expected
