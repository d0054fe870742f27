"""The engine issue's rule for comparing two greedy runs that may round differently.

Tokens must agree wherever the reference's top-2 log-probability gap is at least ``tol``; at
the first near tie the two sequences may rightly part, so the comparison of that request stops
there. Chosen tokens' log-probabilities must agree within ``tol`` too. The reference results
need ``logprobs=True, top_logprobs=2``; the others need ``logprobs=True``.
"""

from __future__ import annotations

from collections.abc import Sequence


def compare_greedy(expected: Sequence, got: Sequence, tol: float) -> tuple[int, int]:
    """Assert the rule over pairs of results; return (positions compared, requests cut at a near tie)."""
    compared = cut = 0
    for want, have in zip(expected, got, strict=True):
        for position, (a, b) in enumerate(zip(want.token_ids, have.token_ids)):
            (_, best), (_, second) = want.top_logprobs[position]
            if best - second < tol:
                cut += 1
                break
            assert a == b, f"position {position}: {a} != {b}"
            if have.logprobs is not None:
                assert abs(want.logprobs[position] - have.logprobs[position]) < tol, f"position {position}"
            compared += 1
    return compared, cut
