"""The scheduling managers on their own, without a model: the waiting queue's admission
checks and order, the prefill budget, the retraction order, the running batch's leavers and
sampling rows, and the outputs a request reports. The whole step over a real model is in
test_engine_behaviour.py and test_overlap_schedule.py."""

from __future__ import annotations

import pytest
import torch

from app.engine.forward_batch import ForwardMode
from app.engine.request import Request, Status
from app.engine.scheduling import AdmissionError, QueueFullError
from app.engine.scheduling.batch import ScheduledBatch
from app.engine.scheduling.prefill import PrefillBudget
from app.engine.scheduling.reporting import OutputReporter
from app.engine.scheduling.retraction import retraction_order
from app.engine.scheduling.running import RunningBatch
from app.engine.scheduling.waiting import Priorities, WaitingQueue
from app.ipc.messages import Finish, FinishReason, SamplingParams, unpack_tokens

VOCAB = 32


def request(rid: str, prompt_len: int, *, outputs: int = 0, max_new_tokens: int = 8, **params) -> Request:  # noqa: ANN003
    req = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=max_new_tokens, **params), seed=1)
    req.output_ids = [7] * outputs
    req.max_len = 64
    return req


def test_the_queue_refuses_what_can_never_run_and_keeps_its_order():
    queue = WaitingQueue(context_len=16, kv_capacity=10)
    with pytest.raises(AdmissionError, match="the prompt is empty"):
        queue.check(request("empty", 0))
    with pytest.raises(AdmissionError, match=r"\(16 tokens\) is longer than the model's context length \(16 tokens\)"):
        queue.check(request("long", 16))
    with pytest.raises(AdmissionError, match=r"\(10 tokens\) does not fit in the KV cache \(10 tokens\)"):
        queue.check(request("big", 10, max_new_tokens=1))
    queue.check(request("fits", 9, max_new_tokens=1))  # nine tokens and the one to generate: the whole pool
    a, b, retracted = request("a", 3), request("b", 3), request("retracted", 3)
    queue.push(a)
    queue.push(b)
    queue.push_front(retracted)  # a retracted request is recomputed first
    assert [r.rid for r in queue] == ["retracted", "a", "b"] and len(queue) == 3
    assert queue.remove(a) and not queue.remove(a)
    assert queue.peek() is retracted and queue.pop() is retracted and [r.rid for r in queue] == ["b"]


def test_asking_past_the_context_is_refused_unless_left_out_or_truncation_is_allowed():
    strict = WaitingQueue(context_len=16, kv_capacity=100)
    with pytest.raises(AdmissionError, match=r"maximum context length is 16 tokens\. However, you requested 17 tokens "
                                             r"\(9 in the prompt, 8 for the completion\)"):
        strict.check(request("over", 9))
    strict.check(request("exact", 8))  # prompt + max_new_tokens == the context: fits
    strict.check(request("left out", 9, max_new_tokens_given=False))  # may run to the context
    WaitingQueue(context_len=16, kv_capacity=100, allow_auto_truncate=True).check(request("cut", 9))


def test_a_full_queue_refuses_arrivals_but_takes_back_retracted_requests():
    queue = WaitingQueue(context_len=64, kv_capacity=100, max_queued=2)
    for rid in ("a", "b"):
        queue.check(request(rid, 3))
        queue.push(request(rid, 3))
    with pytest.raises(QueueFullError, match=r"^The request queue is full\.$"):
        queue.check(request("c", 3))
    with pytest.raises(AdmissionError, match="longer than the model's context"):  # never runs: 400 first
        queue.check(request("long", 64))
    queue.push_front(request("retracted", 3))  # admitted once: back in without the check
    assert len(queue) == 3
    queue.pop(), queue.pop()
    queue.check(request("d", 3))  # room again
    WaitingQueue(context_len=64, kv_capacity=100).check(request("unbounded", 3))


def test_a_chunked_budget_cuts_only_the_step_s_last_prompt():
    budget = PrefillBudget.for_step(max_prefill_tokens=100, chunk_size=10, available_kv=1000, running=[],
                                    free_rows=4, new_token_ratio=0.5)
    assert budget.take(request("a", 4), needs_row=True, alone=True) == 4
    assert budget.take(request("b", 20), needs_row=True, alone=False) == 6  # the chunk's rest
    assert budget.compute_tokens == 0 and budget.rows == 2 and budget.taken == 2
    assert budget.kv_tokens == 1000 - (4 + 4) - (20 + 4)  # whole prompts, and half of 8 new tokens each
    assert budget.take(request("c", 2), needs_row=True, alone=False) == 0


def test_without_chunking_only_the_first_prompt_may_exceed_the_step():
    budget = PrefillBudget.for_step(max_prefill_tokens=8, chunk_size=None, available_kv=1000, running=[],
                                    free_rows=4, new_token_ratio=0.0)
    assert budget.take(request("long", 20), needs_row=True, alone=True) == 20
    assert budget.take(request("short", 2), needs_row=True, alone=False) == 0


