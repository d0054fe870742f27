"""The model with ``fused-kernels`` (our triton norm, rotary and SiLU-and-mul) against the torch path.

Both models load the same tiny float32 checkpoint (Llama with GQA and llama3 rope scaling, Qwen2
with q/k/v biases, Qwen3 with per-head q/k norms) and run the same teacher-forced schedule, each
on its own KV pool with the torch attention backend, so that only the fused kernels differ: every
step's logits must agree within FP32_TOL. Through the whole engine, greedy tokens of the fused
model on the triton backend must equal the default engine's. On a CPU the kernels run under
triton's interpreter (conftest.py); tests marked ``gpu`` repeat the comparison in bf16 on CUDA,
through the engine with decode replayed from CUDA graphs (triton) and with flashinfer.

``fused-decode`` (one-token steps through the fused decode kernels, the KV store inside rotary
on the triton backend) is compared the same way: teacher-forced logits of one-token steps on the
triton backend against the torch path, and greedy tokens of batch-1 generation through the engine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy_rule import compare_greedy
from kernel_checks import REL_TOL, few_sms, rel_err

from app.engine import Engine
from app.engine.config import EngineConfig
from app.engine.kernel_plan import KernelOptions, KernelPlan
from app.engine.kernel_specs import BlockLaunch, GemvBlockKnobs, GemvPdlRoles, GemvRowRoles, GemvRowsKnobs, RowLaunch
from app.engine.forward_batch import ForwardBatch, ForwardMode
from app.engine.kv_pool import KVPool, ReqToTokenPool, SlotAllocator
from app.engine.attention import AttentionBackend
from app.engine.make_checkpoint import Llama3RopeScaling, ModelSpec, make_checkpoint
from app.engine.model_config import ModelConfig
from app.engine.models import CausalLM, build_model
from app.engine.models.layers import DecodeKernels
from app.engine.weights import load_weights
from app.ipc.messages import SamplingParams
from app.engine.attention.torch_backend import TorchAttentionBackend
from app.server_args import parse_server_args

FP32_TOL = 1e-5  # relative: ‖fused − torch‖ / ‖torch‖, and max |diff| / max(1, max |logit|)
REPO_ROOT = Path(__file__).resolve().parents[2]
# Triton's kernels and the one-token steps' fused ones, asked for (on a CPU under the interpreter).
DECODE_KERNELS = KernelOptions(fused_kernels=True, triton_gemv=True, fused_decode=True)
DECODE_PLAN = KernelPlan(fused_kernels=True, triton_gemv=True, fused_decode=True)  # the same, for build_model

# 2 layers, vocab 1024, init_std about 1/sqrt(hidden): unit-scale activations, logits far from flat.
_COMMON = dict(num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=1024, max_position_embeddings=1024,
               dtype="float32", init_std=0.09)
SPECS = {
    # GQA 8:2, and llama3 scaling with all three frequency bands at head_dim 32 (wavelengths
    # below 64 kept, above 256 divided by 8, blended between).
    "llama": ModelSpec(architecture="LlamaForCausalLM", num_heads=8, num_kv_heads=2, head_dim=32,
                       rope_theta=500_000.0, seed=11,
                       rope_scaling=Llama3RopeScaling(factor=8.0, original_max_position_embeddings=256), **_COMMON),
    "qwen2": ModelSpec(architecture="Qwen2ForCausalLM", num_heads=4, num_kv_heads=2, rope_theta=1e6,
                       rms_norm_eps=1e-6, tie_word_embeddings=True, seed=12, **_COMMON),
    # head_dim * num_heads (256) != hidden_size, as in Qwen3-0.6B.
    "qwen3": ModelSpec(architecture="Qwen3ForCausalLM", num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=1e6,
                       rms_norm_eps=1e-6, seed=13, **_COMMON),
}

# (mode, rows, prefix_lens, extend_lens): a ragged prefill, the next chunk of one prompt beside a
# one-token extend, then decode steps of all three.
SCHEDULE = [
    (ForwardMode.EXTEND, [0, 1, 2], [0, 0, 0], [5, 23, 11]),
    (ForwardMode.EXTEND, [0, 2], [5, 11], [7, 1]),
    *[(ForwardMode.DECODE, [0, 1, 2], [12 + i, 23 + i, 12 + i], [1, 1, 1]) for i in range(3)],
    (ForwardMode.DECODE, [1], [26], [1]),  # one row: the step triton_gemv serves
]


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp(f"fused-{request.param}") / "model", SPECS[request.param])


def load(model_dir: Path, *, fused: bool, dtype: torch.dtype, device: torch.device, gemv: bool = False,
         decode: bool = False, qkv_rotary: bool = False, silu_out: bool = False, rows: str = "off") -> CausalLM:
    plan = KernelPlan(fused_kernels=fused, triton_gemv=gemv, fused_decode=decode, fused_qkv_rotary=qkv_rotary,
                      fused_silu_out=silu_out, gemv_rows=GemvRowRoles.parse(rows))
    model = build_model(ModelConfig.from_pretrained(model_dir), dtype=dtype, device=device, plan=plan)
    load_weights(model, model_dir)
    return model


@dataclass
class Run:
    """One model with its own slots, KV pool, request table and torch attention backend."""

    model: CausalLM
    allocator: SlotAllocator
    table: ReqToTokenPool
    backend: AttentionBackend

    @classmethod
    def make(cls, model: CausalLM, device: torch.device, *, triton: bool = False) -> Run:
        """With ``triton``, the triton backend (2 KV splits at most: fewer interpreted programs)."""
        allocator = SlotAllocator(256, device=device)
        allocator.free(allocator.alloc(100)[::2])  # scattered slots
        pool = KVPool.for_model(model.config, num_slots=allocator.num_slots, dtype=model.dtype, device=device)
        table = ReqToTokenPool(4, 128, device=device)
        if triton:
            from app.engine.attention.triton_backend import TritonAttentionBackend

            return cls(model, allocator, table, TritonAttentionBackend(pool, table, max_kv_splits=2))
        return cls(model, allocator, table, TorchAttentionBackend(pool, table))

    def step(self, mode: ForwardMode, rows: list[int], prefix: list[int], extend: list[int],
             ids: torch.Tensor) -> torch.Tensor:
        """Logits of every new token in EXTEND steps, of each sequence's last one in DECODE."""
        slots = self.allocator.alloc(sum(extend))
        assert slots is not None
        batch = ForwardBatch.build(mode=mode, req_pool_indices=rows, prefix_lens=prefix, extend_lens=extend,
                                   out_cache_loc=slots, req_to_token_pool=self.table, attn_backend=self.backend)
        with torch.inference_mode():
            return self.model(ids, batch.positions, batch, all_logits=mode is ForwardMode.EXTEND).cpu()


def teacher_forced(
    model_dir: Path, dtype: torch.dtype, device: torch.device, gemv: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(torch path, fused) logits of every step of SCHEDULE, on the same token ids; with ``gemv``
    the fused model's linear layers of decode-sized inputs run our triton_gemv kernel too."""
    runs = [Run.make(load(model_dir, fused=False, dtype=dtype, device=device), device),
            Run.make(load(model_dir, fused=True, dtype=dtype, device=device, gemv=gemv), device)]
    assert not runs[0].model.fused_kernels and runs[1].model.fused_kernels
    assert runs[0].model.small_batch_linear is None and (runs[1].model.small_batch_linear is not None) == gemv
    gen = torch.Generator().manual_seed(0)
    vocab = runs[0].model.config.vocab_size
    steps = []
    for mode, rows, prefix, extend in SCHEDULE:
        ids = torch.randint(0, vocab, (sum(extend),), generator=gen).to(device)
        ref, fused = (run.step(mode, rows, prefix, extend, ids) for run in runs)
        steps.append((ref, fused))
    return steps


@pytest.mark.parametrize("gemv", [False, True], ids=["cublas-linear", "triton-gemv"])
@pytest.mark.usefixtures("few_sms")
def test_teacher_forced_logits_match_torch_path(checkpoint: Path, device: torch.device, gemv: bool) -> None:
    for step, (ref, fused) in enumerate(teacher_forced(checkpoint, torch.float32, device, gemv)):
        assert fused.shape == ref.shape and ref.std() > 0.3  # logits are not flat
        scale = max(1.0, ref.abs().max().item())
        diff = (fused - ref).abs().max().item()
        assert diff <= FP32_TOL * scale, f"step {step}: max abs diff {diff:.3g} > {FP32_TOL} * {scale:.3g}"
        assert rel_err(fused, ref) <= FP32_TOL, f"step {step}: relative error {rel_err(fused, ref):.3g}"


PROMPTS = [[7, 300, 41, 999, 12], [5] * 3 + list(range(100, 117)), [1000, 2, 513]]
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.mark.usefixtures("few_sms")
def test_engine_greedy_tokens_match(checkpoint: Path, device: torch.device) -> None:
    """Fused kernels and the triton backend through the whole engine: the default engine's tokens."""
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=4)
    expected = Engine(str(checkpoint), **common).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    fused = Engine(str(checkpoint), kernel_options="fused-kernels=on", attention_backend="triton", **common)
    assert fused.built.plan.fused_kernels and fused.built.plan.attention == ("triton", "triton")
    got = fused.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert all(len(r.token_ids) == GREEDY.max_new_tokens for r in got)


