"""KV pool sizing from a profiling run, and too little device memory as a clear error at start.

The arithmetic (app.engine.memory_budget) is pure and tested here with the figures of real
cards and models; the builder's CPU path keeps its fixed default. Tests marked ``gpu`` build
engines on a CUDA device: the profiled pool fits and leaves the rest of the device free, and
each shortage (our share, an explicit --max-total-tokens, the weights) is a ValueError naming
the flags.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from app.engine import Engine
from app.engine.builder import CPU_DEFAULT_MAX_TOTAL_TOKENS, largest_prefill_step, model_bytes
from app.engine.kv_pool import kv_bytes_per_token
from app.engine.make_checkpoint import default_model_dir
from app.engine.memory_budget import (
    GIB,
    GRAPH_BYTES_PER_SIZE,
    INDEX_BYTES_PER_TOKEN,
    SAMPLING_TEMPORARIES,
    check_step_headroom,
    kv_pool_tokens,
    pool_bytes,
    reserve_bytes,
    weights_do_not_fit,
)
from app.engine.kernel_plan import resolve_triton_kernel
from app.ipc.messages import SamplingParams

MIB = 1 << 20
H200 = 141 * GIB
# Llama-3.1-8B in bf16: 32 layers, 8 KV heads of 128; 8.03e9 parameters; vocab 128256.
LLAMA_8B_PER_TOKEN = 2 * 32 * 8 * 128 * 2 + INDEX_BYTES_PER_TOKEN  # 131089
LLAMA_8B_WEIGHTS = 16_060_522_496
# Llama-3.2-1B in bf16: 16 layers, 8 KV heads of 64; 1.24e9 parameters (tied embeddings).
LLAMA_1B_PER_TOKEN = 2 * 16 * 8 * 64 * 2 + INDEX_BYTES_PER_TOKEN  # 32785
LLAMA_1B_WEIGHTS = 2_471_645_184
CUDA_CONTEXT = 600 * MIB


def sized(**changes) -> int:
    """The 8B model on an H200 at the default 0.85, with round figures, changed by ``changes``."""
    figures = dict(
        total=H200, used=16 * GIB, activation_peak=3 * GIB // 2, reserve=6 * GIB // 5, bytes_per_token=LLAMA_8B_PER_TOKEN,
        mem_fraction_static=0.85, context_len=131072, page_size=1, weights=LLAMA_8B_WEIGHTS,
    )
    return kv_pool_tokens(**{**figures, **changes})


# ---------------------------------------------------------------- the arithmetic


def test_kv_bytes_per_token_of_the_reference_models() -> None:
    assert kv_bytes_per_token(32, 8, 128, torch.bfloat16) + INDEX_BYTES_PER_TOKEN == LLAMA_8B_PER_TOKEN == 131089
    assert kv_bytes_per_token(16, 8, 64, torch.bfloat16) + INDEX_BYTES_PER_TOKEN == LLAMA_1B_PER_TOKEN == 32785


def test_8b_on_an_h200_is_the_docstring_example() -> None:
    # share 119.85 GiB (int(141 GiB * 0.85) = 128_688_273_817 bytes) - 16 - 1.5 - 1.2 GiB
    # = 108_609_470_054 bytes = 101.15 GiB; // 131089 = 828_513; less the reserved page 0.
    assert sized() == 828_512
    assert pool_bytes(828_512, LLAMA_8B_PER_TOKEN) <= int(H200 * 0.85) - 16 * GIB - 3 * GIB // 2 - 6 * GIB // 5


def test_1b_on_an_h200_with_measured_looking_figures() -> None:
    used = LLAMA_1B_WEIGHTS + CUDA_CONTEXT
    activation = 900 * MIB
    reserve = reserve_bytes(vocab_size=128256, max_running=256, context_len=131072, graph_sizes=35, graph_max_bs=256,
                            graph_step_peak=200 * MIB, graph_state=0)
    tokens = kv_pool_tokens(total=H200, used=used, activation_peak=activation, reserve=reserve.total,
                            bytes_per_token=LLAMA_1B_PER_TOKEN, mem_fraction_static=0.85, context_len=131072)
    budget = int(H200 * 0.85) - used - activation - reserve.total
    assert tokens == budget // LLAMA_1B_PER_TOKEN - 1
    assert tokens == 3_730_991  # 113.9 GiB of KV at 32 KiB a token
    # The pool, with every other figure, stays inside our share; one token more would not.
    assert used + activation + reserve.total + pool_bytes(tokens, LLAMA_1B_PER_TOKEN) <= int(H200 * 0.85)
    assert used + activation + reserve.total + pool_bytes(tokens + 1, LLAMA_1B_PER_TOKEN) > int(H200 * 0.85)


def test_each_figure_takes_its_bytes_from_the_pool() -> None:
    base = sized()
    assert sized(used=16 * GIB + 10 * LLAMA_8B_PER_TOKEN) == base - 10
    assert sized(activation_peak=3 * GIB // 2 + 10 * LLAMA_8B_PER_TOKEN) == base - 10
    assert sized(reserve=6 * GIB // 5 + 10 * LLAMA_8B_PER_TOKEN) == base - 10
    assert sized(mem_fraction_static=0.5) < base
    assert sized(weights=None) == base  # the weights are part of `used`: only the messages name them


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_whole_pages_and_the_reserved_page(page_size: int) -> None:
    tokens = sized(page_size=page_size)
    slots = (int(H200 * 0.85) - 16 * GIB - 3 * GIB // 2 - 6 * GIB // 5) // LLAMA_8B_PER_TOKEN
    assert tokens % page_size == 0
    assert slots - 2 * page_size < tokens <= slots - page_size  # page 0 is reserved, the rest rounds down


def test_reserve_arithmetic() -> None:
    r = reserve_bytes(vocab_size=128256, max_running=256, context_len=131072, graph_sizes=35, graph_max_bs=256,
                      graph_step_peak=200 * MIB, graph_state=32 * MIB)
    assert r.graphs == 2 * 200 * MIB + 32 * MIB + 35 * GRAPH_BYTES_PER_SIZE + 256 * 128256 * 4
    assert r.sampling == SAMPLING_TEMPORARIES * 256 * 128256 * 4
    assert r.table == 256 * 131072 * 4 == 128 * MIB
    assert r.total == r.graphs + r.sampling + r.table
    no_graphs = reserve_bytes(vocab_size=128256, max_running=256, context_len=131072, graph_step_peak=200 * MIB)
    assert no_graphs.graphs == 0 and no_graphs.sampling == r.sampling


def test_too_small_a_share_names_the_flags_and_figures() -> None:
    with pytest.raises(ValueError) as info:
        sized(mem_fraction_static=0.12)  # 16.9 GiB: not even the weights and activations
    message = str(info.value)
    for flag in ("--mem-fraction-static 0.12", "--context-length 131072", "--chunked-prefill-size", "--max-total-tokens"):
        assert flag in message
    assert "0 tokens" in message and "141.00 GiB" in message and "weights 14.96 GiB" in message


def test_a_pool_shorter_than_one_full_context_request_is_refused() -> None:
    # 8 GiB of KV holds 65526 tokens of 131089 bytes (and page 0): not one request of 131072 tokens.
    share = (16 * GIB + 3 * GIB // 2 + 6 * GIB // 5 + 8 * GIB) / H200
    with pytest.raises(ValueError, match="--context-length 131072 needs 131072 tokens"):
        sized(mem_fraction_static=share)
    assert sized(mem_fraction_static=share, context_len=32768) == 65_526
    with pytest.raises(ValueError, match="needs 131328 tokens"):  # whole pages: 513 of 256
        sized(mem_fraction_static=share, context_len=131072 + 1, page_size=256)


def test_fewer_than_two_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 512 tokens"):
        kv_pool_tokens(total=1000 * 1000, used=0, activation_peak=0, reserve=0, bytes_per_token=1000,
                       mem_fraction_static=0.5, context_len=2, page_size=256)  # 500 slots: 1 page + the reserved one
    assert kv_pool_tokens(total=1000 * 1000, used=0, activation_peak=0, reserve=0, bytes_per_token=1000,
                          mem_fraction_static=0.9, context_len=2, page_size=256) == 512  # 900 slots - 256, in pages


def test_an_explicit_pool_is_checked_against_free_memory() -> None:
    # Fits: returned as given (whole pages), whatever the share.
    assert sized(max_total_tokens=500_000) == 500_000
    assert sized(max_total_tokens=500_000 + 7, page_size=16) == 500_000
    assert sized(max_total_tokens=900_000) == 900_000  # above the share's 828,512 but free memory holds it
    free = H200 - 16 * GIB - 3 * GIB // 2 - 6 * GIB // 5
    fits = free // LLAMA_8B_PER_TOKEN - 1
    assert sized(max_total_tokens=fits) == fits
    with pytest.raises(ValueError) as info:
        sized(max_total_tokens=fits + 1)
    message = str(info.value)
    assert f"--max-total-tokens {fits + 1} needs" in message and f"at most {fits} tokens fit" in message
    assert "--context-length" in message and "--chunked-prefill-size" in message


def test_headroom_after_start() -> None:
    check_step_headroom(free=3 * GIB, activation_peak=2 * GIB, sampling=GIB, prefill_tokens=8192)
    with pytest.raises(ValueError, match="prefill step of 8192 tokens") as info:
        check_step_headroom(free=3 * GIB - 1, activation_peak=2 * GIB, sampling=GIB, prefill_tokens=8192)
    assert "--mem-fraction-static" in str(info.value) and "--cuda-graph-max-bs" in str(info.value)


def test_weights_message() -> None:
    message = weights_do_not_fit(LLAMA_8B_WEIGHTS * 2, total=24 * GIB, free=23 * GIB, dtype="float32")
    assert "29.92 GiB in float32" in message and "23.00 GiB free of 24.00 GiB" in message
    assert "--dtype bfloat16" in message and "CUDA_VISIBLE_DEVICES" in message and "--mem-fraction-static" in message
    assert "e.g. --dtype" not in weights_do_not_fit(LLAMA_8B_WEIGHTS, total=8 * GIB, free=7 * GIB, dtype="bfloat16")


# ---------------------------------------------------------------- the profiled step's shape


def test_largest_prefill_step() -> None:
    assert largest_prefill_step(16384, 8192, 131072, 256) == [8192]  # one chunk, one sequence
    assert largest_prefill_step(4096, 8192, 131072, 256) == [4096]  # the step's token budget caps the chunk
    assert largest_prefill_step(16384, None, 4096, 256) == [4096] * 4  # no chunking: positions cap a sequence
    assert largest_prefill_step(16384, None, 131072, 256) == [131072]  # a whole prompt goes first, alone
    assert largest_prefill_step(10000, None, 4096, 256) == [4096, 4096, 1808]
    assert largest_prefill_step(16384, None, 4096, 2) == [4096, 4096]  # no more sequences than may run


# ---------------------------------------------------------------- the CPU build


def test_cpu_keeps_the_fixed_default_and_reports_the_figures() -> None:
    engine = Engine(device="cpu")
    built = engine.built
    config = built.model_config
    assert built.max_total_tokens == CPU_DEFAULT_MAX_TOTAL_TOKENS
    assert built.memory.activation_peak_gib == 0.0 and built.memory.cuda_graph_gib == 0.0  # no profiling off CUDA
    assert built.memory.weights_gib == round(model_bytes(engine.scheduler.runner.model) / GIB, 3) > 0
    per_token = kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, built.dtype)
    assert built.memory.kv_pool_gib == round((CPU_DEFAULT_MAX_TOTAL_TOKENS + 1) * per_token / GIB, 3) > 0
    assert built.plan.fused_kernels is False  # auto: off on a CPU
    assert resolve_triton_kernel(None, torch.device("cpu"), "fused-kernels") is False


# ---------------------------------------------------------------- on a GPU

MARGIN = 512 * MIB  # blocks the caching allocator keeps, kernels loaded after the sizing


def _release() -> None:
    """Give the device back to the next test (an engine holds most of it)."""
    gc.collect()
    torch.cuda.empty_cache()


def _check_sized_engine(engine: Engine, fraction: float, backend: str) -> None:
    built = engine.built
    free, total = torch.cuda.mem_get_info()
    assert built.max_total_tokens >= built.context_len
    assert built.memory.activation_peak_gib > 0 and built.memory.weights_gib > 0
    assert built.memory.kv_pool_gib > 0.6 * fraction * total / GIB  # most of the share, for a tiny model
    assert bool(built.cuda_graph_batch_sizes) == (backend == "triton") == built.plan.cuda_graphs
    assert (built.memory.cuda_graph_gib > 0) == bool(built.cuda_graph_batch_sizes)
    assert free >= (1 - fraction) * total - MARGIN, (free / GIB, total / GIB)
    prompts = [[(7 * i + n) % 1000 for i in range(n)] for n in (5, 300, 2000)]
    results = engine.generate(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert [r.completion_tokens for r in results] == [8, 8, 8]
    assert torch.cuda.mem_get_info()[0] >= (1 - fraction) * total - MARGIN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gpu_pool_is_sized_from_the_profile_and_leaves_the_rest_free(backend: str) -> None:
    fraction = 0.5
    engine = Engine(device="cuda", mem_fraction_static=fraction, attention_backend=backend)
    try:
        _check_sized_engine(engine, fraction, backend)
    finally:
        del engine
        _release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_too_small_a_fraction_is_a_clear_error() -> None:
    # 0.001 of the device is less than the CUDA context alone (0.01 of an H200, 1.4 GiB, would
    # still hold the embedded model's pool).
    with pytest.raises(ValueError, match="--mem-fraction-static 0.001") as info:
        Engine(device="cuda", mem_fraction_static=0.001)
    assert "--context-length" in str(info.value) and "--max-total-tokens" in str(info.value)
    _release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_explicit_pool_larger_than_the_device_is_refused_before_allocating() -> None:
    free_before, total = torch.cuda.mem_get_info()
    with pytest.raises(ValueError, match=r"--max-total-tokens 1000000000000 needs .* at most \d+ tokens fit"):
        Engine(device="cuda", max_total_tokens=10**12)
    _release()
    assert torch.cuda.mem_get_info()[0] >= free_before - MARGIN


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_weights_larger_than_the_device_are_a_clear_error(tmp_path: Path) -> None:
    """A config whose embeddings alone exceed the device: refused from the model's size (built on
    the meta device) before any weight is read."""
    model_dir = tmp_path / "huge"
    shutil.copytree(default_model_dir(), model_dir)
    (model_dir / "tokenizer.json").unlink()
    config = json.loads((model_dir / "config.json").read_text())
    total = torch.cuda.mem_get_info()[1]
    config["vocab_size"] = total // (config["hidden_size"] * 4) + 1  # float32 embeddings > the device
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the model's weights need \d+\.\d\d GiB in float32") as info:
        Engine(str(model_dir), device="cuda", dtype="float32")
    assert "--dtype bfloat16" in str(info.value) and "free of" in str(info.value)
    _release()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fused_kernels_default_on() -> None:
    auto = Engine(device="cuda", max_total_tokens=4096, disable_cuda_graph=True)
    off = Engine(device="cuda", max_total_tokens=4096, disable_cuda_graph=True, kernel_options="fused-kernels=off")
    try:
        assert auto.built.plan.fused_kernels is True and auto.scheduler.runner.model.fused_kernels
        assert off.built.plan.fused_kernels is False and not off.scheduler.runner.model.fused_kernels
    finally:
        del auto, off
        _release()
