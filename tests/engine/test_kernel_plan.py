"""The kernel plan's defaults, pinned whole: what the H200 (compute capability 9.0) runs for the
1B and 8B shapes, what an older GPU and a CPU run, and how options and flags change it. Resolving
reads the device's type and capability only, so these run without a GPU (torch's capability query
is replaced; the plan's own code runs as it does at start)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from app.engine.kernel_plan import (
    COPY_STREAM_MAX_BATCH,
    AttentionBackends,
    KernelOptions,
    KernelPlan,
    resolve_kernel_plan,
)
from app.engine.kernel_specs import DEFAULT_PDL_MODE, PLAIN_MLP_PDL_MODE, GemvRowRoles

LLAMA_1B = SimpleNamespace(hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64)
LLAMA_8B = SimpleNamespace(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128)
CUDA, CPU = torch.device("cuda"), torch.device("cpu")

# What every CUDA device of compute capability 9.0+ runs for the 1B (triton attention: its
# prefill packs the 1B's query groups), and the 8B where flashinfer serves its prefill.
H200_1B = KernelPlan(
    attention=AttentionBackends("triton", "triton"), fused_kernels=True, triton_gemv=True, fused_decode=True,
    gemv_pdl_mode=DEFAULT_PDL_MODE, fused_qkv_rotary=True, fused_silu_out=True, fused_mlp=True,
    gemv_rows=GemvRowRoles(gate_up=True, lm_head=True), fused_greedy=True, fused_kv_alloc=True, cuda_graphs=True,
    graph_inputs_advance=True, prefill_graph_max_tokens=512, overlap_schedule=True, copy_stream=COPY_STREAM_MAX_BATCH,
)
H200_8B = replace(H200_1B, attention=AttentionBackends("flashinfer", "triton"), gemv_pdl_mode=PLAIN_MLP_PDL_MODE,
                  prefill_graph_max_tokens=0)


def plan(model: SimpleNamespace = LLAMA_1B, device: torch.device = CUDA, options: str = "", *,
         flashinfer: bool = True, **flags: object) -> KernelPlan:
    return resolve_kernel_plan(KernelOptions.parse(options), device=device, model_config=model,  # type: ignore[arg-type]
                               flashinfer_ok=lambda: flashinfer, **flags)  # type: ignore[arg-type]


@pytest.fixture
def capability(monkeypatch: pytest.MonkeyPatch):
    """Set the compute capability torch reports for CUDA devices (9.0 unless changed)."""
    def set_capability(major: int, minor: int = 0) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))

    set_capability(9)
    return set_capability


def test_the_h200_defaults(capability) -> None:
    assert plan() == H200_1B
    assert plan().attention_triggers_o and plan().gemv_pdl  # o preloads as a dependent of the attention
    assert plan(LLAMA_8B) == H200_8B
    assert plan(LLAMA_8B, flashinfer=False).attention == ("triton", "triton")
    wider = SimpleNamespace(hidden_size=5120, num_heads=40, num_kv_heads=8, head_dim=128)
    assert plan(wider).gemv_rows == GemvRowRoles()  # not measured there: no persistent gemv


def test_an_older_gpu_and_a_cpu(capability, monkeypatch: pytest.MonkeyPatch) -> None:
    capability(8)
    assert plan() == replace(H200_1B, gemv_pdl_mode="")  # no programmatic dependent launch before Hopper
    assert plan(device=CPU) == KernelPlan()
    assert plan(device=CPU, options="overlap-schedule=on").overlap_schedule
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--kernel-options copy-stream=on needs a CUDA device; here: cpu"):
        plan(device=CPU, options="copy-stream=on")


def test_options_and_flags_change_it(capability) -> None:
    assert plan(options="fused-mlp=off") == replace(H200_1B, fused_mlp=False, gemv_pdl_mode=PLAIN_MLP_PDL_MODE)
    assert plan(options="fused-decode=off") == replace(
        H200_1B, fused_decode=False, fused_qkv_rotary=False, fused_silu_out=False, fused_mlp=False,
        gemv_pdl_mode=PLAIN_MLP_PDL_MODE)
    assert plan(disable_cuda_graph=True) == replace(H200_1B, cuda_graphs=False, graph_inputs_advance=False,
                                                    prefill_graph_max_tokens=0)
    assert plan(disable_overlap_schedule=True) == replace(H200_1B, overlap_schedule=False)
    assert plan(attention_backend="flashinfer") == replace(H200_1B, attention=AttentionBackends("flashinfer", "flashinfer"),
                                                           prefill_graph_max_tokens=0)
    assert plan(options="gemv-pdl-mode=wait,gemv-rows=off,copy-stream=off") == replace(
        H200_1B, gemv_pdl_mode="wait", gemv_rows=GemvRowRoles(), copy_stream=0)
    assert not plan(options="gemv-pdl-mode=off").gemv_pdl
    with pytest.raises(ValueError, match="--kernel-options fused-split-reduce=on changes the triton decode attention"):
        plan(attention_backend="flashinfer", options="fused-split-reduce=on")


def test_the_report_is_json_with_every_choice(capability) -> None:
    report = json.loads(json.dumps(plan().as_dict()))
    assert report["prefill_attention"] == report["decode_attention"] == "triton"
    assert report["gemv_rows"] == "gate_up,lm_head" and report["gemv_pdl_mode"] == DEFAULT_PDL_MODE
    assert report["copy_stream"] == COPY_STREAM_MAX_BATCH and report["gemv_pdl"] is True
    assert report["fused_mlp_knobs"] == {} and report["triton_decode"] == {}
    changed = plan(options="triton-decode-block-n=32,gemv-rows=lm_head,gemv-rows-config=lm_head:num_warps=8")
    assert changed.as_dict()["triton_decode"] == {"block_n": 32}
    assert changed.as_dict()["gemv_rows_knobs"] == {"lm_head": {"num_warps": 8}}