def kernel_options(*args: str) -> KernelOptions:
    """The kernel options of a server started with ``args``."""
    return parse_server_args(list(args)).engine_config(".").options


@pytest.mark.parametrize("key", ["fused-kernels", "triton-gemv", "overlap-schedule"])
def test_options_parsed_and_automatic_by_default(key: str) -> None:
    field = key.replace("-", "_")
    assert getattr(KernelOptions(), field) is None and getattr(kernel_options(), field) is None
    assert getattr(kernel_options("--kernel-options", f"{key}=on"), field) is True
    assert getattr(kernel_options("--kernel-options", f"{key}=off"), field) is False


def test_defaults_resolve_by_device() -> None:
    from app.engine.kernel_plan import resolve_overlap_schedule, resolve_triton_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_triton_kernel(None, cuda, "fused-kernels") and not resolve_triton_kernel(None, cpu, "fused-kernels")
    assert resolve_triton_kernel(None, cuda, "triton-gemv") and not resolve_triton_kernel(None, cpu, "triton-gemv")
    assert resolve_overlap_schedule(None, cuda) and not resolve_overlap_schedule(None, cpu)  # on with CUDA
    assert resolve_overlap_schedule(True, cpu) and not resolve_overlap_schedule(False, cuda)
    assert not resolve_overlap_schedule(None, cuda, disabled=True)  # --disable-overlap-schedule
    assert parse_server_args(["--disable-overlap-schedule"]).engine_config(".").disable_overlap_schedule
    with pytest.raises(ValueError, match="--disable-overlap-schedule contradicts --kernel-options overlap-schedule=on"):
        resolve_overlap_schedule(True, cuda, disabled=True)


@pytest.mark.parametrize(("flag", "value"), [("kernel-options", "fused-kernels=on"), ("kernel-options", "fused-greedy=on"),
                                             ("decode-attention-backend", "triton")])
def test_flag_needs_cuda_or_interpreter(tmp_path: Path, flag: str, value: object) -> None:
    """On a CPU without TRITON_INTERPRET=1, a clear ValueError naming the flag or option (in a
    fresh process: this one runs with the interpreter on)."""
    model_dir = make_checkpoint(tmp_path / "model", SPECS["llama"].replace(num_layers=1))
    script = textwrap.dedent(f"""
        import sys
        from app.engine import Engine
        try:
            Engine({str(model_dir)!r}, device="cpu", {flag.replace("-", "_")}={value!r})
        except ValueError as exc:
            print(exc)
            sys.exit(3)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"--{flag} {value} needs a CUDA device" in proc.stdout and "TRITON_INTERPRET=1" in proc.stdout


# ---------------------------------------------------------------- one-token steps (fused-decode)

# A prefill of two prompts, then one-token steps (a decode of each sequence and a one-token
# extend, as a chunk's last token), with a two-row decode between them that takes the usual path.
ONE_TOKEN_SCHEDULE = [
    (ForwardMode.EXTEND, [0, 1], [0, 0], [6, 9]),
    (ForwardMode.DECODE, [0], [6], [1]),
    (ForwardMode.EXTEND, [1], [9], [1]),
    (ForwardMode.DECODE, [0, 1], [7, 10], [1, 1]),
    (ForwardMode.DECODE, [1], [11], [1]),
]


@pytest.fixture
def few_gemv_programs(device: torch.device) -> Iterator[None]:
    """The gemv heuristic as for a GPU of one SM: the largest row blocks, so that under the
    interpreter a launch is a few programs instead of hundreds, and on a GPU too, so that the
    specs' small qkv projections keep whole rotary pairs per program (with 132 SMs they get one
    row each, and --fused-qkv-rotary stays off). test_triton_gemv.py covers the H200's tilings.
    The other launches (the fused MLP's) as for two SMs under the interpreter (few_sms)."""
    import app.kernels.triton_gemv as triton_gemv

    with few_sms(), pytest.MonkeyPatch.context() as patch:  # undone in this order: one SM, then two
        patch.setattr(triton_gemv, "device_sms", lambda _device: 1)
        yield


COUNTED = ("add_rms_norm_linear", "silu_mul_linear", "rotary_store_kv", "linear")


def counting(kernels: DecodeKernels, calls: Counter[str]) -> DecodeKernels:
    """``kernels`` whose kernels (COUNTED) count their calls in ``calls``, by field name."""

    def counted(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return kernel(*args, **kwargs)

        return run

    return kernels._replace(**{name: counted(name, getattr(kernels, name)) for name in COUNTED
                               if getattr(kernels, name) is not None})


def teacher_forced_one_token(model_dir: Path, dtype: torch.dtype, device: torch.device, *, triton: bool,
                             qkv_rotary: bool = False, silu_out: bool = False,
                             rows: str = "off") -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Counter[str], int]:
    """(torch path, fused decode) logits of every step of ONE_TOKEN_SCHEDULE; the fused model
    (fused kernels, triton_gemv, decode kernels; with ``qkv_rotary`` the qkv gemv rotating and
    storing K/V; ``rows``: the --gemv-rows roles) runs on the triton backend with ``triton``, else
    on the torch one. Also returns its decode kernels' calls and the number of one-token steps."""
    fused = load(model_dir, fused=True, dtype=dtype, device=device, gemv=True, decode=True, qkv_rotary=qkv_rotary,
                 silu_out=silu_out, rows=rows)
    assert fused.fused_decode is not None
    calls: Counter[str] = Counter()
    fused.use_decode_kernels(counting(fused.fused_decode.kernels, calls))
    runs = [Run.make(load(model_dir, fused=False, dtype=dtype, device=device), device),
            Run.make(fused, device, triton=triton)]
    gen = torch.Generator().manual_seed(1)
    vocab = fused.config.vocab_size
    steps = []
    for mode, rows, prefix, extend in ONE_TOKEN_SCHEDULE:
        ids = torch.randint(0, vocab, (sum(extend),), generator=gen).to(device)
        ref, out = (run.step(mode, rows, prefix, extend, ids) for run in runs)
        steps.append((ref, out))
    return steps, calls, sum(sum(extend) == 1 for _, _, _, extend in ONE_TOKEN_SCHEDULE)


@pytest.mark.parametrize(("backend", "qkv_rotary", "silu_out", "rows"),
                         [("triton", False, False, "off"), ("triton", True, False, "off"), ("triton", True, True, "off"),
                          ("torch", False, False, "off"), ("triton", True, True, "all"), ("triton", False, False, "all")],
                         ids=["triton", "triton-qkv-rotary", "triton-qkv-rotary-silu-out", "torch",
                              "triton-qkv-rotary-silu-out-rows", "triton-rows"])
def test_fused_decode_logits_match_torch_path(checkpoint: Path, device: torch.device, backend: str, qkv_rotary: bool,
                                              silu_out: bool, rows: str, few_gemv_programs: None) -> None:
    """Every step's logits within FP32_TOL of the torch path; each one-token step ran every layer
    through the decode kernels (the rotary kernel storing K/V only on the triton (or flashinfer)
    backend, whose attention can skip the store, and not at all where the qkv gemv rotates and stores: with
    --fused-qkv-rotary on a model without a q/k norm), and the other steps none of them. The
    torch backend (which stores K/V itself) only changes the attention: one
    spec covers it."""
    config = ModelConfig.from_pretrained(checkpoint)
    if backend == "torch" and config.architecture != "LlamaForCausalLM":
        pytest.skip("the torch backend's path is checked on the llama spec")
    steps, calls, one_token_steps = teacher_forced_one_token(checkpoint, torch.float32, device,
                                                             triton=backend == "triton", qkv_rotary=qkv_rotary,
                                                             silu_out=silu_out, rows=rows)
    for step, (ref, fused) in enumerate(steps):
        assert fused.shape == ref.shape and ref.std() > 0.3
        scale = max(1.0, ref.abs().max().item())
        diff = (fused - ref).abs().max().item()
        assert diff <= FP32_TOL * scale, f"step {step}: max abs diff {diff:.3g} > {FP32_TOL} * {scale:.3g}"
        assert rel_err(fused, ref) <= FP32_TOL, f"step {step}: relative error {rel_err(fused, ref):.3g}"
    layers = config.num_layers
    rotated_in_qkv = qkv_rotary and not config.qk_norm  # the specs' shapes all fit otherwise
    stored = layers if backend == "triton" and not rotated_in_qkv else 0
    assert calls == Counter(add_rms_norm_linear=one_token_steps * (2 * layers + 1),
                            silu_mul_linear=0 if silu_out else one_token_steps * layers,
                            linear=one_token_steps * layers if silu_out else 0,  # down after the SiLU epilogue
                            rotary_store_kv=one_token_steps * stored) - Counter()  # (drops zero counts)


@pytest.mark.parametrize("qkv_rotary", [False, True], ids=["fused-decode", "qkv-rotary"])
def test_fused_decode_engine_greedy_tokens(checkpoint: Path, device: torch.device, qkv_rotary: bool,
                                           few_gemv_programs: None) -> None:
    """Batch-1 generation through the engine with fused-decode (and fused-qkv-rotary) on the
    triton backend: the default engine's greedy tokens."""
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=2)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [[7, 300, 41, 999, 12]]
    expected = Engine(str(checkpoint), **common).generate(input_ids=prompt, sampling_params=params)
    fused = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_qkv_rotary=qkv_rotary),
                   attention_backend="triton", **common)
    kernels = fused.scheduler.runner.model.fused_decode.kernels
    plan = fused.built.plan
    assert plan.fused_decode and kernels is not None and plan.fused_qkv_rotary == qkv_rotary
    assert plan.fused_silu_out and kernels.linear is not None  # follows fused-decode
    config = ModelConfig.from_pretrained(checkpoint)
    assert (kernels.qkv_rotary_store is not None) == (qkv_rotary and not config.qk_norm)
    got = fused.generate(input_ids=prompt, sampling_params=params)
    assert got[0].token_ids == expected[0].token_ids and len(got[0].token_ids) == params.max_new_tokens


