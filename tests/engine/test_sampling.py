"""Batched sampling: determinism per seed, greedy, distributions, filters, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from app.engine.sampling import SamplingBatch, request_seed, uniform_from_seed
from app.ipc.messages import SamplingParams as SP

V = 64
EOS = 3


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param


def logits_stream(
    steps: int, rows: int, vocab: int = V, seed: int = 0, scale: float = 3.0, device: str = "cpu"
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, vocab, generator=g) * scale).to(device) for _ in range(steps)]


def build(params: list[SP], seeds: list[int] | None = None, **kwargs) -> SamplingBatch:  # noqa: ANN003
    seeds = seeds if seeds is not None else list(range(len(params)))
    kwargs.setdefault("prompt_ids", [[1, 2, 2, 5]] * len(params))
    kwargs.setdefault("eos_token_ids", [EOS])
    return SamplingBatch.build(params, seeds, vocab_size=kwargs.pop("vocab_size", V), **kwargs)


def chi_square_p_value(observed: list[int], probs: list[float]) -> float:
    """Pearson's test; P(chi2_{k-1} >= stat) through the regularised upper incomplete gamma."""
    n = sum(observed)
    stat = sum((o - n * p) ** 2 / (n * p) for o, p in zip(observed, probs))
    df = len(observed) - 1
    a, x = torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, x))


# ---------------------------------------------------------------- randomness


def test_uniforms_are_a_pure_function_of_seed_and_step(device: str) -> None:
    seeds = torch.arange(50_000, dtype=torch.int64) * 7919 + 2**62
    steps = torch.arange(50_000, dtype=torch.int64) % 13
    u = uniform_from_seed(seeds, steps)
    assert torch.equal(uniform_from_seed(seeds.to(device), steps.to(device)).cpu(), u)  # same bits on every device
    assert torch.equal(u, uniform_from_seed(seeds, steps))
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u, uniform_from_seed(seeds, steps + 1))
    counts = torch.histc(u, bins=10, min=0.0, max=1.0).long().tolist()
    assert chi_square_p_value(counts, [0.1] * 10) > 1e-4


def test_request_seed() -> None:
    assert request_seed(SP(seed=123)) == 123
    drawn = {request_seed(SP()) for _ in range(4)}
    assert len(drawn) == 4 and all(0 <= s < 2**63 for s in drawn)


MIXED = [
    SP(temperature=0.8, top_p=0.9, top_k=20, frequency_penalty=0.5, repetition_penalty=1.3),
    SP(temperature=0.0),
    SP(top_p=0.7),  # top-p without top-k: the batch sorts whole rows
    SP(min_p=0.2, presence_penalty=-0.5, logprobs=True, top_logprobs=4),
    SP(top_k=1, temperature=1.5),
    SP(temperature=1.2, min_new_tokens=3, stop_token_ids=(7, 9)),
]


def run(batch: SamplingBatch, stream: list[torch.Tensor]) -> list[list[int]]:
    return [batch.sample(logits).token_ids.tolist() for logits in stream]


def test_seeded_runs_repeat_exactly(device: str) -> None:
    stream = logits_stream(12, len(MIXED), device=device)
    first = run(build(MIXED, seeds=[11, 12, 13, 14, 15, 16], device=device), stream)
    assert first == run(build(MIXED, seeds=[11, 12, 13, 14, 15, 16], device=device), stream)
    assert first != run(build(MIXED, seeds=[21, 22, 23, 24, 25, 26], device=device), stream)


