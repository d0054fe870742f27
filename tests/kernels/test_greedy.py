"""The greedy kernels (``fused-greedy``, triton_greedy.py): argmax keys folded by the lm_head
gemv equal torch's argmax of the logits it stores (ties to the first index), and the record
kernel equals the sampler's torch bookkeeping (tokens, step counters, stop and length tests)."""

from __future__ import annotations

import pytest
import torch
from kernel_checks import DTYPES, PERSISTENT_TILES

from app.engine.sampling import SamplingBatch
from app.ipc.messages import SamplingParams
from app.kernels.triton_gemv import GemvConfig, argmax_config, default_config, gemv_add_rms_norm
from app.kernels.triton_greedy import (
    ARGMAX_BLOCK,
    ARGMAX_SLOTS,
    argmax_from_keys,
    argmax_keys_of,
    empty_argmax_keys,
    greedy_record,
)

ARGMAX_CASES = [  # (N, K, config): None is the heuristic's, forced unsplit where it would split
    (1000, 64, GemvConfig(64, 64)),  # a ragged last row block
    (300, 200, GemvConfig(16, 64, split_k=3)),  # a split config: runs unsplit
    (130, 100, None),
    (300, 200, argmax_config(300, 200, num_sms=1)),  # the 8-row tiling the default takes at large vocabularies
    (2 * PERSISTENT_TILES, 200, GemvConfig(2, 256, num_stages=2, programs_per_sm=1)),  # some programs walk two tiles
]


def _lm_head(gen: torch.Generator, n: int, k: int, dtype: torch.dtype, device: torch.device):
    x, residual = (torch.randn(1, k, generator=gen).to(dtype).to(device) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(device)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    return x, residual, norm_weight, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("n", "k", "config"), ARGMAX_CASES, ids=["ragged", "split-config", "default", "argmax-config",
                                                                             "rows"])