def test_fused_decode_option() -> None:
    """Auto follows the resolved fused kernels and triton_gemv (on with CUDA, off on a CPU);
    asked for explicitly, it needs both, and says so naming the keys."""
    from app.engine.kernel_plan import resolve_fused_decode

    assert KernelOptions().fused_decode is None and kernel_options().fused_decode is None
    assert kernel_options("--kernel-options", "fused-decode=on").fused_decode is True
    assert kernel_options("--kernel-options", "fused-decode=off").fused_decode is False
    assert resolve_fused_decode(None, fused_kernels=True, triton_gemv=True)  # the default with CUDA
    assert not resolve_fused_decode(None, fused_kernels=True, triton_gemv=False)  # follows, no error
    assert not resolve_fused_decode(None, fused_kernels=False, triton_gemv=False)  # the CPU default
    assert not resolve_fused_decode(False, fused_kernels=True, triton_gemv=True)
    assert resolve_fused_decode(True, fused_kernels=True, triton_gemv=True)
    with pytest.raises(ValueError, match="fused-decode=on needs fused-kernels and triton-gemv on.*triton-gemv=off"):
        resolve_fused_decode(True, fused_kernels=True, triton_gemv=False)
    with pytest.raises(ValueError, match="fused-decode=on needs.*fused-kernels=off"):
        resolve_fused_decode(True, fused_kernels=False, triton_gemv=True)


def test_fused_qkv_rotary_option() -> None:
    """By default it follows fused-decode; asked for, it needs fused-decode and says so naming the keys."""
    from app.engine.kernel_plan import follows_fused_decode

    assert KernelOptions().fused_qkv_rotary is None and kernel_options().fused_qkv_rotary is None
    assert kernel_options("--kernel-options", "fused-qkv-rotary=on").fused_qkv_rotary is True
    key = "fused-qkv-rotary"
    assert follows_fused_decode(None, True, key) and not follows_fused_decode(None, False, key)
    assert not follows_fused_decode(False, True, key)
    assert follows_fused_decode(True, True, key)
    with pytest.raises(ValueError, match="--kernel-options fused-qkv-rotary=on needs fused-decode on"):
        follows_fused_decode(True, False, key)


def test_steps_on_the_triton_backend_rotate_and_store_in_one_kernel(checkpoint: Path, device: torch.device) -> None:
    """Without the decode kernels, every step on the triton backend (prefills, chunks, decode
    batches) rotates q and k and stores K/V in the fused kernels' one kernel, and the logits stay
    within FP32_TOL of the torch path."""
    config = ModelConfig.from_pretrained(checkpoint)
    fused = load(checkpoint, fused=True, dtype=torch.float32, device=device)
    assert fused.fused_decode is None
    calls: Counter[str] = Counter()
    kernels = fused.layers[0].self_attn.kernels
    assert kernels is not None

    def rotary_store_kv(*args: Any, **kwargs: Any) -> Any:
        calls["rotary_store_kv"] += 1
        return kernels.rotary_store_kv(*args, **kwargs)

    for layer in fused.layers:
        layer.self_attn.kernels = kernels._replace(rotary_store_kv=rotary_store_kv)
    runs = [Run.make(load(checkpoint, fused=False, dtype=torch.float32, device=device), device),
            Run.make(fused, device, triton=True)]
    gen = torch.Generator().manual_seed(4)
    for step, (mode, rows, prefix, extend) in enumerate(SCHEDULE):
        ids = torch.randint(0, config.vocab_size, (sum(extend),), generator=gen).to(device)
        ref, out = (run.step(mode, rows, prefix, extend, ids) for run in runs)
        assert rel_err(out, ref) <= FP32_TOL, f"step {step}: relative error {rel_err(out, ref):.3g}"
    assert calls["rotary_store_kv"] == config.num_layers * len(SCHEDULE)


def test_one_token_step_writes_logits_out(checkpoint: Path, device: torch.device, few_gemv_programs: None) -> None:
    """A one-token step through the decode kernels (the batch-1 graph's path) writes the logits
    into ``logits_out`` itself (the lm_head gemv's out=) and returns it: equal to the step without it."""
    if ModelConfig.from_pretrained(checkpoint).architecture != "LlamaForCausalLM":
        pytest.skip("the output projection is the same in every family: the llama spec covers it")
    run = Run.make(load(checkpoint, fused=True, dtype=torch.float32, device=device, gemv=True, decode=True,
                        silu_out=True), device, triton=True)
    vocab = run.model.config.vocab_size
    run.step(ForwardMode.EXTEND, [0], [0], [6], torch.arange(3, 9, device=device))
    slots = run.allocator.alloc(1)
    assert slots is not None
    batch = ForwardBatch.build(mode=ForwardMode.DECODE, req_pool_indices=[0], prefix_lens=[6], extend_lens=[1],
                               out_cache_loc=slots, req_to_token_pool=run.table, attn_backend=run.backend)
    ids = torch.tensor([11], device=device)
    buffer = torch.full((3, vocab), float("nan"), device=device)[:1]
    with torch.inference_mode():
        expected = run.model(ids, batch.positions, batch, float_logits=False)
        got = run.model(ids, batch.positions, batch, float_logits=False, logits_out=buffer)
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(got, expected)