@pytest.mark.parametrize("target", [MIXED[0], MIXED[2], MIXED[3], MIXED[5], SP(temperature=0.9)])
def test_seeded_row_is_independent_of_batch_and_position(target: SP, device: str) -> None:
    """The same request (seed 7) alone, then at row 3 of a mixed batch whose members change
    (filter and merge mid-run): identical tokens."""
    steps = 10
    own = logits_stream(steps, 1, seed=5, device=device)
    alone = build([target], seeds=[7], device=device)
    expected = [alone.sample(l).token_ids.item() for l in own]

    others = logits_stream(steps, 8, seed=6, device=device)
    batch = build(MIXED[:3] + [target] + MIXED[3:], seeds=[1, 2, 3, 7, 4, 5, 6], device=device)
    got = []
    pos = 3
    for t in range(steps):
        n = len(batch)
        logits = others[t][:n].clone()
        logits[pos] = own[t][0]
        got.append(batch.sample(logits).token_ids[pos].item())
        if t == 3:  # two requests before it finish, one after it
            batch.filter([0, 3, 4, 6])
            pos = 1
        if t == 6:  # new requests join, with and without [B, V] penalty tables
            joining = [SP(frequency_penalty=1.0), SP(temperature=0.0), SP(top_k=5)]
            batch.merge(build(joining, seeds=[30, 31, 32], device=device))
    assert got == expected


# ---------------------------------------------------------------- greedy and distributions


def test_top_k_1_equals_greedy_equals_argmax(device: str) -> None:
    stream = logits_stream(6, 5, scale=5.0, device=device)
    params = [
        SP(temperature=0.0), SP(top_k=1), SP(top_k=1, temperature=3.0), SP(temperature=0.0, top_p=0.5), SP(top_k=1, seed=3)
    ]
    batch = build(params, device=device)
    for logits in stream:
        out = batch.sample(logits).token_ids
        assert out.tolist() == [int(logits[i].argmax()) for i in range(len(params))]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_sample_as_their_float32_upcast(device: str, dtype: torch.dtype) -> None:
    """Decode graphs hand sampling logits in the model dtype. An all-greedy batch takes their
    argmax as they are; any other batch upcasts first. Either way the picks, stops and logprobs
    equal those of the float32 upcast, ties included (coarse values make many)."""
    cases = [
        [SP(temperature=0.0), SP(temperature=0.0, stop_token_ids=(7,))],  # the direct argmax
        [SP(temperature=0.0), SP(temperature=0.9, seed=4)],  # mixed: upcast, then as before
        [SP(temperature=0.0, logprobs=True, top_logprobs=2), SP(temperature=0.0, frequency_penalty=0.5)],
        [SP(temperature=0.0, min_new_tokens=3)],
    ]
    for params in cases:
        half, full = build(params, device=device), build(params, device=device)
        for step, logits in enumerate(logits_stream(5, len(params), scale=2.0, seed=11, device=device)):
            coarse = (logits * 4).round().to(dtype)  # ties in most rows
            got, want = half.sample(coarse), full.sample(coarse.float())
            assert got.token_ids.tolist() == want.token_ids.tolist(), (params, step)
            assert got.stopped.tolist() == want.stopped.tolist() and got.length_capped.tolist() == want.length_capped.tolist()
            assert (got.logprobs is None) == (want.logprobs is None)
            if want.logprobs is not None:
                assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.top_ids, want.top_ids)


def test_temperature_sampling_matches_softmax(device: str) -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device=device)
    temperature = 0.7
    probs = torch.softmax(logits[0].cpu().double() / temperature, -1).tolist()
    n = 20_000
    plain = dict(vocab_size=6, eos_token_ids=[], prompt_ids=None, device=device)
    batch = build([SP(temperature=temperature)] * n, seeds=list(range(n)), **plain)
    tokens = batch.sample(logits.expand(n, -1)).token_ids
    observed = torch.bincount(tokens.cpu(), minlength=6).tolist()
    assert chi_square_p_value(observed, probs) > 1e-3, observed

    # One request's stream over steps is just as well distributed.
    rows, steps = 50, 200
    batch = build([SP(temperature=temperature)] * rows, seeds=[10_000 + i for i in range(rows)], **plain)
    seen = Counter()
    for _ in range(steps):
        seen.update(batch.sample(logits.expand(rows, -1)).token_ids.tolist())
    assert chi_square_p_value([seen[i] for i in range(6)], probs) > 1e-3, seen


