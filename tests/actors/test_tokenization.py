"""The tokenizer actor's work on prompts of token ids: checked, and passed on as they came."""

from __future__ import annotations

import msgspec
import pytest

from app.actors.tokenizer import Tokenization
from app.ipc.messages import GenerateRequest, RequestRejected, SamplingParams, TokenizedRequest, pack_tokens

VOCAB = 1000


def tokenize(ids: list[int], context_len: int = 64, field: str = "input_ids") -> TokenizedRequest | RequestRejected:
    # Token ids never reach the tokenizer library: no tokenizer is needed here.
    work = Tokenization(None, context_len=context_len, vocab_size=VOCAB)  # type: ignore[arg-type]
    request = GenerateRequest("r", SamplingParams(max_new_tokens=4), stream=True, input_ids=pack_tokens(ids),
                              priority=3, arrival_time=12.5, prompt_field=field)
    return work(request)


def test_ids_inside_the_vocabulary_travel_on_unchanged():
    ids = [0, 5, VOCAB - 1, 17]
    result = tokenize(ids)
    assert isinstance(result, TokenizedRequest)
    assert result.input_ids == pack_tokens(ids)
    assert (result.rid, result.stream, result.priority, result.arrival_time) == ("r", True, 3, 12.5)
    assert result.sampling == SamplingParams(max_new_tokens=4)


@pytest.mark.parametrize(("ids", "bad"), [([1, VOCAB, -1], VOCAB), ([1, -3, VOCAB + 5], -3), ([2**31 - 1], 2**31 - 1)])
def test_the_first_id_outside_the_vocabulary_is_named(ids, bad):
    result = tokenize(ids)
    assert isinstance(result, RequestRejected) and result.status_code == 400 and result.param == "input_ids"
    assert result.message == f"token id {bad} is outside the vocabulary [0, {VOCAB})"


def test_empty_and_too_long_prompts_are_rejected():
    empty, too_long = tokenize([]), tokenize([1] * 64, context_len=64)
    assert isinstance(empty, RequestRejected) and "empty" in empty.message
    assert isinstance(too_long, RequestRejected) and "(64 tokens)" in too_long.message


@pytest.mark.parametrize("field", ["prompt", "prompt[3]", "input_ids", "messages", "text"])
def test_a_rejection_names_the_prompt_as_the_client_did(field):
    too_long = tokenize([1] * 64, context_len=64, field=field)
    outside = tokenize([VOCAB], field=field)
    assert isinstance(too_long, RequestRejected) and too_long.param == field
    assert isinstance(outside, RequestRejected) and outside.param == field


def test_asking_past_the_context_is_refused_naming_the_client_s_field_unless_truncation_is_allowed():
    asked = GenerateRequest("r", SamplingParams(max_new_tokens=100), input_ids=pack_tokens([1, 2, 3]),
                            max_tokens_field="max_completion_tokens")
    refused = Tokenization(None, context_len=64, vocab_size=VOCAB)(asked)  # type: ignore[arg-type]
    assert isinstance(refused, RequestRejected) and refused.status_code == 400
    assert refused.param == "max_completion_tokens"
    assert refused.message.startswith("This model's maximum context length is 64 tokens. However, you requested "
                                      "103 tokens (3 in the prompt, 100 for the completion).")
    truncating = Tokenization(None, context_len=64, vocab_size=VOCAB, allow_auto_truncate=True)  # type: ignore[arg-type]
    assert isinstance(truncating(asked), TokenizedRequest)
    left_out = msgspec.structs.replace(asked, sampling=SamplingParams(max_new_tokens=100, max_new_tokens_given=False))
    assert isinstance(Tokenization(None, context_len=64, vocab_size=VOCAB)(left_out), TokenizedRequest)  # type: ignore[arg-type]