def test_gemv_pdl_roles_reach_each_gemv(checkpoint: Path) -> None:
    """gemv-pdl-mode per role: the decode kernels carry each role's mode, which the model passes
    as pdl=; o_proj (and every linear of a step outside the decode kernels) gets a gemv bound to
    its role's mode, the roles left off an ordinary gemv. (Wiring only: PDL itself needs a GPU.)"""
    from app.kernels.triton_gemv import gemv

    config = ModelConfig.from_pretrained(checkpoint)
    if config.architecture != "LlamaForCausalLM":
        pytest.skip("the wiring is the same in every family: the llama spec covers it")
    common = dict(dtype=torch.float32, device="meta")
    model = build_model(config, plan=replace(DECODE_PLAN, gemv_pdl_mode="o=wait,down=late,lm_head=preload"), **common)
    assert model.fused_decode is not None
    assert model.fused_decode.kernels.pdl == GemvPdlRoles(o="wait", down="late", lm_head="preload")
    layer = model.layers[0]
    assert layer.self_attn.o_proj.small_batch.keywords == {"pdl": "wait"}
    assert layer.mlp.down_proj.small_batch.keywords == {"pdl": "late"}
    assert model.small_batch_linear.keywords == {"pdl": "preload"}
    assert layer.self_attn.qkv_proj.small_batch is gemv and layer.mlp.gate_up_proj.small_batch is gemv
    everywhere = build_model(config, plan=replace(DECODE_PLAN, gemv_pdl_mode="preload"), **common)
    assert everywhere.fused_decode.kernels.pdl == GemvPdlRoles.parse("preload")
    assert build_model(config, plan=DECODE_PLAN, **common).fused_decode.kernels.pdl == GemvPdlRoles()  # off: "" for every role


def test_gemv_rows_roles_reach_each_gemv(checkpoint: Path) -> None:
    """gemv-rows: the decode kernels carry the roles and give each named role the persistent
    config of its weight (None for the others, which keep the default); o_proj's one-row linear
    launches with it. Wiring only: the kernel's numbers are test_fused_decode_logits_match_torch_path's
    and the kernel tests'."""
    config = ModelConfig.from_pretrained(checkpoint)
    if config.architecture != "LlamaForCausalLM":
        pytest.skip("the wiring is the same in every family: the llama spec covers it")
    common = dict(dtype=torch.float32, device="meta")
    model = build_model(config, plan=replace(DECODE_PLAN, gemv_rows=GemvRowRoles.parse("o+gate_up")), **common)
    kernels = model.fused_decode.kernels
    assert kernels is not None and kernels.rows == GemvRowRoles(o=True, gate_up=True)
    layer = model.layers[0]
    gate_up = kernels.config("gate_up", layer.mlp.gate_up_proj.weight, even=True)
    assert gate_up is not None and gate_up.programs_per_sm > 0 and gate_up.block_n % 2 == 0
    assert gate_up.block_k >= layer.mlp.gate_up_proj.weight.shape[1]
    assert kernels.config("down", layer.mlp.down_proj.weight) is None  # not named: the default
    qkv = kernels.config("qkv", layer.self_attn.qkv_proj.weight)
    assert qkv is None
    from app.kernels.triton_gemv import gemv

    assert layer.mlp.down_proj.small_batch is gemv  # not named: the plain gemv
    assert layer.self_attn.o_proj.small_batch is not gemv  # named: the wrapper that passes rows_config's tiling
    assert build_model(config, plan=DECODE_PLAN, **common).fused_decode.kernels.rows == GemvRowRoles()
    assert GemvRowRoles.parse("all") == GemvRowRoles(*(True,) * 5) and GemvRowRoles.parse("all").spec() == "all"
    assert GemvRowRoles.parse("down,qkv").spec() == "qkv,down" and GemvRowRoles.parse("off").spec() == "off"
    for bad in ("gate", "o,o", "all,qkv"):
        with pytest.raises(ValueError, match="gemv-rows takes"):
            GemvRowRoles.parse(bad)
    assert kernel_options("--kernel-options", "gemv-rows=down").gemv_rows == "down"
    from app.engine.kernel_plan import resolve_gemv_rows

    assert resolve_gemv_rows("down", triton_gemv=True) == GemvRowRoles(down=True)
    # By default: gate_up and lm_head with the triton gemv, none without it.
    assert kernel_options().gemv_rows is None
    assert resolve_gemv_rows(None, triton_gemv=True) == GemvRowRoles(gate_up=True, lm_head=True)
    assert resolve_gemv_rows(None, triton_gemv=True, hidden_size=2048) == GemvRowRoles(gate_up=True, lm_head=True)
    assert resolve_gemv_rows(None, triton_gemv=True, hidden_size=4096) == GemvRowRoles(gate_up=True, lm_head=True)
    assert resolve_gemv_rows(None, triton_gemv=True, hidden_size=5120) == GemvRowRoles()  # wider: not measured
    assert resolve_gemv_rows("gate_up", triton_gemv=True, hidden_size=4096) == GemvRowRoles(gate_up=True)
    assert resolve_gemv_rows(None, triton_gemv=False) == GemvRowRoles()
    with pytest.raises(ValueError, match="--kernel-options gemv-rows=down needs triton-gemv on"):
        resolve_gemv_rows("down", triton_gemv=False)


# The interpreter-sized engine of the launch options' tests: triton, the decode kernels, no graphs.
LAUNCH_FLAG_ENGINE = dict(device="cpu", max_total_tokens=512, max_running_requests=1, attention_backend="triton",
                          disable_cuda_graph=True)


def assert_launch_keeps_greedy_tokens(checkpoint: Path, options: KernelOptions, **changes: str) -> Engine:
    """The engine with ``options`` and ``changes`` (launch options) generates the greedy tokens of
    the same engine with ``options`` alone (launched as for two SMs: few interpreted programs); returns it."""
    params = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = [[7, 300, 41, 999, 12]]
    with few_sms():
        want = Engine(str(checkpoint), kernel_options=options, **LAUNCH_FLAG_ENGINE).generate(
            input_ids=prompt, sampling_params=params)
        engine = Engine(str(checkpoint), kernel_options=replace(options, **changes), **LAUNCH_FLAG_ENGINE)
        assert engine.generate(input_ids=prompt, sampling_params=params)[0].token_ids == want[0].token_ids
    return engine


def assert_launch_option_rejects(parse: Callable[[str], Any], key: str, bad_specs: tuple[str, ...]) -> None:
    """Each of ``bad_specs`` is a ValueError naming ``key`` and its syntax, parsed alone and as a
    server argument."""
    for bad in bad_specs:
        with pytest.raises(ValueError, match=f"{key} takes role:name=value"):
            parse(bad)
    with pytest.raises(ValueError, match=f"--kernel-options {key} takes"):
        parse_server_args(["--kernel-options", f"{key}=o:warps=8"])