def allowed_tokens(logits: torch.Tensor, p: SP, slack: float = 1e-5) -> set[int]:
    """The tokens top-k, then top-p (of the renormalised top-k mass), then min-p leave, computed
    in float64 with plain Python; tokens within ``slack`` of a cut count as allowed."""
    probs = torch.softmax(logits.double() / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    k = p.top_k if p.top_k > 0 else len(probs)
    top = order[:k]
    mass = sum(probs[i] for i in top)
    kept, before = set(), 0.0
    for i in top:
        if before < p.top_p * mass + slack:
            kept.add(i)
        before += probs[i]
    pmax = probs[order[0]]
    return {i for i in kept if probs[i] >= p.min_p * pmax - slack}


@pytest.mark.parametrize(
    "params",
    [
        SP(top_k=4),
        SP(top_p=0.5),
        SP(min_p=0.3),
        SP(top_k=10, top_p=0.6, min_p=0.05, temperature=0.7),
        SP(top_p=0.95, temperature=2.0),
    ],
)
def test_filters_never_pick_masked_tokens(params: SP, device: str) -> None:
    n = 3000
    logits = logits_stream(1, 1, vocab=40, seed=9, scale=2.0, device=device)[0]
    batch = build([params] * n, seeds=list(range(n)), vocab_size=40, prompt_ids=None, eos_token_ids=[], device=device)
    picked = set(batch.sample(logits.expand(n, -1)).token_ids.tolist())
    allowed = allowed_tokens(logits[0].cpu(), params)
    assert picked <= allowed
    assert len(picked) == len(allowed)  # and every allowed token shows up in 3000 draws


@pytest.mark.parametrize(
    ("values", "params", "num_allowed"),
    [
        ([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -4.0], SP(top_k=5, top_p=0.8), 3),
        # top-p takes 0.75 of the top-4 mass (3 tokens), not of the whole (which would be 4)
        ([0.5, 1.9, 0.4, 1.7, 2.0, 0.3, 1.8, 0.2], SP(top_k=4, top_p=0.75), 3),
        ([0.5, 1.9, 0.4, 1.7, 2.0, 0.3, 1.8, 0.2], SP(min_p=0.8), 3),
    ],
)
def test_filtered_distribution_is_renormalised(values: list[float], params: SP, num_allowed: int, device: str) -> None:
    logits = torch.tensor([values])
    allowed = sorted(allowed_tokens(logits[0], params, slack=0.0))
    assert len(allowed) == num_allowed
    probs = torch.softmax(logits[0].double(), -1)
    expected = (probs[allowed] / probs[allowed].sum()).tolist()
    n = 20_000
    batch = build([params] * n, seeds=list(range(n)), vocab_size=8, prompt_ids=None, eos_token_ids=[], device=device)
    counts = torch.bincount(batch.sample(logits.to(device).expand(n, -1)).token_ids.cpu(), minlength=8)
    assert counts[[i for i in range(8) if i not in allowed]].sum() == 0
    assert chi_square_p_value(counts[allowed].tolist(), expected) > 1e-3


# ---------------------------------------------------------------- penalties and stops


def reference_penalties(
    logits: torch.Tensor, p: SP, prompt: list[int], output: list[int], stops: list[int]
) -> torch.Tensor:
    """HF repetition penalty over prompt + output, then OpenAI frequency/presence over output,
    then the min_new_tokens mask; one token at a time."""
    out = logits.clone().double()
    for t in set(prompt + output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= c * p.frequency_penalty + p.presence_penalty
    if len(output) < p.min_new_tokens:
        for t in stops:
            out[t] = -math.inf
    return out


def test_penalties_match_reference(device: str) -> None:
    params = [
        SP(repetition_penalty=1.5),
        SP(repetition_penalty=0.7, frequency_penalty=0.4),
        SP(frequency_penalty=-0.8, presence_penalty=1.2, temperature=0.0),
        SP(presence_penalty=0.5, min_new_tokens=4, stop_token_ids=(11,)),
        SP(),
        SP(repetition_penalty=1.2, frequency_penalty=2.0, presence_penalty=-2.0, min_new_tokens=2, ignore_eos=True),
    ]
    prompts = [[1, 2, 3, 3, 60], [5, 5, 5], [], [9, 8], [1], [0, 63]]
    history = [[4, 4, 2], [], [7], [], [1, 2], [3]]  # tokens generated before a re-admission
    stops = [[EOS], [EOS], [EOS], [EOS, 11], [EOS], []]
    batch = build(params, prompt_ids=prompts, output_ids=history, device=device)
    for logits in logits_stream(8, len(params), seed=3, scale=4.0, device=device):
        got = batch.apply_penalties(logits).cpu()
        for i, p in enumerate(params):
            expected = reference_penalties(logits[i].cpu(), p, prompts[i], history[i], stops[i])
            torch.testing.assert_close(got[i].double(), expected, rtol=1e-6, atol=1e-5)
        tokens = batch.sample(logits).token_ids.tolist()
        for i, t in enumerate(tokens):
            history[i].append(t)


def test_min_new_tokens_masks_eos_and_stop_tokens(device: str) -> None:
    logits = torch.zeros(4, V, device=device)
    logits[:, EOS] = 50.0
    logits[:, 9] = 40.0
    params = [
        SP(temperature=0.0, min_new_tokens=3, stop_token_ids=(9,)),
        SP(min_new_tokens=2, stop_token_ids=(9,)),
        SP(min_new_tokens=2, ignore_eos=True),  # EOS is no stop: not masked, not stopping
        SP(temperature=0.0, max_new_tokens=2),
    ]
    batch = build(params, device=device)
    outs = [batch.sample(logits) for _ in range(4)]
    tokens = [o.token_ids.tolist() for o in outs]
    # greedy: with EOS and 9 masked, the first of the tied zero logits (0), until step 3
    assert [t[0] for t in tokens] == [0, 0, 0, EOS]
    assert [o.stopped[0].item() for o in outs] == [False, False, False, True]
    assert EOS not in [t[1] for t in tokens[:2]] and 9 not in [t[1] for t in tokens[:2]]
    assert [t[1] for t in tokens[2:]] == [EOS, EOS]
    assert [t[2] for t in tokens] == [EOS] * 4 and not any(o.stopped[2].item() for o in outs)
    assert [o.stopped[3].item() for o in outs] == [True] * 4
    assert [o.length_capped[3].item() for o in outs] == [False, True, True, True]


def test_logprobs_are_of_the_raw_distribution(device: str) -> None:
    params = [
        SP(logprobs=True, top_logprobs=3, temperature=0.5, repetition_penalty=1.8, top_k=5),
        SP(logprobs=True, temperature=0.0, frequency_penalty=1.0),
        SP(top_p=0.5),
    ]
    batch = build(params, device=device)
    for logits in logits_stream(3, 3, seed=4, device=device):
        out = batch.sample(logits)
        raw = torch.log_softmax(logits, -1)
        assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
        torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
        values, ids = raw.topk(3, -1)
        assert torch.equal(out.top_ids, ids)
        torch.testing.assert_close(out.top_logprobs, values)
    no_logprobs = build([SP()]).sample(logits_stream(1, 1)[0])
    assert no_logprobs.logprobs is None and no_logprobs.top_ids is None


def test_logit_bias_is_added_per_row_and_survives_filter_and_merge(device: str) -> None:
    """OpenAI's logit_bias: each row's biases added to its logits (greedy and sampled rows alike,
    -100 bans a token, +100 all but forces it), other rows untouched; the rows keep their own
    biases when requests leave and join."""
    logits = logits_stream(1, 3, seed=7, device=device)[0]
    top = logits.argmax(-1).tolist()
    params = [
        SP(temperature=0.0, logit_bias=((top[0], -100.0), (5, 2.5))),
        SP(temperature=0.0),
        SP(temperature=0.7, seed=1, logit_bias=((17, 100.0),)),
    ]
    batch = build(params, device=device)
    got = batch.apply_penalties(logits).cpu()
    expected = logits.cpu().clone()
    expected[0, top[0]] -= 100.0
    expected[0, 5] += 2.5
    expected[2, 17] += 100.0
    torch.testing.assert_close(got, expected)
    tokens = batch.sample(logits).token_ids.tolist()
    assert tokens[0] == int(expected[0].argmax()) != top[0] and tokens[1] == top[1] and tokens[2] == 17
    batch.filter([2, 0])  # the unbiased row leaves
    joiner = build([SP(temperature=0.0, logit_bias=((top[1], -100.0), (1, 1.0), (2, 1.0)))], device=device)
    batch.merge(joiner)  # a wider bias table joins a narrower one
    rows = logits[[2, 0, 1]]
    got = batch.apply_penalties(rows).cpu()
    expected = rows.cpu().clone()
    expected[0, 17] += 100.0
    expected[1, top[0]] -= 100.0
    expected[1, 5] += 2.5
    expected[2, top[1]] -= 100.0
    expected[2, 1] += 1.0
    expected[2, 2] += 1.0
    torch.testing.assert_close(got, expected)
    assert batch.sample(rows).token_ids.tolist()[2] == int(expected[2].argmax())


def test_all_greedy_rows_with_a_bias_do_not_take_the_raw_argmax(device: str) -> None:
    """The all-greedy shortcut reads the logits as they come: a bias must turn it off."""
    logits = logits_stream(1, 2, seed=8, device=device)[0]
    top = logits.argmax(-1).tolist()
    batch = build([SP(temperature=0.0, logit_bias=((top[0], -100.0),)), SP(temperature=0.0)], device=device)
    tokens = batch.sample(logits).token_ids.tolist()
    assert tokens[0] != top[0] and tokens[1] == top[1]


def test_bias_tables_exist_only_while_a_row_has_a_bias(device: str) -> None:
    """No bias, no tables (nothing copied or reindexed as rows come and go); a biased joiner brings
    them, the unbiased rows getting zero biases, and they go when its row leaves."""
    logits = logits_stream(1, 3, seed=9, device=device)[0]
    top = logits.argmax(-1).tolist()
    batch = build([SP(temperature=0.0), SP(temperature=0.0)], device=device)
    assert batch.bias_ids is None and batch.bias_values is None
    batch.merge(build([SP(temperature=0.0, logit_bias=((top[2], -100.0),))], device=device))
    assert batch.bias_ids is not None and tuple(batch.bias_ids.shape) == (3, 1)
    expected = logits.cpu().clone()
    expected[2, top[2]] -= 100.0
    torch.testing.assert_close(batch.apply_penalties(logits).cpu(), expected)
    tokens = batch.sample(logits).token_ids.tolist()
    assert tokens[:2] == top[:2] and tokens[2] != top[2]
    batch.filter([0, 1])
    assert batch.bias_ids is None and batch.bias_values is None
    torch.testing.assert_close(batch.apply_penalties(logits[:2]).cpu(), logits[:2].cpu())


def test_build_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="seeds"):
        SamplingBatch.build([SP()], [], vocab_size=V)
    with pytest.raises(ValueError, match="prompt_ids"):
        SamplingBatch.build([SP(repetition_penalty=1.1)], [0], vocab_size=V)
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingBatch.build([SP(stop_token_ids=(V,))], [0], vocab_size=V)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingBatch.build([SP(logit_bias=((V, 1.0),))], [0], vocab_size=V)
    with pytest.raises(ValueError, match="logits"):
        build([SP()]).sample(torch.zeros(2, V))