@pytest.mark.usefixtures("persistent_on_few_sms")
def test_argmax_keys_pick_the_argmax_of_the_stored_logits(n: int, k: int, config: GemvConfig | None,
                                                          dtype: torch.dtype, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(n + k)
    x, residual, norm_weight, weight = _lm_head(gen, n, k, dtype, device)
    keys = empty_argmax_keys(1, device)
    for trial in range(3):  # the record kernel clears the keys: the next step starts empty
        weight[trial * 7 % n] += 0.5  # a different winner each time, somewhere
        logits, _ = gemv_add_rms_norm(x, residual, norm_weight, 1e-6, weight, config=config, argmax_keys=keys)
        want = int(logits.argmax(dim=-1).item())
        assert int(argmax_from_keys(keys).item()) == want
        packed = greedy_record(argmax_keys=keys, stop_ids=torch.zeros(1, 1, dtype=torch.int64, device=device),
                               has_stop=torch.zeros(1, dtype=torch.bool, device=device),
                               num_generated=torch.zeros(1, dtype=torch.int64, device=device),
                               max_new_tokens=torch.full((1,), 9, dtype=torch.int64, device=device))
        assert packed[0].tolist() == [want]
        assert not keys.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_argmax_keys_break_ties_to_the_first_index_and_order_negative_logits(dtype: torch.dtype,
                                                                             device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 64
    x, residual, norm_weight, weight = _lm_head(gen, n, k, dtype, device)
    weight.neg_().abs_().neg_()  # mostly negative logits, when the normalised x is positive...
    x.abs_()
    residual.abs_()
    norm_weight.abs_()
    weight[150] = weight[37] = weight[121] = 0.05  # three equal rows, the largest: first index wins
    keys = empty_argmax_keys(1, device)
    logits, _ = gemv_add_rms_norm(x, residual, norm_weight, 1e-6, weight, config=GemvConfig(16, 64),
                                  argmax_keys=keys)
    assert (logits[0] < 0).sum() > n // 2
    assert logits[0, 37] == logits[0, 150] == logits[0, 121] == logits.max()
    assert int(argmax_from_keys(keys).item()) == int(logits.argmax().item()) == 37


def test_argmax_keys_refuse_what_they_cannot_serve(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    x, residual, norm_weight, weight = _lm_head(gen, 40, 32, torch.float32, device)
    bias = torch.zeros(40, device=device)
    with pytest.raises(ValueError, match="without a bias"):
        gemv_add_rms_norm(x, residual, norm_weight, 1e-6, weight, bias, argmax_keys=empty_argmax_keys(1, device))
    with pytest.raises(ValueError, match=rf"\[1, {ARGMAX_SLOTS}\] int64"):
        gemv_add_rms_norm(x, residual, norm_weight, 1e-6, weight, argmax_keys=empty_argmax_keys(2, device))


def _batch(device: torch.device, max_new: list[int], stops: list[list[int]], ignore_eos: list[bool],
           generated: list[list[int]]) -> SamplingBatch:
    params = [SamplingParams(max_new_tokens=m, temperature=0.0, stop_token_ids=s, ignore_eos=i)
              for m, s, i in zip(max_new, stops, ignore_eos)]
    return SamplingBatch.build(params, list(range(len(params))), vocab_size=50, eos_token_ids=[2],
                               output_ids=generated, device=device)


def test_greedy_record_equals_the_torch_bookkeeping(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    b = 9
    max_new = [int(v) for v in torch.randint(1, 6, (b,), generator=gen)]
    stops = [[int(t) for t in torch.randint(0, 50, (int(n),), generator=gen)] for n in torch.randint(0, 4, (b,), generator=gen)]
    ignore = [bool(v) for v in torch.randint(0, 2, (b,), generator=gen)]
    generated = [[1] * int(n) for n in torch.randint(0, 4, (b,), generator=gen)]
    fused, plain = (_batch(device, max_new, stops, ignore, generated) for _ in range(2))
    for step in range(4):
        tokens = torch.randint(0, 50, (b,), generator=gen)
        tokens[step] = 2  # an EOS, stopping unless ignore_eos
        if stops[step + 1]:
            tokens[step + 1] = stops[step + 1][-1]  # a stop token
        tokens = tokens.to(device)
        want = plain._record(tokens)
        logits = torch.zeros(b, 50, device=device).scatter_(1, tokens[:, None], 1.0)  # the tokens as argmaxes
        packed = greedy_record(argmax_keys=argmax_keys_of(logits), stop_ids=fused.stop_ids, has_stop=fused.has_stop,
                               num_generated=fused.num_generated, max_new_tokens=fused.max_new_tokens)
        assert packed[0].tolist() == tokens.tolist()
        assert packed[1].tolist() == [int(v) for v in want.stopped.tolist()]
        assert packed[2].tolist() == [int(v) for v in want.length_capped.tolist()]
        assert fused.num_generated.tolist() == plain.num_generated.tolist()
    assert any(packed[1].tolist()) and any(packed[2].tolist()) and not all(packed[1].tolist())


def test_greedy_record_checks_its_arguments(device: torch.device) -> None:
    row = torch.zeros(2, dtype=torch.int64, device=device)
    stops = torch.zeros(2, 1, dtype=torch.int64, device=device)
    flags = torch.zeros(2, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match="argmax_keys must be"):
        greedy_record(argmax_keys=empty_argmax_keys(1, device), stop_ids=stops, has_stop=flags,
                      num_generated=row, max_new_tokens=row)
    with pytest.raises(ValueError, match="advanced in place"):
        greedy_record(argmax_keys=empty_argmax_keys(2, device), stop_ids=stops, has_stop=flags, num_generated=row.int(),
                      max_new_tokens=row)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_keys_of_many_rows_equal_torch_argmax(dtype: torch.dtype, device: torch.device) -> None:
    """Rows read by ARGMAX_BLOCK-wide programs (a vocabulary of several blocks and a ragged last
    one): the same pick as torch.argmax, ties to the first index (across blocks too), -inf and
    all-equal rows included; the keys given are filled, fresh ones made otherwise."""
    gen = torch.Generator().manual_seed(12)
    vocab = 2 * ARGMAX_BLOCK + 77
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    logits[1, 5] = logits[1, ARGMAX_BLOCK + 3] = logits[1, -1] = 50.0  # a tie across blocks: the first
    logits[2] = -float("inf")  # nothing finite: index 0, as torch picks
    logits[2, vocab - 1] = -1e4
    logits[3] = 0.25  # every logit equal: index 0
    logits[4, -1] = 60.0  # in the ragged last block
    logits = logits.to(device)
    keys = argmax_keys_of(logits)
    assert keys.shape == (6, ARGMAX_SLOTS) and torch.equal(argmax_from_keys(keys), logits.argmax(dim=-1))
    given = empty_argmax_keys(6, device)
    assert argmax_keys_of(logits[:, : vocab - 1], given) is given  # a strided view of the rows
    assert torch.equal(argmax_from_keys(given), logits[:, : vocab - 1].argmax(dim=-1))
    with pytest.raises(ValueError, match=r"argmax_keys_of: keys must be contiguous \[6, 64\] int64"):
        argmax_keys_of(logits, empty_argmax_keys(5, device))
    with pytest.raises(ValueError, match="argmax_keys_of: logits must be float"):
        argmax_keys_of(logits[0])


def test_argmax_config() -> None:
    """8 rows x 512 a program where 4 programs per SM remain (the H200's 1B lm_head: 147 -> 132 us),
    else the M = 1 default's tiling; never split (the keys need each program's whole sums)."""
    assert argmax_config(128256, 2048) == GemvConfig(8, 512, 1, False, 4, 1)
    assert argmax_config(128256, 4096) == GemvConfig(8, 512, 1, False, 4, 1)
    small = argmax_config(1000, 64)  # 125 row blocks of 8: too few programs for 132 SMs
    assert small == default_config(1, 1000, 64)._replace(split_k=1)
    assert argmax_config(300, 200, num_sms=1) == GemvConfig(8, 256, 1, False, 4, 1)


@pytest.mark.gpu
def test_argmax_keys_at_the_llama_lm_head_shape(device: torch.device) -> None:
    """128,256 x 2,048 bf16 (Llama-3.2-1B's lm_head, the default config: argmax_config's 8 x 512
    tiles, 16k programs folding into 64 slots), against torch's argmax, over several inputs."""
    gen = torch.Generator().manual_seed(11)
    x, residual, norm_weight, weight = _lm_head(gen, 128256, 2048, torch.bfloat16, device)
    keys = empty_argmax_keys(1, device)
    for trial in range(5):
        x = torch.randn(1, 2048, generator=gen).to(torch.bfloat16).to(device)
        logits, _ = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, weight, argmax_keys=keys)
        assert int(argmax_from_keys(keys).item()) == int(logits.argmax().item())
        keys.zero_()