def test_gemv_rows_config_changes_each_named_launch(checkpoint: Path, device: torch.device) -> None:
    """gemv-rows-config: per role, the persistent launch's knobs over rows_config's tiling; a
    clear error for a bad spec, a role that does not run persistent, or rows that do not fit the
    role's epilogue; through the engine (interpreter-sized), the lm_head at one program an SM of
    8 warps and 4 stages gives the default launch's greedy tokens."""
    config = ModelConfig.from_pretrained(checkpoint)
    if config.architecture != "LlamaForCausalLM":
        pytest.skip("the wiring is the same in every family: the llama spec covers it")
    assert GemvRowsKnobs.parse("") == GemvRowsKnobs() and GemvRowsKnobs().changed_roles() == []
    knobs = GemvRowsKnobs.parse(" lm_head: programs_per_sm=1, num_warps=8,num_stages=4 ; qkv:block_n=1")
    assert knobs.lm_head == RowLaunch(num_warps=8, num_stages=4, programs_per_sm=1)
    assert knobs.changed_roles() == ["qkv", "lm_head"]
    assert_launch_option_rejects(GemvRowsKnobs.parse, "gemv-rows-config", (
        "lm_head", "lm_head:", "head:num_stages=2", "qkv:num_stages=2;qkv:block_n=2", "qkv:stages=2", "qkv:num_warps=3",
        "qkv:block_n=6", "qkv:num_stages=0", "qkv:num_stages=2,num_stages=3"))
    common = dict(dtype=torch.float32, device="meta")
    model = build_model(config, plan=replace(DECODE_PLAN, gemv_rows=GemvRowRoles.parse("qkv,lm_head"),
                                             gemv_rows_knobs=knobs), **common)
    kernels = model.fused_decode.kernels
    assert kernels is not None
    from app.kernels.triton_gemv import rows_config

    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert kernels.config("lm_head", head) == rows_config(*head.shape)._replace(
        num_warps=8, num_stages=4, programs_per_sm=1)
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert kernels.config("qkv", qkv).block_n == 1  # no epilogue that takes row pairs: it fits
    with pytest.raises(ValueError, match="gemv-rows-config: qkv's block_n 1 does not fit its epilogue"):
        kernels.config("qkv", qkv, even=True)
    if device.type == "cuda":
        pytest.skip("the engine part is an interpreter-sized case")
    with pytest.raises(ValueError, match="gemv-rows-config changes qkv, which do not run persistent"):
        Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, gemv_rows="lm_head",
                                                       gemv_rows_config="qkv:num_stages=4"), **LAUNCH_FLAG_ENGINE)
    spec = "lm_head:programs_per_sm=1+num_warps=8+num_stages=4"
    engine = assert_launch_keeps_greedy_tokens(checkpoint, replace(DECODE_KERNELS, gemv_rows="lm_head"),
                                               gemv_rows_config=spec)
    assert engine.built.plan.gemv_rows_knobs == GemvRowsKnobs.parse(spec)


def test_gemv_config_changes_each_named_row_block_launch(checkpoint: Path, device: torch.device) -> None:
    """gemv-config: per role that does not run persistent, the row-block kernel's knobs over
    default_config's tiling (roles it does not name keep the kernel's own choice); a clear error
    for a bad spec, a role that runs persistent, triton-gemv off, or rows that do not fit the
    role's epilogue; through the engine (interpreter-sized), qkv pipelined two K steps deep and o
    in one K step of 8 warps give the default launches' greedy tokens."""
    config = ModelConfig.from_pretrained(checkpoint)
    if config.architecture != "LlamaForCausalLM":
        pytest.skip("the wiring is the same in every family: the llama spec covers it")
    assert GemvBlockKnobs.parse("") == GemvBlockKnobs() and GemvBlockKnobs().changed_roles() == []
    knobs = GemvBlockKnobs.parse(" qkv: num_stages=2 ; o:block_k=128, num_warps=8")
    assert knobs.qkv == BlockLaunch(num_stages=2) and knobs.o == BlockLaunch(block_k=128, num_warps=8)
    assert knobs.changed_roles() == ["qkv", "o"]
    assert_launch_option_rejects(GemvBlockKnobs.parse, "gemv-config", (
        "qkv", "qkv:", "head:num_stages=2", "qkv:num_stages=2;qkv:block_k=64", "qkv:programs_per_sm=1", "qkv:num_warps=3",
        "qkv:block_k=1000", "qkv:num_stages=0"))
    common = dict(dtype=torch.float32, device="meta")
    model = build_model(config, plan=replace(DECODE_PLAN, gemv_rows=GemvRowRoles.parse("lm_head"),
                                             gemv_block_knobs=knobs), **common)
    kernels = model.fused_decode.kernels
    assert kernels is not None
    from app.kernels.triton_gemv import H200_SMS, default_config, gemv, rows_config

    layer = model.layers[0]
    qkv = layer.self_attn.qkv_proj.weight
    assert kernels.config("qkv", qkv) == default_config(1, *qkv.shape, H200_SMS)._replace(num_stages=2)
    assert kernels.config("gate_up", layer.mlp.gate_up_proj.weight) is None  # not named: the kernel's default
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    assert kernels.config("lm_head", head) == rows_config(*head.shape)  # persistent: gemv-rows-config's
    assert layer.self_attn.o_proj.small_batch is not gemv  # the wrapper that passes o's changed launch
    assert layer.mlp.down_proj.small_batch is gemv  # down, not named (and no PDL on a CPU): the kernel itself
    one_row = build_model(config, plan=replace(DECODE_PLAN, gemv_block_knobs=GemvBlockKnobs.parse("qkv:block_n=1")),
                          **common).fused_decode.kernels
    assert one_row is not None and one_row.config("qkv", qkv).block_n == 1  # no epilogue that takes row pairs
    with pytest.raises(ValueError, match="gemv-config: qkv's block_n 1 does not fit its epilogue"):
        one_row.config("qkv", qkv, even=True)
    if device.type == "cuda":
        pytest.skip("the engine part is an interpreter-sized case")
    with pytest.raises(ValueError, match="gemv-config changes lm_head, which run persistent"):
        Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, gemv_rows="lm_head",
                                                       gemv_config="lm_head:num_stages=2"), **LAUNCH_FLAG_ENGINE)
    with pytest.raises(ValueError, match="gemv-config changes the triton gemv's launches, which need triton-gemv on"):
        Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, triton_gemv=False, fused_decode=False,
                                                       gemv_config="qkv:num_stages=2"), **LAUNCH_FLAG_ENGINE)
    spec = "qkv:num_stages=2;o:block_k=128+num_warps=8"
    engine = assert_launch_keeps_greedy_tokens(checkpoint, DECODE_KERNELS, gemv_config=spec)
    assert engine.built.plan.gemv_block_knobs == GemvBlockKnobs.parse(spec)


def test_rows_config_keeps_the_rotary_tiles_within_a_head() -> None:
    """The persistent config at the 1B's shapes, and its limits: even rows for the epilogues that
    take row pairs, at most max_block_n, none past ROWS_MAX_K."""
    from app.kernels.triton_gemv import ROWS_MAX_K, rows_config

    gate_up = rows_config(16384, 2048, even=True)
    assert gate_up is not None and (gate_up.block_n, gate_up.block_k, gate_up.programs_per_sm) == (2, 2048, 4)
    down = rows_config(2048, 8192)
    assert down is not None and (down.block_n, down.block_k, down.programs_per_sm) == (1, 8192, 2)
    assert rows_config(2048, 8192, even=True).block_n == 2
    assert rows_config(96, 64, max_block_n=16).block_n == 16  # 4096 // 64 = 64 rows, capped
    assert rows_config(96, 64, even=True, max_block_n=1) is None
    assert rows_config(4096, ROWS_MAX_K + 1) is None
    assert (gate_up.num_warps, gate_up.num_stages, down.num_warps, down.num_stages) == (4, 3, 4, 3)


def test_fused_silu_out_option() -> None:
    """By default it follows fused-decode; asked for, it needs fused-decode and says so naming the keys."""
    from app.engine.kernel_plan import follows_fused_decode

    assert KernelOptions().fused_silu_out is None and kernel_options().fused_silu_out is None
    assert kernel_options("--kernel-options", "fused-silu-out=off").fused_silu_out is False
    key = "fused-silu-out"
    assert follows_fused_decode(None, True, key) and not follows_fused_decode(None, False, key)
    assert not follows_fused_decode(False, True, key) and follows_fused_decode(True, True, key)
    with pytest.raises(ValueError, match="--kernel-options fused-silu-out=on needs fused-decode on"):
        follows_fused_decode(True, False, key)


