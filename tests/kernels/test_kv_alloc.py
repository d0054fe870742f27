"""The allocator's pop in one kernel (app/kernels/triton_kv_alloc.py) against SlotAllocator's torch
path: the same slots from every alloc, the same free list and taken marks after every alloc and
free, at pages of one slot and of several (a power of two and not), and pops wider than one
program; then through the engine, whose pool is whole again after the requests finish."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine import Engine
from app.engine.kernel_plan import KernelOptions, resolve_triton_kernel
from app.engine.kv_pool import SlotAllocator
from app.engine.make_checkpoint import ModelSpec, make_checkpoint
from app.ipc.messages import SamplingParams
from app.kernels.triton_kv_alloc import POP_BLOCK, pop_pages
from app.server_args import parse_server_args


def _same_state(fused: SlotAllocator, ref: SlotAllocator) -> None:
    assert fused.num_free() == ref.num_free()
    assert torch.equal(fused.free_slots(), ref.free_slots())
    assert torch.equal(fused._page_free, ref._page_free)


@pytest.mark.parametrize("page_size", [1, 4, 3])
def test_fused_pop_equals_the_torch_alloc(page_size: int, device: torch.device) -> None:
    pages = 3 * POP_BLOCK  # room for a pop of more than one program's pages
    ref, fused = (SlotAllocator(pages * page_size, page_size=page_size, device=device, fused_pop=on)
                  for on in (False, True))
    assert ref._pop is None and fused._pop is not None
    held: list[torch.Tensor] = []
    for n_pages in (1, 5, POP_BLOCK + 37, 1, 2):
        got, want = fused.alloc(n_pages * page_size), ref.alloc(n_pages * page_size)
        assert got is not None and want is not None and got.dtype == torch.int64 and got.device == want.device
        assert torch.equal(got, want)
        _same_state(fused, ref)
        held.append(want)
    # Frees push pages back in another order than they left; the pops after them take those first.
    for slots in (held[1], held[3], held[0]):
        fused.free(slots)
        ref.free(slots)
        _same_state(fused, ref)
    for n_pages in (3, 1):
        got, want = fused.alloc(n_pages * page_size), ref.alloc(n_pages * page_size)
        assert got is not None and want is not None and torch.equal(got, want)
        _same_state(fused, ref)
    assert fused.alloc(0).numel() == 0 and fused.alloc((fused.num_free() // page_size + 1) * page_size) is None
    _same_state(fused, ref)
    fused.check()


def test_pop_pages_rejects_what_does_not_fit(device: torch.device) -> None:
    stack = torch.arange(8, dtype=torch.int64, device=device)
    free = torch.ones(8, dtype=torch.bool, device=device)
    with pytest.raises(ValueError, match=r"pop_pages: need .* 0 < n <= top <= 8.*n 9, top 8"):
        pop_pages(stack, free, 8, 9, 1)
    with pytest.raises(ValueError, match="pop_pages: need an int64 stack and a bool page_free"):
        pop_pages(stack.int(), free, 8, 1, 1)


def test_the_options_parse_and_resolve() -> None:
    """fused-kv-alloc: auto by default (on with CUDA, off on a CPU); graph-inputs-advance, auto:
    on wherever graphs fill their inputs with the fused kernel (CUDA graphs)."""
    assert KernelOptions().fused_kv_alloc is None and parse_server_args([]).engine_config(".").options == KernelOptions()
    assert parse_server_args(["--kernel-options", "fused-kv-alloc=off"]).engine_config(".").options.fused_kv_alloc is False
    assert parse_server_args(["--kernel-options", "fused-kv-alloc=on"]).engine_config(".").options.fused_kv_alloc is True
    assert resolve_triton_kernel(None, torch.device("cuda"), "fused-kv-alloc")  # reads the device type only
    assert not resolve_triton_kernel(None, torch.device("cpu"), "fused-kv-alloc")
    assert KernelOptions().graph_inputs_advance is None
    assert parse_server_args(["--kernel-options", "graph-inputs-advance=off"]).engine_config(".").options.graph_inputs_advance is False


SPEC = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=1024, max_position_embeddings=512, rope_theta=10_000.0, dtype="float32", seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("kv-alloc") / "model", SPEC)


@pytest.mark.parametrize("page_size", [1, 4])
def test_engine_tokens_and_a_whole_pool_with_the_fused_pop(checkpoint: Path, device: torch.device,
                                                           page_size: int) -> None:
    """fused-kv-alloc: the engine's greedy tokens as with torch's alloc, and after the
    requests finish and the prefix cache is flushed every slot is free again."""
    prompts = [[5, 77, 300, 9], [5, 77, 41, 200, 18, 2]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    common = dict(device=device.type, max_total_tokens=256, max_running_requests=2, page_size=page_size,
                  attention_backend="torch", disable_cuda_graph=True)
    want = [r.token_ids for r in Engine(str(checkpoint), kernel_options="fused-kv-alloc=off", **common).generate(
        input_ids=prompts, sampling_params=params)]
    engine = Engine(str(checkpoint), kernel_options="fused-kv-alloc=on", **common)
    assert engine.built.plan.fused_kv_alloc and engine.scheduler.memory.allocator._pop is not None
    assert [r.token_ids for r in engine.generate(input_ids=prompts, sampling_params=params)] == want
    usage = engine.scheduler.stats().usage
    assert usage.consistent and usage.used == 0 and usage.locked == 0, usage
    assert engine.scheduler.memory.flush_cache()
    allocator = engine.scheduler.memory.allocator
    assert allocator.num_free() == allocator.capacity and engine.scheduler.stats().usage.free == allocator.capacity
    allocator.check()