def test_the_reserve_for_running_requests_holds_back_a_prompt_unless_it_runs_alone():
    running = [request("r", 4, max_new_tokens=40)]  # reserves 40 of the 50 slots
    budget = PrefillBudget.for_step(max_prefill_tokens=100, chunk_size=None, available_kv=50, running=running,
                                    free_rows=4, new_token_ratio=1.0, page_size=1)
    assert budget.kv_tokens == 10
    assert budget.take(request("p", 8, max_new_tokens=8), needs_row=True, alone=False) == 0
    assert budget.take(request("p", 8, max_new_tokens=8), needs_row=True, alone=True) == 8  # progress first
    full = PrefillBudget.for_step(max_prefill_tokens=100, chunk_size=None, available_kv=50, running=[],
                                  free_rows=0, new_token_ratio=1.0)
    assert full.take(request("p", 8), needs_row=True, alone=True) == 0  # no request row left


def test_retraction_takes_the_least_work_lost_then_the_most_memory_back():
    reqs = [request("many", 4, outputs=9), request("short", 2, outputs=1), request("long", 12, outputs=1)]
    assert [r.rid for r in retraction_order(reqs)] == ["long", "short", "many"]


@pytest.mark.parametrize("low_values_first", [False, True])
def test_with_priorities_retraction_takes_the_least_important_first(low_values_first):
    reqs = [request("many", 4, outputs=9), request("short", 2, outputs=1), request("long", 12, outputs=1)]
    reqs[0].priority, reqs[1].priority, reqs[2].priority = 0, 5, 5  # "many": the least important by default
    if low_values_first:
        reqs[0].priority = 9  # the least important again, now that smaller values come first
    order = retraction_order(reqs, Priorities(enabled=True, low_values_first=low_values_first))
    assert [r.rid for r in order] == ["many", "long", "short"]
    assert [r.rid for r in retraction_order(reqs, Priorities())] == ["long", "short", "many"]  # off: no effect


def test_leavers_go_with_one_filter_of_the_sampling_rows():
    running = RunningBatch(vocab_size=VOCAB, eos_token_ids=[3], record_kernel=False)
    reqs = [request(f"r{i}", 3, temperature=0.0) for i in range(4)]
    for r in reqs:
        r.status = Status.PREFILLING
    batch = ScheduledBatch(ForwardMode.EXTEND, reqs, [3] * 4, [True] * 4)
    logits = torch.full((4, VOCAB), -10.0)
    for i in range(4):
        logits[i, 10 + i] = 10.0  # greedy row i picks token 10 + i
    sampled = running.sample_joiners(batch, logits)
    assert sampled is not None and sampled.token_ids.tolist() == [10, 11, 12, 13]
    reqs[3].status = Status.FINISHED  # aborted while its prefill was in flight
    running.join(reqs)
    assert len(running) == 4 and running.active() == 3 and reqs[3] in running.leavers
    assert [r.status for r in reqs[:3]] == [Status.RUNNING] * 3
    running.leave(reqs[1])
    assert running.staying() == [reqs[0], reqs[2]]
    assert running.flush_leavers() == [0, 2] and running.reqs == [reqs[0], reqs[2]] and len(running.sampling) == 2
    assert running.flush_leavers() is None  # nobody left since
    decode = running.decode_batch()
    assert decode.mode is ForwardMode.DECODE and decode.reqs == running.reqs and decode.reqs is not running.reqs
    assert decode.extend_lens == [1, 1] and decode.samples == [True, True] and decode.input_ids is None
    sampled = running.sample_decode(logits[[1, 3]], None)  # row order: r0 then r2
    assert sampled.token_ids.tolist() == [11, 13]
    for r in running.reqs:
        running.leave(r)
    assert running.flush_leavers() == [] and running.sampling is None and not running


def test_a_request_reports_usage_first_and_last_and_each_token_once():
    reporter = OutputReporter()
    req = request("s", 5, logprobs=True, top_logprobs=1, stop=("end",))
    req.output_ids = [21, 22]
    req.pending_logprobs, req.pending_top_ids, req.pending_top_logprobs = [-0.5, -1.5], [[21], [9]], [[-0.5], [-0.25]]
    reporter.report(req)
    req.output_ids.append(23)
    req.pending_logprobs, req.pending_top_ids, req.pending_top_logprobs = [-2.0], [[23]], [[-2.0]]
    reporter.report(req)
    req.finish = Finish(FinishReason.LENGTH)
    reporter.report(req)
    reporter.refuse("bad", "no such thing", 400)
    first, middle, last, refused = reporter.take()
    assert reporter.take() == [] and reporter.pending == []
    assert unpack_tokens(first.token_ids) == [21, 22] and unpack_tokens(middle.token_ids) == [23]
    assert unpack_tokens(last.token_ids) == [] and last.finish == Finish(FinishReason.LENGTH)
    assert first.usage is not None and (first.usage.prompt_tokens, first.usage.completion_tokens) == (5, 2)
    assert middle.usage is None and last.usage is not None and last.usage.completion_tokens == 3
    assert first.text_params is not None and first.text_params.stop == ("end",)
    assert unpack_tokens(first.text_params.prompt_tail) == [1, 2, 3, 4, 5]
    assert middle.text_params is None and last.text_params is None
    assert first.logprobs is not None and first.logprobs.k == 1 and middle.logprobs is not None
    assert last.logprobs is None and req.pending_logprobs == []  # nothing pending: none sent
    assert refused.rid == "bad" and refused.token_ids == b"" and refused.finish is not None
    assert (refused.finish.reason, refused.finish.message, refused.finish.status_code) == (
        FinishReason.ABORT, "no such thing", 400)