def test_fused_greedy_engine_tokens_and_stops(checkpoint: Path, device: torch.device, few_gemv_programs: None) -> None:
    """fused-greedy through the engine (triton backend, decode kernels): batch-1 steps whose
    lm_head gemv folds the argmax into keys that the record kernel reads, and a batch of three
    (the record kernel over torch's argmax), give the default engine's greedy tokens; a stop
    token ends a request where it ends without the flag; the keys are left empty. (The output
    projection and the sampler are the same in every family: the llama spec covers them.)"""
    if ModelConfig.from_pretrained(checkpoint).architecture != "LlamaForCausalLM":
        pytest.skip("the output projection and the sampler are checked on the llama spec")
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=4)
    plain = Engine(str(checkpoint), **common)
    # Eager steps, none run ahead (no CUDA graphs, no overlap on a GPU): one lm_head call per
    # decode step, each seen by the wrapper below.
    fused = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_greedy=True, overlap_schedule=False),
                   attention_backend="triton", disable_cuda_graph=True, **common)
    runner = fused.scheduler.runner
    assert fused.built.plan.fused_greedy and runner.fused_greedy and runner.argmax_keys is not None
    kernels = runner.model.fused_decode.kernels
    assert kernels is not None
    folded: list[bool] = []

    def add_rms_norm_linear(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        folded.append(kwargs.get("argmax_keys") is not None)
        return kernels.add_rms_norm_linear(*args, **kwargs)

    runner.model.fused_decode.kernels = kernels._replace(add_rms_norm_linear=add_rms_norm_linear)
    prompt = [PROMPTS[0]]
    expected = plain.generate(input_ids=prompt, sampling_params=GREEDY)
    got = fused.generate(input_ids=prompt, sampling_params=GREEDY)
    assert got[0].token_ids == expected[0].token_ids and len(got[0].token_ids) == GREEDY.max_new_tokens
    assert folded.count(True) == GREEDY.max_new_tokens - 1  # every decode step, one lm_head call each
    assert [r.token_ids for r in fused.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == \
        [r.token_ids for r in plain.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    stop = expected[0].token_ids[3]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want, have = (engine.generate(input_ids=prompt, sampling_params=params)[0] for engine in (plain, fused))
    assert (have.token_ids, have.finish_reason, have.matched) == (want.token_ids, "stop", stop)
    assert not runner.argmax_keys.any()


def test_fused_split_reduce_engine_greedy_tokens(checkpoint: Path, device: torch.device) -> None:
    """fused-split-reduce through the engine (triton backend, a batch of three and batch 1): the
    default engine's greedy tokens; asked for with another backend, an error naming the option
    and the flags. (The kernel's shapes are covered in test_decode.py: the llama spec covers the wiring.)"""
    from app.engine.kernel_plan import resolve_fused_split_reduce

    if ModelConfig.from_pretrained(checkpoint).architecture != "LlamaForCausalLM":
        pytest.skip("the decode attention's wiring is checked on the llama spec")
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=4)
    expected = Engine(str(checkpoint), **common).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    fused = Engine(str(checkpoint), attention_backend="triton", kernel_options="fused-split-reduce=on", **common)
    assert fused.built.plan.fused_split_reduce and fused.scheduler.runner.attn_backend.reduce_in_stage1
    assert [r.token_ids for r in fused.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == \
        [r.token_ids for r in expected]
    assert kernel_options("--kernel-options", "fused-split-reduce=on").fused_split_reduce is True
    assert KernelOptions().fused_split_reduce is None and not resolve_fused_split_reduce(None, "torch")
    with pytest.raises(ValueError, match="fused-split-reduce=on changes the triton.*run on flashinfer"):
        resolve_fused_split_reduce(True, "flashinfer")


@pytest.mark.usefixtures("few_sms")
def test_triton_decode_knobs_engine_greedy_tokens(checkpoint: Path, device: torch.device) -> None:
    """triton-attention-num-kv-splits=1 (one kernel a layer), a longer split, a wider key block
    and prefetched slots through the engine (triton backend, a batch of three and batch 1): the default engine's
    greedy tokens, the tiling reported as set; out of range, or with another decode backend, an
    error naming the option."""
    from app.engine.kernel_plan import resolve_triton_decode_knobs

    model_config = ModelConfig.from_pretrained(checkpoint)
    if model_config.architecture != "LlamaForCausalLM":
        pytest.skip("the decode attention's wiring is checked on the llama spec")
    # The default key block: 64, or 64 and 128 by batch on CUDA up to head_dim 64 (decode_block_n_for).
    by_batch = "64/128" if device.type == "cuda" and model_config.head_dim <= 64 else "64"
    # ... and each block loading the next block's slots on CUDA (the backend's default there).
    pf = ",prefetch_slots" if device.type == "cuda" else ""
    # ... and layer 0 recording the splits' slots for the later layers (step_slots), on CUDA too.
    ss = ",step_slots" if device.type == "cuda" else ""
    # ... and stage 2 as stage 1's programmatic dependent where it can be (compute capability 9.0+).
    s2 = ",stage2_pdl" if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) else ""
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=4)
    expected = Engine(str(checkpoint), **common)
    want = [r.token_ids for r in expected.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    for knobs, tiling in ((dict(triton_attention_num_kv_splits=1, triton_decode_block_n=32, triton_decode_num_warps=4),
                           f"splits=1,min_len=64,block_n=32,warps=4{pf}{ss}{s2}"),
                          (dict(triton_decode_num_stages=2, triton_decode_early_v=True),
                           f"splits=16,min_len=64,block_n={by_batch},stages=2,early_v{pf}{ss}{s2}"),
                          (dict(triton_decode_min_split_len=4), f"splits=16,min_len=4,block_n={by_batch}{pf}{ss}{s2}"),
                          # one split of several 16-key blocks a sequence, the slots' prefetch the other way round
                          (dict(triton_attention_num_kv_splits=2, triton_decode_block_n=16,
                                triton_decode_prefetch_slots=not pf),
                           f"splits=2,min_len=64,block_n=16{'' if pf else ',prefetch_slots'}{ss}{s2}"),
                          # the recorded slots the other way round (short splits: several a sequence)
                          (dict(triton_decode_step_slots=not ss, triton_decode_min_split_len=4),
                           f"splits=16,min_len=4,block_n={by_batch}{pf}{'' if ss else ',step_slots'}{s2}"),
                          )[:None if device.type == "cuda" else 2]:  # the interpreter (CI): the first two
        engine = Engine(str(checkpoint), attention_backend="triton", kernel_options=KernelOptions(**knobs), **common)
        assert engine.built.decode_tiling == tiling
        assert [r.token_ids for r in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)] == want
        assert engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0].token_ids == want[0]
    assert expected.built.decode_tiling == ("" if expected.built.plan.attention.decode != "triton"
                                            else f"splits=16,min_len=64,block_n={by_batch}{pf}{ss}{s2}")
    options = kernel_options("--kernel-options", "triton-attention-num-kv-splits=2,triton-decode-min-split-len=128,"
                             "triton-decode-block-n=128,triton-decode-num-warps=8,triton-decode-num-stages=3,"
                             "triton-decode-early-v=on,triton-decode-prefetch-slots=on,triton-decode-step-slots=on,"
                             "triton-decode-stage2-pdl=off")
    assert resolve_triton_decode_knobs(options, "triton").backend_kwargs() == \
        {"max_kv_splits": 2, "min_split_len": 128, "decode_block_n": 128, "decode_warps": 8, "decode_num_stages": 3,
         "decode_early_v": True, "decode_prefetch_slots": True, "decode_step_slots": True,
         "decode_stage2_pdl": False}
    with pytest.raises(ValueError, match="triton-attention-num-kv-splits and triton-decode-.*decode steps run on torch"):
        resolve_triton_decode_knobs(options, "torch")
    assert resolve_triton_decode_knobs(KernelOptions(), "torch").backend_kwargs() == {}
    for bad, why in (("triton-attention-num-kv-splits=0", "triton-attention-num-kv-splits takes auto or a whole number from 1"),
                     ("triton-decode-block-n=48", "triton-decode-block-n takes auto or a power of two from 16 to 256"),
                     ("triton-decode-min-split-len=-1", "triton-decode-min-split-len takes auto or a whole number from 1"),
                     ("triton-decode-num-warps=3", "triton-decode-num-warps takes auto or 1, 2, 4, 8 or 16"),
                     ("triton-decode-num-stages=9", "triton-decode-num-stages takes auto or 1 to 8")):
        with pytest.raises(ValueError, match=why):
            parse_server_args(["--kernel-options", bad])


