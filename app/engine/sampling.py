"""Batched sampling: one pass of tensor ops over [B, V] logits, each row with its own parameters.

What one step does (a stage is skipped when no row of the batch needs it; those flags live on the
host and are recomputed only when the batch changes, so the hot path never waits on the device)::

    raw logits ──▶ log_softmax ──▶ logprobs: chosen token + top-k alternatives
        │                         (the RAW model distribution, before penalties and temperature,
        │                          as OpenAI reports them)
        ▼
    repetition penalty (prompt + output) ─▶ frequency/presence (output only) ─▶ min_new_tokens mask
        ├──▶ argmax ──────────────────────────────────────────────────────────────▶ greedy rows
        └──▶ ÷ temperature ─▶ softmax ─▶ keep p ≥ threshold(top-k, top-p, min-p) ─▶ inverse CDF at u

Same seed, same output, whatever shares the batch: every stage is row-wise, the kept set is a
threshold on the row's own probabilities (not on positions in a batch-wide sort), the inverse CDF
runs in vocabulary order, and ``u`` is a counter-based hash of (seed, step), where step is the
number of tokens the request has generated. No torch.Generator and no global RNG is involved.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from app.engine.host_to_device import tensor_on
from app.ipc.messages import SamplingParams


def request_seed(params: SamplingParams) -> int:
    """The seed of a request's random stream: its own, or a fresh random one. Call once at
    admission and keep the result with the request (a rebuilt batch must reuse it)."""
    return params.seed if params.seed is not None else secrets.randbits(63)


# ---------------------------------------------------------------- counter-based uniforms


def _i64(c: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(x: Tensor) -> Tensor:
    """SplitMix64's finaliser; int64 multiplication wraps, which is what it needs."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_from_seed(seeds: Tensor, steps: Tensor) -> Tensor:
    """One uniform float32 in [0, 1) per row, a pure function of (seed, step): SplitMix64 seeded
    with mix(seed), ``step`` values along. 24 random bits, so the float is exact and < 1."""
    h = _mix64(_mix64(seeds) + (steps + 1) * _GOLDEN)
    return _shr(h, 40).to(torch.float32) * (1.0 / (1 << 24))


# ---------------------------------------------------------------- results


class SampleOutput(NamedTuple):
    token_ids: Tensor  # [B] int64, the chosen tokens
    stopped: Tensor  # [B] bool: the token is EOS (unless ignore_eos) or one of stop_token_ids
    length_capped: Tensor  # [B] bool: the request has now generated max_new_tokens
    logprobs: Tensor | None  # [B] float32 raw log-prob of each chosen token; None if no row asked
    top_ids: Tensor | None  # [B, K] int64, K = the batch's largest top_logprobs; None if K == 0
    top_logprobs: Tensor | None  # [B, K] float32; row r uses its first params[r].top_logprobs
    # [3, B] int64 (tokens, stopped, capped) when the record kernel made them (fused-greedy):
    # the three fields above are its rows (0/1 for the flags), copied to the host as one tensor.
    packed: Tensor | None = None


# ---------------------------------------------------------------- the batch

# Per-row [B] or [B, ...] tensors that filter/merge carry along (``seen`` and ``output_counts``
# are [B, V] and allocated only while some row needs them).
_ROW_FIELDS = (
    "seeds", "num_generated", "temperatures", "greedy", "top_k", "top_p", "min_p", "prefix_filtered",
    "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens", "max_new_tokens",
    "has_stop",
)  # fmt: skip