def test_decode_attention_backend_serves_decode_steps_only(checkpoint: Path, device: torch.device,
                                                           few_gemv_programs: None) -> None:
    """--decode-attention-backend triton beside --attention-backend torch: prefill steps (a
    one-token chunk's last step too) on torch, decode steps on triton (with the decode kernels
    storing K/V for it), both over one pool; the all-torch engine's greedy tokens."""
    from app.engine.attention.torch_backend import TorchAttentionBackend
    from app.engine.attention.triton_backend import TritonAttentionBackend

    if ModelConfig.from_pretrained(checkpoint).architecture != "LlamaForCausalLM":
        pytest.skip("the backends' routing is checked on the llama spec")
    common = dict(device=device.type, max_total_tokens=2048, max_running_requests=4)
    expected = Engine(str(checkpoint), attention_backend="torch", **common)
    # Eager steps (no CUDA graphs on a GPU): the recording below sees every step's metadata.
    hybrid = Engine(str(checkpoint), attention_backend="torch", decode_attention_backend="triton",
                    kernel_options=DECODE_KERNELS, disable_cuda_graph=True, **common)
    built, runner = hybrid.built, hybrid.scheduler.runner
    assert built.plan.attention == ("torch", "triton")
    assert isinstance(runner.attn_backend, TorchAttentionBackend)
    assert isinstance(runner.decode_backend, TritonAttentionBackend)
    seen: list[tuple[str, str]] = []
    for backend in (runner.attn_backend, runner.decode_backend):
        init = backend.init_forward_metadata

        def recording(batch, init=init, backend=backend):  # type: ignore[no-untyped-def]
            seen.append((batch.mode.name, type(backend).__name__))
            return init(batch)

        backend.init_forward_metadata = recording  # type: ignore[method-assign]
    for prompts in ([PROMPTS[0]], PROMPTS):
        assert [r.token_ids for r in hybrid.generate(input_ids=prompts, sampling_params=GREEDY)] == \
            [r.token_ids for r in expected.generate(input_ids=prompts, sampling_params=GREEDY)]
    assert set(seen) == {("EXTEND", "TorchAttentionBackend"), ("DECODE", "TritonAttentionBackend")}
    assert expected.built.plan.attention.decode == "torch"  # the same as --attention-backend by default
    config = parse_server_args(["--decode-attention-backend", "triton"]).engine_config(".")
    assert config.decode_attention_backend == "triton" and EngineConfig(model_path=".").decode_attention_backend is None


def test_decode_backend_after_auto() -> None:
    """Unset, the decode backend is the prefill's, except triton after auto on CUDA (the prefill
    then triton where its prefill packs query groups, head_dim 64 with grouped heads, else
    flashinfer where it imports; resolving needs no GPU)."""
    from app.engine.attention.flashinfer_backend import flashinfer_available
    from app.engine.kernel_plan import resolve_attention_backends

    def resolved(device: str, head_dim: int = 64, group: int = 1, attention_backend: str = "auto",
                 decode_attention_backend: str | None = None) -> tuple[str, str]:
        on = torch.device(device)
        return tuple(resolve_attention_backends(attention_backend, decode_attention_backend, on, head_dim, group,
                                                flashinfer_ok=lambda: flashinfer_available(on, torch.bfloat16, head_dim)))

    assert resolved("cuda")[1] == "triton" and resolved("cuda")[0] in ("flashinfer", "triton")
    assert resolved("cuda", group=4) == ("triton", "triton")  # llama-3.2-1b's heads
    assert resolved("cuda", head_dim=128, group=4)[0] == resolved("cuda")[0]  # the 8B's: as without groups
    assert resolved("cuda", attention_backend="triton") == ("triton", "triton")
    assert resolved("cpu") == ("torch", "torch")
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert resolved("cpu", attention_backend="torch", decode_attention_backend="triton") == ("torch", "triton")


def test_both_gpu_backends_attend_over_stored_kv() -> None:
    """The fused kernels store K/V for triton and flashinfer alike (one rotary-and-store kernel
    instead of the backend's own store); torch stores them itself. Checks the classes only:
    flashinfer imports on demand, so this runs without it."""
    from app.engine.attention import AttendStoredKV
    from app.engine.attention.flashinfer_backend import FlashInferAttentionBackend
    from app.engine.attention.triton_backend import TritonAttentionBackend

    assert issubclass(TritonAttentionBackend, AttendStoredKV) and issubclass(FlashInferAttentionBackend, AttendStoredKV)
    assert not issubclass(TorchAttentionBackend, AttendStoredKV)


def test_fused_greedy_option() -> None:
    """On with CUDA and off on a CPU unless asked (then it needs triton: test_flag_needs_cuda_or_interpreter)."""
    from app.engine.kernel_plan import resolve_fused_greedy

    assert KernelOptions().fused_greedy is None and kernel_options().fused_greedy is None
    assert kernel_options("--kernel-options", "fused-greedy=on").fused_greedy is True
    assert resolve_fused_greedy(None, torch.device("cuda")) and not resolve_fused_greedy(False, torch.device("cuda"))
    assert not resolve_fused_greedy(None, torch.device("cpu"))
    assert resolve_fused_greedy(True, torch.device("cuda"))


def test_decode_kernels_need_fused_kernels(tmp_path: Path) -> None:
    model_dir = make_checkpoint(tmp_path / "model", SPECS["llama"].replace(num_layers=1))
    with pytest.raises(ValueError, match="decode kernels need a model built with fused_kernels"):
        build_model(ModelConfig.from_pretrained(model_dir), dtype=torch.float32, device="cpu",
                    plan=KernelPlan(fused_decode=True))


# ---------------------------------------------------------------- on a GPU, in bf16

TOP2_TOL = 0.1  # log-probability units: bf16 logits of unit scale differ by a few 1e-2


@pytest.mark.gpu
def test_bf16_logits_match_torch_path(checkpoint: Path, device: torch.device) -> None:
    for step, (ref, fused) in enumerate(teacher_forced(checkpoint, torch.bfloat16, device)):
        err = rel_err(fused, ref)
        assert err <= REL_TOL[torch.bfloat16], f"step {step}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend,gemv", [("triton", False), ("flashinfer", False), ("flashinfer", True)])
def test_bf16_engine_greedy_tokens(checkpoint: Path, backend: str, gemv: bool, device: torch.device) -> None:
    """The fused engine against the unfused one on the same attention backend: greedy tokens equal
    wherever the unfused top-2 gap is clear (after a near tie the sequences may rightly differ).
    With triton, decode replays CUDA graphs captured with the fused kernels; flashinfer (the
    default on a GPU) reads the rotated q/k as strided views of the qkv output."""
    if backend == "flashinfer":
        from app.engine.attention.flashinfer_backend import flashinfer_available

        if not flashinfer_available(device, torch.bfloat16, ModelConfig.from_pretrained(checkpoint).head_dim):
            pytest.skip("flashinfer is not installed here or does not take this head size")
    common = dict(device="cuda", dtype="bfloat16", attention_backend=backend, max_total_tokens=8192,
                  cuda_graph_max_bs=16)  # the sixteen prompts decode from a graph
    reference = Engine(str(checkpoint), kernel_options=KernelOptions(fused_kernels=False, triton_gemv=False), **common)
    fused = Engine(str(checkpoint), kernel_options=KernelOptions(fused_kernels=True, triton_gemv=gemv), **common)
    assert fused.built.cuda_graph_batch_sizes and fused.built.plan.triton_gemv == gemv
    # Sixteen prompts: the random qwen3 model's logits are nearly flat, so a sequence often meets
    # a near tie within its first tokens; across sixteen, enough positions are compared.
    prompts = [[(31 * i + 7 * n) % 1024 for i in range(n)] for n in (3, 5, 9, 17, 23, 31, 40, 47, 60, 73, 90, 101,
                                                                       120, 133, 150, 170)]
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    expected = reference.generate(input_ids=prompts, sampling_params=params)
    got = fused.generate(input_ids=prompts, sampling_params=params)
    compared, _ = compare_greedy(expected, got, TOP2_TOL)
    assert compared >= len(prompts)
    graphs = fused.scheduler.runner.cuda_graphs
    assert graphs is None or sum(graphs.replays.values()) > 0


@pytest.mark.gpu
def test_bf16_fused_decode_logits_match_torch_path(checkpoint: Path, device: torch.device) -> None:
    """The fused decode kernels compiled for the GPU, in bf16, on the triton backend."""
    steps, calls, one_token_steps = teacher_forced_one_token(checkpoint, torch.bfloat16, device, triton=True)
    for step, (ref, fused) in enumerate(steps):
        err = rel_err(fused, ref)
        assert err <= REL_TOL[torch.bfloat16], f"step {step}: relative error {err:.3g}"
    assert calls["rotary_store_kv"] == one_token_steps * ModelConfig.from_pretrained(checkpoint).num_layers


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_bf16_engine_greedy_tokens_fused_decode(checkpoint: Path, backend: str, device: torch.device) -> None:
    """Batch-1 generation (decode replayed from the CUDA graph of batch 1, captured with the
    decode kernels) against the same engine without fused-decode: greedy tokens equal wherever
    the reference's top-2 gap is clear. On flashinfer too the qkv gemv rotates and stores K/V and
    the backend only attends (it is an AttendStoredKV)."""
    if backend == "flashinfer":
        from app.engine.attention.flashinfer_backend import flashinfer_available

        if not flashinfer_available(device, torch.bfloat16, ModelConfig.from_pretrained(checkpoint).head_dim):
            pytest.skip("flashinfer is not installed here or does not take this head size")
    common = dict(device="cuda", dtype="bfloat16", attention_backend=backend, max_total_tokens=8192,
                  cuda_graph_max_bs=4)
    reference = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_decode=False), **common)
    fused = Engine(str(checkpoint), kernel_options=DECODE_KERNELS, **common)
    assert fused.built.plan.fused_decode and 1 in fused.built.cuda_graph_batch_sizes
    prompts = [[(31 * i + 7 * n) % 1024 for i in range(n)] for n in (3, 9, 23, 47, 90, 150)]
    assert_batch1_greedy_tokens_equal(reference, fused, prompts)


def assert_batch1_greedy_tokens_equal(reference: Engine, fused: Engine, prompts: list[list[int]]) -> None:
    """Each prompt generated alone (every decode step has one row, replayed from the batch-1
    CUDA graph of ``fused``): greedy tokens equal wherever the reference's top-2 gap is clear."""
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=2)
    expected, got = [], []
    for prompt in prompts:
        expected += reference.generate(input_ids=[prompt], sampling_params=params)
        got += fused.generate(input_ids=[prompt], sampling_params=params)
    compared, _ = compare_greedy(expected, got, TOP2_TOL)
    assert compared >= len(prompts)
    graphs = fused.scheduler.runner.cuda_graphs
    assert graphs is not None and graphs.replays[1] > 0


def wide_bf16_spec(num_layers: int, seed: int) -> ModelSpec:
    """A bf16 Llama wide enough (hidden 1024, 16 heads of 64) for the GPU's default gemv configs to
    take the fused epilogues as the Llama shapes do (the specs above get one row a program)."""
    return ModelSpec(architecture="LlamaForCausalLM", num_layers=num_layers, hidden_size=1024, intermediate_size=2048,
                     num_heads=16, num_kv_heads=4, head_dim=64, vocab_size=1024, max_position_embeddings=1024,
                     rope_theta=500_000.0, dtype="bfloat16", init_std=0.05, seed=seed)


# The engine of the batch-1 bf16 GPU comparisons: triton, graphs up to 4 rows (with DECODE_KERNELS).
WIDE_BATCH1_ENGINE = dict(device="cuda", dtype="bfloat16", attention_backend="triton", max_total_tokens=8192,
                          cuda_graph_max_bs=4)


@pytest.mark.gpu
def test_bf16_engine_greedy_tokens_gemv_config(tmp_path: Path, device: torch.device) -> None:
    """gemv-config compiled for the GPU, inside the batch-1 CUDA graph: qkv (norm prologue,
    rotary epilogue, a PDL dependent that waits) and o (one that preloads) with their K loops
    software-pipelined, every step's loads in flight at once (two 512-wide steps three stages
    deep, four 256-wide ones four deep), give the default launches' greedy tokens wherever the
    reference's top-2 gap is clear."""
    checkpoint = make_checkpoint(tmp_path / "model", wide_bf16_spec(num_layers=3, seed=29))
    reference = Engine(str(checkpoint), kernel_options=DECODE_KERNELS, **WIDE_BATCH1_ENGINE)
    spec = "qkv:block_k=512+num_stages=3;o:block_k=256+num_stages=4"
    changed = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, gemv_config=spec), **WIDE_BATCH1_ENGINE)
    assert changed.built.plan.gemv_block_knobs == GemvBlockKnobs.parse(spec)
    prompts = [[(37 * i + 5 * n) % 1024 for i in range(n)] for n in (4, 11, 29, 61, 120)]
    assert_batch1_greedy_tokens_equal(reference, changed, prompts)


@pytest.mark.gpu
def test_bf16_engine_greedy_tokens_fused_qkv_rotary(tmp_path: Path, device: torch.device) -> None:
    """fused-qkv-rotary compiled for the GPU, inside the batch-1 CUDA graph, against the same
    engine without it: greedy tokens equal wherever the reference's top-2 gap is clear. The
    model is wide enough (hidden 1024, 16 heads of 64) for the default gemv config to hold whole
    rotary pairs per program, as the Llama shapes do; the specs above are too narrow for that on
    a GPU (one row a program)."""
    checkpoint = make_checkpoint(tmp_path / "model", wide_bf16_spec(num_layers=2, seed=21))
    common = dict(WIDE_BATCH1_ENGINE)
    reference = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_qkv_rotary=False), **common)
    fused = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_qkv_rotary=True), **common)
    kernels = fused.scheduler.runner.model.fused_decode.kernels
    assert fused.built.plan.fused_qkv_rotary and kernels is not None and kernels.qkv_rotary_store is not None
    assert_batch1_greedy_tokens_equal(reference, fused, [[(37 * i + 5 * n) % 1024 for i in range(n)]
                                                         for n in (2, 11, 40, 130)])


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_bf16_engine_greedy_tokens_fused_greedy(checkpoint: Path, backend: str, device: torch.device) -> None:
    """fused-greedy compiled for the GPU: the argmax keys inside the batch-1 CUDA graph (read
    and cleared by the record kernel after each replay) and the record kernel at batch 3 give
    exactly the tokens of the same engine without it (the logits are the same; only who takes
    their argmax changes), stops included."""
    if backend == "flashinfer":
        from app.engine.attention.flashinfer_backend import flashinfer_available

        if not flashinfer_available(device, torch.bfloat16, ModelConfig.from_pretrained(checkpoint).head_dim):
            pytest.skip("flashinfer is not installed here or does not take this head size")
    common = dict(device="cuda", dtype="bfloat16", attention_backend=backend, max_total_tokens=8192,
                  cuda_graph_max_bs=4)
    reference = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_greedy=False), **common)
    fused = Engine(str(checkpoint), kernel_options=replace(DECODE_KERNELS, fused_greedy=True), **common)
    graphs = fused.scheduler.runner.cuda_graphs
    assert graphs is not None and graphs.writes_argmax_keys(1) and not graphs.writes_argmax_keys(3)
    params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[(31 * i + 7 * n) % 1024 for i in range(n)] for n in (3, 23, 90)]
    for prompt in prompts:
        want = reference.generate(input_ids=[prompt], sampling_params=params)[0].token_ids
        assert fused.generate(input_ids=[prompt], sampling_params=params)[0].token_ids == want
        # Later requests hit the prefix cache: their first token comes from a one-token extend,
        # not the prefill, which in bf16 may break a near-tie the other way. The stop token is
        # taken from such a request of the reference.
        cached = reference.generate(input_ids=[prompt], sampling_params=params)[0].token_ids
        stop = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[cached[5]])
        got = fused.generate(input_ids=[prompt], sampling_params=stop)[0]
        assert got.token_ids == cached[: cached.index(cached[5]) + 1] and got.finish_reason == "stop"
    together = [r.token_ids for r in fused.generate(input_ids=prompts, sampling_params=params)]
    assert together == [r.token_ids for r in reference.generate(input_ids=prompts, sampling_params=params)]
    assert graphs.replays[1] > 0 and graphs.replays[3] > 0
    assert not fused.scheduler.runner.argmax_keys.any()