class SamplingBatch:
    """Sampling state of the requests that sample in one forward step, as tensors on ``device``.

    Built once per request set (:meth:`build`, the only per-request Python loop), then kept in
    step with the running batch by :meth:`filter` (requests leave) and :meth:`merge` (requests
    join); :meth:`sample` picks one token per row and records it (step counters, token counts).
    """

    def __init__(
        self, params: list[SamplingParams], vocab_size: int, device: torch.device, *, record_kernel: bool = False,
        **tensors: Tensor | None,
    ) -> None:
        self.params = params  # host copy: the flags below come from here, never from the device
        self.vocab_size = vocab_size
        self.device = device
        # fused-greedy: an all-greedy step's bookkeeping in one triton kernel (triton_greedy.py)
        self.record_kernel = record_kernel
        self.seeds: Tensor  # [B] int64
        self.num_generated: Tensor  # [B] int64: tokens generated so far = step of the next sample
        self.temperatures: Tensor  # [B] float32, 1.0 on greedy rows (which never divide)
        self.greedy: Tensor  # [B] bool
        self.top_k: Tensor  # [B] int64, vocab_size when disabled
        self.top_p: Tensor  # [B] float32
        self.min_p: Tensor  # [B] float32
        self.prefix_filtered: Tensor  # [B] bool: top-k or top-p active (needs the sorted probs)
        self.repetition_penalty: Tensor  # [B] float32
        self.frequency_penalty: Tensor  # [B] float32
        self.presence_penalty: Tensor  # [B] float32
        self.min_new_tokens: Tensor  # [B] int64
        self.max_new_tokens: Tensor  # [B] int64
        self.has_stop: Tensor  # [B] bool: the row has at least one stop token
        # [B, S] int64 stop tokens (EOS unless ignore_eos, then stop_token_ids), padded with the
        # row's first entry (0 if none), so a scatter over a row writes one value per index.
        self.stop_ids: Tensor
        # [B, L] logit_bias: token ids and their biases, padded with the row's first id and 0.0
        # (adding zero changes nothing; an unbiased row pads token 0), so one scatter_add applies
        # them; None while no row has a bias (no copies, no index_select as rows come and go).
        self.bias_ids: Tensor | None
        self.bias_values: Tensor | None
        self.seen: Tensor | None  # [B, V] bool: token in prompt or output (repetition penalty)
        self.output_counts: Tensor | None  # [B, V] int32: times generated (frequency/presence)
        for name, value in tensors.items():
            setattr(self, name, value)
        self._refresh_flags()

    # ------------------------------------------------------------------ building

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        prompt_ids: Sequence[Sequence[int]] | None = None,
        output_ids: Sequence[Sequence[int]] | None = None,
        device: torch.device | str = "cpu",
        record_kernel: bool = False,
    ) -> SamplingBatch:
        """State for ``params[i]`` with seed ``seeds[i]`` (from :func:`request_seed`).

        ``prompt_ids`` is needed when a row has a repetition penalty; ``output_ids`` restores
        requests that already generated tokens (e.g. re-admitted after preemption), so that
        penalties, min_new_tokens and the seeded stream continue where they were.
        ``record_kernel`` (``fused-greedy``; triton must run on ``device``): all-greedy steps
        record their tokens in one kernel (:meth:`sample`).
        Raises ValueError on mismatched lengths or a stop token outside the vocabulary.
        """
        params = list(params)
        b = len(params)
        if len(seeds) != b:
            raise ValueError(f"{b} requests but {len(seeds)} seeds")
        for ids, what in ((prompt_ids, "prompt_ids"), (output_ids, "output_ids")):
            if ids is not None and len(ids) != b:
                raise ValueError(f"{b} requests but {len(ids)} {what}")
        if prompt_ids is None and any(p.repetition_penalty != 1.0 for p in params):
            raise ValueError("prompt_ids are required when a request has a repetition_penalty")
        outputs = [list(o) for o in output_ids] if output_ids is not None else [[] for _ in params]
        dev = torch.device(device)

        stops = [cls._stop_tokens(p, eos_token_ids) for p in params]
        for row in stops:
            for t in row:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop token {t} is outside the vocabulary [0, {vocab_size})")
        width = max([len(s) for s in stops] + [1])
        stop_rows = [s + [s[0] if s else 0] * (width - len(s)) for s in stops]
        for p in params:
            for t, _ in p.logit_bias:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"logit_bias token {t} is outside the vocabulary [0, {vocab_size})")

        def f32(values: list[float]) -> Tensor:
            return tensor_on(values, torch.float32, dev)

        def i64(values: list[int]) -> Tensor:
            return tensor_on(values, torch.int64, dev).reshape(len(values))

        def flag(values: list[bool]) -> Tensor:
            return tensor_on(values, torch.bool, dev).reshape(len(values))

        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        tensors: dict[str, Tensor | None] = dict(
            seeds=i64(list(seeds)),
            num_generated=i64([len(o) for o in outputs]),
            temperatures=f32([1.0 if p.greedy else p.temperature for p in params]),
            greedy=flag([p.greedy for p in params]),
            top_k=i64(top_k),
            top_p=f32([p.top_p for p in params]),
            min_p=f32([p.min_p for p in params]),
            prefix_filtered=flag([k < vocab_size or p.top_p < 1.0 for k, p in zip(top_k, params)]),
            repetition_penalty=f32([p.repetition_penalty for p in params]),
            frequency_penalty=f32([p.frequency_penalty for p in params]),
            presence_penalty=f32([p.presence_penalty for p in params]),
            min_new_tokens=i64([p.min_new_tokens for p in params]),
            max_new_tokens=i64([p.max_new_tokens for p in params]),
            has_stop=flag([bool(s) for s in stops]),
            stop_ids=tensor_on(stop_rows, torch.int64, dev).reshape(b, width),
            bias_ids=None,
            bias_values=None,
            seen=None,
            output_counts=None,
        )
        if any(p.repetition_penalty != 1.0 for p in params):
            assert prompt_ids is not None
            seen_ids = [list(prompt) + out for prompt, out in zip(prompt_ids, outputs)]
            tensors["seen"] = cls._token_table(seen_ids, vocab_size, dev).bool()
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            tensors["output_counts"] = cls._token_table(outputs, vocab_size, dev)
        if any(p.logit_bias for p in params):
            width = max(len(p.logit_bias) for p in params)
            ids = [[t for t, _ in p.logit_bias] for p in params]
            ids = [row + [row[0] if row else 0] * (width - len(row)) for row in ids]
            values = [[v for _, v in p.logit_bias] + [0.0] * (width - len(p.logit_bias)) for p in params]
            tensors["bias_ids"] = tensor_on(ids, torch.int64, dev).reshape(b, width)
            tensors["bias_values"] = tensor_on(values, torch.float32, dev).reshape(b, width)
        return cls(params, vocab_size, dev, record_kernel=record_kernel, **tensors)

    @staticmethod
    def _stop_tokens(p: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
        tokens = [] if p.ignore_eos else list(eos_token_ids)
        return list(dict.fromkeys(tokens + list(p.stop_token_ids)))

    @staticmethod
    def _token_table(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
        """[B, V] int32 counts of each token per row, built with one scatter_add."""
        table = torch.zeros(len(rows), vocab_size, dtype=torch.int32, device=device)
        flat = [t for r in rows for t in r]
        if flat:
            lengths = tensor_on([len(r) for r in rows], torch.int64, device)
            # output_size: without it the op reads the total back from the device (a sync)
            row_idx = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths, output_size=len(flat))
            cols = tensor_on(flat, torch.int64, device)
            table.index_put_((row_idx, cols), torch.ones(len(flat), dtype=torch.int32, device=device), accumulate=True)
        return table

    # ------------------------------------------------------------------ batch changes

    def __len__(self) -> int:
        return len(self.params)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order), in place: requests that finished leave."""
        idx = tensor_on(list(keep), torch.int64, self.device)
        self.params = [self.params[i] for i in keep]
        for name in _ROW_FIELDS + ("stop_ids",):
            setattr(self, name, getattr(self, name).index_select(0, idx))
        if self.bias_ids is not None and self.bias_values is not None and any(p.logit_bias for p in self.params):
            self.bias_ids, self.bias_values = self.bias_ids.index_select(0, idx), self.bias_values.index_select(0, idx)
        else:
            self.bias_ids = self.bias_values = None
        self.seen = self.seen.index_select(0, idx) if self.seen is not None and self._need_seen() else None
        self.output_counts = (
            self.output_counts.index_select(0, idx) if self.output_counts is not None and self._need_counts() else None
        )
        self._refresh_flags()

    def merge(self, other: SamplingBatch) -> None:
        """Append ``other``'s rows after this batch's, in place: requests that joined."""
        if other.vocab_size != self.vocab_size or other.seeds.device != self.seeds.device:
            raise ValueError("cannot merge sampling batches of different vocab sizes or devices")
        for name in _ROW_FIELDS:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)]))
        width = max(self.stop_ids.shape[1], other.stop_ids.shape[1])
        self.stop_ids = torch.cat([self._pad_ids(self.stop_ids, width), self._pad_ids(other.stop_ids, width)])
        self.bias_ids, self.bias_values = self._cat_biases(other)
        # A side without the [B, V] table has no row that needs it, so zeros stand in for it.
        n, m = len(self), len(other)
        self.seen = self._cat_table(self.seen, n, other.seen, m, torch.bool)
        self.output_counts = self._cat_table(self.output_counts, n, other.output_counts, m, torch.int32)
        self.params = self.params + other.params
        self._refresh_flags()

    @staticmethod
    def _pad_ids(ids: Tensor, width: int) -> Tensor:
        """``[B, w]`` token ids (stop tokens, biased tokens) widened to ``width`` with each row's first id."""
        extra = width - ids.shape[1]
        return ids if extra == 0 else torch.cat([ids, ids[:, :1].expand(-1, extra)], dim=1)

    def _cat_biases(self, other: SamplingBatch) -> tuple[Tensor | None, Tensor | None]:
        """The logit_bias tables of this batch's rows then ``other``'s, as wide as the wider; a
        side without one stands in with zero biases on token 0."""
        sides = [(self.bias_ids, self.bias_values, len(self)), (other.bias_ids, other.bias_values, len(other))]
        if all(ids is None for ids, _, _ in sides):
            return None, None
        width = max(ids.shape[1] for ids, _, _ in sides if ids is not None)
        ids_parts, value_parts = [], []
        for ids, values, rows in sides:
            if ids is None or values is None:
                ids = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
                values = torch.zeros(rows, width, dtype=torch.float32, device=self.device)
            extra = width - ids.shape[1]
            ids_parts.append(self._pad_ids(ids, width))
            value_parts.append(values if extra == 0 else torch.cat([values, values.new_zeros(rows, extra)], dim=1))
        return torch.cat(ids_parts), torch.cat(value_parts)

    def _cat_table(self, a: Tensor | None, na: int, b: Tensor | None, nb: int, dtype: torch.dtype) -> Tensor | None:
        if a is None and b is None:
            return None
        v = self.vocab_size
        a = a if a is not None else torch.zeros(na, v, dtype=dtype, device=self.device)
        b = b if b is not None else torch.zeros(nb, v, dtype=dtype, device=self.device)
        return torch.cat([a, b])

    def _need_seen(self) -> bool:
        return any(p.repetition_penalty != 1.0 for p in self.params)

    def _need_counts(self) -> bool:
        return any(p.frequency_penalty or p.presence_penalty for p in self.params)

    def _refresh_flags(self) -> None:
        """Host-side switches for the stages of :meth:`sample`, from ``params`` only."""
        v = self.vocab_size
        ps = self.params
        self._all_greedy = all(p.greedy for p in ps)
        self._any_greedy = any(p.greedy for p in ps)
        self._use_repetition = self.seen is not None and self._need_seen()
        self._use_counts = self.output_counts is not None and self._need_counts()
        self._use_min_new = any(p.min_new_tokens > 0 for p in ps)
        self._use_bias = self.bias_ids is not None and any(p.logit_bias for p in ps)
        self._use_min_p = any(p.min_p > 0.0 and not p.greedy for p in ps)
        # How many of the largest probabilities top-k/top-p need: a row with top-p but no top-k
        # needs the whole sorted row; else the largest top-k of the batch does. The value only
        # bounds the work: each row's threshold is the same whatever it is.
        needs = [
            (p.top_k if 0 < p.top_k < v else v)
            for p in ps
            if not p.greedy and ((0 < p.top_k < v) or p.top_p < 1.0)
        ]
        self._sort_k = max(needs, default=0)
        self._logprob_k = max((p.top_logprobs for p in ps if p.logprobs), default=-1)

    # ------------------------------------------------------------------ the step

    def sample(self, logits: Tensor, argmax_keys: Tensor | None = None) -> SampleOutput:
        """Pick one token per row from ``logits`` [B, V] and record it (advances each row's
        step, counts and seen tokens). Does not modify ``logits``. Raises ValueError on a shape
        that does not match the batch.

        ``argmax_keys`` ``[B, ARGMAX_SLOTS]``: the argmax of these logits, folded by the forward
        that made them (``fused-greedy``, triton_greedy.py). An all-greedy step with the record
        kernel reads its tokens from them; every step leaves them empty for the next forward."""
        if logits.dim() != 2 or logits.shape[0] != len(self) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits of shape {tuple(logits.shape)} for a batch of {len(self)} x {self.vocab_size}")
        if argmax_keys is not None and argmax_keys.shape[0] != len(self):
            raise ValueError(f"argmax_keys of shape {tuple(argmax_keys.shape)} for a batch of {len(self)}")
        if self._all_greedy and self._logprob_k < 0 and not (
            self._use_repetition or self._use_counts or self._use_min_new or self._use_bias
        ):
            if self.record_kernel and self.seen is None and self.output_counts is None:
                return self._record_greedy(logits, argmax_keys)
            if argmax_keys is not None:
                argmax_keys.zero_()
            # The argmax of logits as they come (bf16 from a decode graph): upcasting first is
            # exact, so the pick is the same, without a float32 copy of [B, vocab].
            return self._record(logits.argmax(dim=-1))
        if argmax_keys is not None:
            argmax_keys.zero_()
        logits = logits.to(torch.float32)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if self._logprob_k >= 0 else None

        logits = self.apply_penalties(logits)
        greedy_ids = logits.argmax(dim=-1) if self._any_greedy else None
        if greedy_ids is not None and self._all_greedy:
            token_ids = greedy_ids
        else:
            token_ids = self._sample_random(logits)
            if greedy_ids is not None:
                token_ids = torch.where(self.greedy, greedy_ids, token_ids)

        out = self._record(token_ids)
        if raw_logprobs is None:
            return out
        chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)
        top_ids = top_lp = None
        if self._logprob_k > 0:
            top_lp, top_ids = raw_logprobs.topk(self._logprob_k, dim=-1)
        return out._replace(logprobs=chosen, top_ids=top_ids, top_logprobs=top_lp)

    def apply_penalties(self, logits: Tensor) -> Tensor:
        """The logits greedy rows take the argmax of: repetition penalty (HF: seen tokens'
        positive logits ÷ p, negative × p), then frequency and presence (OpenAI: count × f + p
        over generated tokens), then the logit_bias (added), then -inf on stop tokens before
        min_new_tokens. Out of place; a row whose penalties are neutral keeps bit-identical logits."""
        logits = logits.to(torch.float32)
        if self._use_repetition:
            assert self.seen is not None
            rp = self.repetition_penalty[:, None]
            logits = torch.where(self.seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if self._use_counts:
            assert self.output_counts is not None
            counts = self.output_counts.to(torch.float32)
            logits = logits - self.frequency_penalty[:, None] * counts - self.presence_penalty[:, None] * (counts > 0)
        if self._use_bias:
            assert self.bias_ids is not None and self.bias_values is not None
            logits = logits.scatter_add(1, self.bias_ids, self.bias_values)
        if self._use_min_new:
            blocked = (self.num_generated < self.min_new_tokens) & self.has_stop
            at_stops = logits.gather(1, self.stop_ids)
            logits = logits.scatter(1, self.stop_ids, torch.where(blocked[:, None], float("-inf"), at_stops))
        return logits

    def _sample_random(self, logits: Tensor) -> Tensor:
        probs = torch.softmax(logits / self.temperatures[:, None], dim=-1)
        threshold = self._keep_threshold(probs)
        if threshold is not None:
            probs = torch.where(probs >= threshold[:, None], probs, 0.0)
        # Inverse CDF in vocabulary order. The target is kept strictly below the total, so the
        # first index whose running sum exceeds it has a positive probability (a kept token).
        cdf = probs.cumsum(dim=-1)
        total = cdf[:, -1:]
        u = uniform_from_seed(self.seeds, self.num_generated)[:, None]
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=self.vocab_size - 1)

    def _keep_threshold(self, probs: Tensor) -> Tensor | None:
        """[B] probability below which a row drops tokens (0 keeps all), or None if no row filters.

        top-k keeps the k most likely (ties at the k-th all stay, as in HF); top-p keeps the
        smallest most-likely set whose mass reaches top_p of the top-k mass (top-p applies after
        top-k, renormalised, as in HF and vLLM); min-p keeps p >= min_p * max p. A row keeps the
        intersection. Each threshold is a value of the row's own sorted probabilities, found with
        sequential (cumsum) arithmetic, so it does not depend on the rest of the batch.
        """
        threshold = None
        if self._sort_k > 0:
            k_all = self._sort_k
            if k_all < self.vocab_size:
                top = probs.topk(k_all, dim=-1).values
            else:
                top = probs.sort(dim=-1, descending=True).values
            k = self.top_k.clamp(max=k_all)[:, None]
            in_k = torch.arange(k_all, device=probs.device)[None, :] < k
            top_k_probs = torch.where(in_k, top, 0.0)
            cdf = top_k_probs.cumsum(dim=-1)
            mass = cdf.gather(1, k - 1)
            before = cdf - top_k_probs  # mass strictly above each position
            p = self.top_p[:, None]
            keep = in_k & ((before < p * mass) | (p >= 1.0))
            last = keep.sum(dim=-1, keepdim=True).clamp_(min=1) - 1
            threshold = torch.where(self.prefix_filtered, top.gather(1, last).squeeze(1), 0.0)
        if self._use_min_p:
            min_p_threshold = self.min_p * probs.amax(dim=-1)
            threshold = min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
        return threshold

    def _record_greedy(self, logits: Tensor, argmax_keys: Tensor | None) -> SampleOutput:
        """:meth:`_record` of the argmax in one kernel over argmax keys: the forward's (the batch-1
        lm_head gemv folds them) or folded here from the logits: two launches after the forward
        instead of ~9."""
        from app.kernels.triton_greedy import argmax_keys_of, greedy_record  # on demand: triton runs here

        rows = dict(stop_ids=self.stop_ids, has_stop=self.has_stop, num_generated=self.num_generated,
                    max_new_tokens=self.max_new_tokens)
        keys = argmax_keys if argmax_keys is not None else argmax_keys_of(logits)
        packed = greedy_record(argmax_keys=keys, **rows)
        return SampleOutput(packed[0], packed[1], packed[2], None, None, None, packed)

    def _record(self, token_ids: Tensor) -> SampleOutput:
        """Advance every row by its chosen token and say which rows hit a stop or the length cap."""
        self.num_generated += 1
        col = token_ids[:, None]
        if self.output_counts is not None:
            self.output_counts.scatter_add_(1, col, torch.ones_like(col, dtype=torch.int32))
        if self.seen is not None:
            self.seen.scatter_(1, col, True)
        stopped = ((col == self.stop_ids) & self.has_stop[:, None]).any(dim=-1)
        return SampleOutput(token_ids, stopped, self.num_generated >= self.max_new_tokens, None, None, None)
